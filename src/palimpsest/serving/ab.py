"""The A/B router: which arm serves a session.

Serve has no traffic splitting between deployments, so the ingress routes: an explicit arm (the
request's ``arm`` field or the ``X-Palimpsest-Arm`` header) wins; otherwise a sticky hash of the session
id picks an arm by weight. The same session id lands on the same arm on every replica and after a
restart (no state); changing the weights moves only the sessions whose hash crosses a boundary, and a
session keeps the arm recorded at its creation whatever the weights do later.
"""

from __future__ import annotations

import hashlib
from bisect import bisect_right
from dataclasses import dataclass
from typing import Sequence

from palimpsest.platform.types import ConfigError


def unit_hash(key: str) -> float:
    """A stable number in [0, 1) from a string (first 8 bytes of SHA-256)."""
    return int.from_bytes(hashlib.sha256(key.encode("utf-8")).digest()[:8], "big") / 2.0**64


@dataclass(frozen=True)
class Router:
    names: tuple[str, ...]
    weights: tuple[float, ...]
    salt: str = "palimpsest-ab-v1"

    def __post_init__(self) -> None:
        if not self.names or len(self.names) != len(self.weights):
            raise ConfigError("a router needs one weight per arm and at least one arm")
        if any(w < 0 for w in self.weights) or sum(self.weights) <= 0:
            raise ConfigError(f"arm weights must be >= 0 with a positive sum, got {list(self.weights)}")

    @classmethod
    def of(cls, arms: Sequence) -> "Router":
        return cls(tuple(a.name for a in arms), tuple(float(a.weight) for a in arms))

    def assign(self, session_id: str) -> str:
        total = sum(self.weights)
        edges, acc = [], 0.0
        for w in self.weights:
            acc += w / total
            edges.append(acc)
        # The first edge above the hash: a zero-weight arm's edge equals its predecessor's, so it is never hit.
        i = bisect_right(edges, unit_hash(f"{self.salt}:{session_id}"))
        if i >= len(self.names):  # float rounding left the last edge just below 1.0
            i = max(j for j, w in enumerate(self.weights) if w > 0)
        return self.names[i]

    def choose(self, session_id: str, requested: str | None = None) -> str:
        if requested is not None:
            if requested not in self.names:
                raise ConfigError(f"unknown arm {requested!r}; the arms are {list(self.names)}")
            return requested
        return self.assign(session_id)
