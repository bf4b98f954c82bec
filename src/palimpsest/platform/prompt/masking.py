"""Masked steps: shown at full resolution with their result (and, where asked, their tool input) replaced by one
line naming the step, which ``glimpse`` shows whole.

Observation masking and cleared tool uses (``policies/observation_masking.py``, ``policies/clear_tool_uses.py``)
plan them in a plan's ``masked`` column (``render.RESULT_MASKED``, ``render.INPUT_MASKED``); the compiler prices
them here and renders them through ``render.step_messages``. A masked step keeps its resolution (full) and its place:
the compiler may still degrade it like any full step when the budget needs it, and a pinned step (the latest, or
one a client's edit retains) is never masked.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from palimpsest.platform.prompt.render import INPUT_MASKED, UNMASKED
from palimpsest.platform.types import RenderPlan, Resolution

if TYPE_CHECKING:
    from palimpsest.platform.ledger import SessionSnapshot

#: Estimated tokens of one masked line (``[#1234 result hidden: glimpse(#1234)]``, an input line a little more)
#: with SmolLM2's tokenizer. The compiler counts the exact ids of every prompt; this only plans.
NOTE_TOKENS = 16


def masked_of(plan: RenderPlan) -> np.ndarray | None:
    """(M,) int8: how each step of ``plan`` is masked at full, pinned steps never; None where none is."""
    masked = getattr(plan, "masked", None)
    if masked is None or not len(plan):
        return None
    out = np.asarray(masked, dtype=np.int8).copy()
    out[np.asarray(plan.pinned, dtype=bool)] = UNMASKED
    return out if out.any() else None


def masked_costs(snap: "SessionSnapshot", masked: np.ndarray, overhead: int, full: np.ndarray) -> np.ndarray:
    """(M,) estimated tokens of each step at full: ``full`` where it is unmasked; else its own words that stay (the
    thought, the action unless its input is cleared), a line per result (and per cleared input), the template's
    overhead per message."""
    out = np.asarray(full, dtype=np.int64).copy()
    for i in np.flatnonzero(masked).tolist():
        step, count = snap.steps[i], snap.steps[i].tokens
        kept = int(count.get("thought", 0) or 0)
        kept += NOTE_TOKENS if masked[i] == INPUT_MASKED else int(count.get("action", 0) or 0)
        messages = int(bool(step.thought or step.action)) + int(step.observation is not None)
        out[i] = kept + NOTE_TOKENS * int(step.observation is not None) + overhead * max(messages, 1)
    return out


def shown_levels(level: np.ndarray, masked: np.ndarray | None) -> np.ndarray:
    """The levels as a reader of the prompt sees them: a masked step is not raw (it ends the raw tail the soft-memory
    slot follows)."""
    if masked is None:
        return level
    return np.where((masked > 0) & (level == Resolution.FULL), int(Resolution.DETAILED), level)
