"""The A/B router: which arm serves a session.

Serve has no traffic splitting between deployments, so the ingress routes: an explicit arm (the
request's ``arm`` field or the ``X-Palimpsest-Arm`` header) wins; otherwise a sticky hash of the session
id picks an arm by weight. The same session id lands on the same arm on every replica and after a
restart (no state); changing the weights moves only the sessions whose hash crosses a boundary, and a
session keeps the arm recorded at its creation whatever the weights do later.

A **candidate** arm (``candidate_of``) has no weight of its own: its traffic is its control's, as its rollout
stage allows. ``dark`` and ``withdrawn``: none (never assigned, refused when asked for by name; a session
created on it while it was a canary is served by its control). ``canary``: the sessions of the control whose
second hash falls in its ``canary_share`` (sticky per session). ``promoted``: every new session of the control.
The stages come from the ledger (``Replica`` reads the latest decision per candidate at each refresh:
:meth:`Router.with_stages`), so every replica routes alike and a restart keeps them.
"""

from __future__ import annotations

import dataclasses
import hashlib
from bisect import bisect_right
from dataclasses import dataclass
from typing import Mapping, Sequence

from palimpsest.platform.types import ConfigError

#: the stages in which a candidate serves no session
UNSERVED = ("dark", "withdrawn")


def unit_hash(key: str) -> float:
    """A stable number in [0, 1) from a string (first 8 bytes of SHA-256)."""
    return int.from_bytes(hashlib.sha256(key.encode("utf-8")).digest()[:8], "big") / 2.0**64


@dataclass(frozen=True)
class Candidate:
    name: str
    control: str
    stage: str = "dark"
    share: float = 0.1  # of the control's new sessions, while a canary


@dataclass(frozen=True)
class Router:
    names: tuple[str, ...]
    weights: tuple[float, ...]
    salt: str = "palimpsest-ab-v1"
    candidates: tuple[Candidate, ...] = ()

    def __post_init__(self) -> None:
        if not self.names or len(self.names) != len(self.weights):
            raise ConfigError("a router needs one weight per arm and at least one arm")
        if any(w < 0 for w in self.weights) or sum(self.weights) <= 0:
            raise ConfigError(f"arm weights must be >= 0 with a positive sum, got {list(self.weights)}")
        if any(c.name not in self.names or c.control not in self.names for c in self.candidates):
            raise ConfigError("a candidate and its control must be arms of the router")
        if any(self.weights[self.names.index(c.name)] for c in self.candidates):
            raise ConfigError("a candidate arm has no weight of its own")

    @classmethod
    def of(cls, arms: Sequence) -> "Router":
        """The router of a serve config's arms, each candidate at its configured stage (dark by default)."""
        cands = tuple(Candidate(a.name, a.candidate_of, a.stage or "dark", a.canary_share)
                      for a in arms if getattr(a, "candidate_of", None))
        return cls(tuple(a.name for a in arms),
                   tuple(0.0 if getattr(a, "candidate_of", None) else float(a.weight) for a in arms),
                   candidates=cands)

    def with_stages(self, stages: Mapping[str, str]) -> "Router":
        """The same router with each named candidate at its new stage (the others as they were)."""
        cands = tuple(dataclasses.replace(c, stage=stages.get(c.name, c.stage)) for c in self.candidates)
        return self if cands == self.candidates else dataclasses.replace(self, candidates=cands)

    def with_weights(self, weights: Mapping[str, float]) -> "Router":
        """New weights of arms that are no candidates (`serve deploy` shifts traffic live)."""
        cand = {c.name for c in self.candidates}
        if set(weights) & cand:
            raise ConfigError(f"arms {sorted(set(weights) & cand)} are candidates: their traffic is their stage's")
        return dataclasses.replace(self, weights=tuple(float(weights.get(n, w))
                                                       for n, w in zip(self.names, self.weights)))

    def stage(self, arm: str) -> str | None:
        """A candidate's stage; None for an arm that is no candidate."""
        return next((c.stage for c in self.candidates if c.name == arm), None)

    def _draw(self, session_id: str) -> str:
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

    def assign(self, session_id: str) -> str:
        arm = self._draw(session_id)
        mine = [c for c in self.candidates if c.control == arm]
        promoted = next((c for c in mine if c.stage == "promoted"), None)
        if promoted is not None:
            return promoted.name
        u, edge = unit_hash(f"{self.salt}:canary:{arm}:{session_id}"), 0.0
        for c in mine:
            if c.stage == "canary":
                edge += c.share
                if u < edge:
                    return c.name
        return arm

    def serving(self, arm: str) -> str:
        """The arm that serves a session recorded on ``arm``: its control when it is a candidate that serves no
        session now (withdrawn after a canary)."""
        c = next((c for c in self.candidates if c.name == arm), None)
        return c.control if c is not None and c.stage in UNSERVED else arm

    def choose(self, session_id: str, requested: str | None = None) -> str:
        if requested is not None:
            if requested not in self.names:
                raise ConfigError(f"unknown arm {requested!r}; the arms are {list(self.names)}")
            stage = self.stage(requested)
            if stage in UNSERVED:
                raise ConfigError(f"arm {requested!r} is a {stage} candidate: it serves no session")
            return requested
        return self.assign(session_id)
