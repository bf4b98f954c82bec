"""Which policy serves a turn: the session's arm, a tenant's pin, and the request's context edit, one owner.

A tenant (``auth.tenants.<name>``) may pin the policy, the budget and the compaction mode of every session its
key opens: ``policy`` replaces the arm's policy config, ``budget`` the arm's budget, and ``compaction`` is
``epochs``, ``per_turn`` or ``off`` (the ``full`` policy planned every turn: every step raw, the oldest
degraded only past the budget, which stays a hard bound). A request's context edit
(``platform.compile.context_edits``) applies on top. Each distinct policy config is built once; the served row of every
turn names the pin it ran under (``tenant_pin``) and the config it used (``policy_hash``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from palimpsest.platform.compile.budget import Budget
from palimpsest.platform.compile.context_edits import ContextEdits, edited_config
from palimpsest.platform.policies import parse_policy_config
from palimpsest.platform.types import PalimpsestError

#: The policy a tenant gets with ``compaction: off``
OFF = {"type": "full", "compaction": {"mode": "per_turn"}}


class PinnedError(PalimpsestError):
    """A request asks for what its tenant's pin fixes otherwise (a 400 naming the field)."""


@dataclass(frozen=True)
class Pin:
    """A tenant's pinned turn settings (None fields: the arm's)."""
    tenant: str
    policy: Any = None  # a policy config
    budget: int | None = None
    compaction: str | None = None

    def record(self) -> dict:
        return {"tenant": self.tenant, "budget": self.budget, "compaction": self.compaction,
                "policy": self.policy.config_hash() if self.policy is not None else None}


def pins(cfg) -> dict[str, Pin]:
    """Every tenant that pins something (a config error is raised when the server's config is parsed)."""
    out = {}
    for name, t in cfg.auth.resolved().items():
        if t.policy is None and t.budget is None and t.compaction is None:
            continue
        policy = None
        if t.compaction == "off":
            policy = parse_policy_config(OFF)
        elif t.policy is not None:
            policy = parse_policy_config(t.policy)
        out[name] = Pin(name, policy, t.budget, t.compaction)
    return out


class TurnPolicies:
    """The policy of each turn (``TurnService`` asks it once per turn)."""

    def __init__(self, cfg, runtime, policies: dict):
        self.cfg, self.runtime, self.policies = cfg, runtime, policies
        self.pins = pins(cfg)
        self._built: dict[str, Any] = {}  # policies under a pin or an edit, by config hash

    def pin(self, session_id: str) -> Pin | None:
        """The pin of the tenant that owns ``session_id`` (tenants' sessions are ``<tenant>::<id>``)."""
        return self.pins.get(session_id.split("::", 1)[0]) if "::" in session_id else None

    def budget(self, pin: Pin | None, asked: int | None) -> int | None:
        """The turn's budget: the pinned one (a request naming another is refused), else what it asked for."""
        if pin is None or pin.budget is None:
            return asked
        if asked is not None and asked != pin.budget:
            raise PinnedError(f"budget: this tenant's budget is pinned to {pin.budget} (asked {asked})")
        return pin.budget

    def policy(self, arm: str, pin: Pin | None, edits: ContextEdits | None, budget: Budget):
        """The arm's policy, or the pinned one, with the compaction mode pinned and the edit applied. A pinned
        ``off`` or ``per_turn`` admits no context edit (an edit sets epoch watermarks): it is refused."""
        if pin is None and edits is None:
            return self.policies[arm]
        if edits is not None and edits.literal and pin is not None and pin.policy is not None:
            raise PinnedError("context_management: this tenant's policy is pinned; "
                              "an edit's own rule cannot replace it")
        if edits is not None and pin is not None and pin.compaction in ("off", "per_turn"):
            raise PinnedError(f"context_management: this tenant's compaction is pinned to {pin.compaction!r}; a "
                              "context edit cannot apply")
        cfg = pin.policy if pin is not None and pin.policy is not None else self.cfg.arm(arm).policy_config()
        if pin is not None and pin.compaction in ("epochs", "per_turn"):
            cfg = cfg.model_copy(update={"compaction": cfg.compaction.model_copy(update={"mode": pin.compaction})})
        if edits is not None:
            cfg = edited_config(cfg, edits, budget.total, budget.total - budget.prompt)
        key = cfg.config_hash()
        if key not in self._built:
            self._built[key] = self.runtime.policy(cfg)
        return self._built[key]

    @staticmethod
    def recorded(pin: Pin | None, policy) -> dict:
        """What the served row of a turn records of its policy."""
        out = {"policy_hash": policy.config_hash}
        if pin is not None:
            out["tenant_pin"] = json.dumps(pin.record(), sort_keys=True)
        return out
