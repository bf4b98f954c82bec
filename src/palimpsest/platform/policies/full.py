"""`full`: every step raw, as ReAct shows it. The baseline every compression is measured against."""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar, Literal

import numpy as np
from pydantic import Field

from palimpsest.platform.compile.folding import HistoryBound
from palimpsest.platform.policies.base import PolicyConfigBase, PolicyDeps, Reasons, new_plan, recency
from palimpsest.platform.types import RenderPlan, Resolution

if TYPE_CHECKING:
    from palimpsest.platform.ledger import SessionSnapshot


class FullConfig(PolicyConfigBase):
    """Every step at full resolution (ReAct). Over budget, the compiler degrades the oldest first."""

    type: Literal["full"] = "full"
    name: ClassVar[str] = "full"
    history: HistoryBound = Field(default_factory=lambda: HistoryBound(recent_window=0),
                                  description="off by default: full shows every step (the reference)")

    def build(self, deps: PolicyDeps | None = None) -> "FullPolicy":
        return FullPolicy(self)


class FullPolicy:
    name = "full"

    def __init__(self, cfg: FullConfig):
        self.cfg = cfg
        self.config_hash = cfg.config_hash()

    def plan(self, snap: "SessionSnapshot", budget: int) -> RenderPlan:
        m = snap.t
        reasons = Reasons()
        codes = np.full(m, reasons("full history"), dtype=np.int16)
        res = np.full(m, Resolution.FULL, dtype=np.int8)
        return new_plan(self.name, self.config_hash, snap, res, recency(m), codes, reasons, history=self.cfg.history)
