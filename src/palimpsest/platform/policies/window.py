"""`window`: the last K steps raw, everything older dropped from view (never from the ledger)."""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar, Literal

import numpy as np
from pydantic import Field

from palimpsest.platform.policies.base import PolicyConfigBase, PolicyDeps, Reasons, new_plan, recency
from palimpsest.platform.types import RenderPlan, Resolution

if TYPE_CHECKING:
    from palimpsest.platform.ledger import SessionSnapshot


class WindowConfig(PolicyConfigBase):
    """A sliding window of the most recent steps."""

    type: Literal["window"] = "window"
    name: ClassVar[str] = "window"
    k: int = Field(8, ge=1, le=100_000, description="number of most recent steps shown raw")

    def build(self, deps: PolicyDeps | None = None) -> "WindowPolicy":
        return WindowPolicy(self)


class WindowPolicy:
    name = "window"

    def __init__(self, cfg: WindowConfig):
        self.cfg = cfg
        self.config_hash = cfg.config_hash()

    def plan(self, snap: "SessionSnapshot", budget: int) -> RenderPlan:
        m, k = snap.t, self.cfg.k
        reasons = Reasons()
        inside = np.arange(m) >= m - k
        res = np.where(inside, Resolution.FULL, Resolution.DROP).astype(np.int8)
        codes = np.where(inside, reasons(f"within the last {k} steps"), reasons(f"older than the last {k} steps"))
        return new_plan(self.name, self.config_hash, snap, res, recency(m), codes, reasons, history=self.cfg.history)
