"""Steps no plan degrades: what a client's context edit keeps raw (``platform.compile.context_edits`` maps the edit onto
it; every policy config carries one, ``PolicyConfigBase.retain``, and ``Runtime.compile`` applies it)."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from palimpsest.platform.prompt import toolcalls
from palimpsest.platform.types import Resolution

if TYPE_CHECKING:
    from palimpsest.platform.ledger.snapshot import SessionSnapshot
    from palimpsest.platform.types import RenderPlan

#: The reason a retained step carries in its plan
RETAINED = "retained: the client's context edit keeps it raw"


class Retain(BaseModel):
    """Steps no plan degrades: those that call one of ``tools`` (or answer for one), and the latest
    ``tool_uses`` tool-calling steps."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    tools: tuple[str, ...] = Field((), description="steps that call these tools are always shown in full")
    tool_uses: int = Field(0, ge=0, le=1_000_000, description="the latest K tool-calling steps are shown in full")

    @property
    def empty(self) -> bool:
        return not self.tools and not self.tool_uses


def tool_names(step) -> set[str]:
    """The tools a step calls or answers for."""
    sc = toolcalls.decode(step)
    names = {c.get("name") for c in sc.tool_calls} | {r.name for r in sc.results} if sc else set()
    if getattr(step, "tool", None):
        names.add(step.tool)
    return {n for n in names if n}


def retained(plan: "RenderPlan", snap: "SessionSnapshot", retain: Retain | None) -> "RenderPlan":
    """``plan`` with the steps ``retain`` names planned full and pinned (the compiler never degrades them)."""
    if retain is None or retain.empty or not len(plan.resolution):
        return plan
    keep = np.zeros(len(plan.resolution), dtype=bool)
    uses = [i for i, s in enumerate(snap.steps[: len(keep)]) if tool_names(s) or s.kind == "tool_call"]
    if retain.tool_uses:
        keep[uses[-retain.tool_uses:]] = True
    if retain.tools:
        wanted = set(retain.tools)
        keep[[i for i in uses if tool_names(snap.steps[i]) & wanted]] = True
    if not keep.any():
        return plan
    reasons = list(plan.reasons) + [RETAINED]
    code = plan.reason_code.copy()
    code[keep & (plan.resolution != Resolution.FULL)] = len(reasons) - 1
    resolution = plan.resolution.copy()
    resolution[keep] = Resolution.FULL
    return dataclasses.replace(plan, resolution=resolution, reason_code=code, reasons=reasons,
                               pinned=plan.pinned | keep)
