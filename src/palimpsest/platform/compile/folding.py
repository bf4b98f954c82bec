"""Old history at a bounded cost: the compiler's fold of everything older than the recent window.

A policy plans every step of the history. Over thousands of steps even one-line placeholders add up
(3,000 placeholders are ~40K tokens) and crowd the recent steps out of the budget. Every policy config
therefore carries a :class:`HistoryBound`: the last ``recent_window`` steps are *recent*, everything before
them is *old*, and old history may cost at most ``old_share`` of the room (budget − reserve − prefix).

When the plan's old history costs more than that (and only then: short sessions compile exactly as
planned), the compiler folds it (:func:`fold_old_history`):

1. Old placeholders are merged into range lines: each maximal run of old steps shown as a placeholder or
   hidden becomes one line naming its t and id range (``glimpse`` reaches every step in it).
2. While old history still costs more than its cap, the lowest-scored old steps are degraded one level at a
   time (a placeholder counts as hidden there), which also merges neighbouring runs into one line: the fold
   is hierarchical by range, a coarser fold each round, down to one line for the whole old history.

The recent window is protected first: the compiler's degradation order (:func:`protected_order`) degrades
every old step before any recent one. The plan records what the fold did (``info["folded"]``) and every
level it changed (``plan.degraded``, with the audit). Departures from the seeds: docs/methods.md.
"""

from __future__ import annotations

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from palimpsest.platform.types import Resolution

_DROP = int(Resolution.DROP)
_PH = int(Resolution.PLACEHOLDER)
#: Added to the scores of the recent window so that every old step is degraded before any recent one.
_RECENT = 1e12
#: Estimated tokens of one range line's content (``[t=a..b hidden (n steps, ids #x..#y): glimpse any; they name
#: <untrusted source="tool">a, b</untrusted>]``): its mean on the dev trajectories with SmolLM2's tokenizer
#: (57.8; 23.8 without the identifiers). The compiler counts the exact ids of every prompt; this only plans.
RANGE_LINE_TOKENS = 60


class HistoryBound(BaseModel):
    """How much of the budget history older than the recent window may take (every policy has one)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    recent_window: int = Field(32, ge=0, le=100_000, description="the most recent steps, protected: degraded only "
                               "after every older step (0 turns the bound off)")
    old_share: float = Field(0.5, gt=0.0, le=1.0, description="the most of the room (budget - reserve - prefix) "
                             "that steps older than the recent window may cost; beyond it they fold into range lines")


def protected_order(score: np.ndarray, recent_window: int) -> np.ndarray:
    """The scores the compiler degrades by: the plan's, with the recent window above every old step."""
    eff = np.asarray(score, dtype=np.float64).copy()
    if recent_window > 0 and eff.size:
        eff[max(0, eff.size - recent_window):] += _RECENT
    return eff


def _runs(hidden: np.ndarray) -> int:
    """The number of maximal True runs."""
    if not hidden.size:
        return 0
    return int(hidden[0]) + int(np.count_nonzero(hidden[1:] & ~hidden[:-1]))


def old_cost(costs: np.ndarray, level: np.ndarray, old_end: int, line_cost: int, ranges: bool) -> int:
    """Estimated tokens of steps 0..old_end-1 at ``level``: shown steps plus one line per hidden run."""
    lv = level[:old_end]
    shown = lv < _DROP
    total = int(costs[np.flatnonzero(shown), lv[shown]].sum())
    return total + (_runs(~shown) * line_cost if ranges else 0)


def fold_old_history(costs: np.ndarray, level: np.ndarray, score: np.ndarray, pinned: np.ndarray,
                     bound: HistoryBound | None, room: int, line_cost: int, ranges: bool
                     ) -> tuple[list[np.ndarray], dict] | None:
    """Fold old history into range lines until it costs at most ``bound.old_share * room`` (estimated).

    Mutates ``level``; returns the (t, before, after) rows it applied (the compiler gives those steps a fold
    reason) and what it did, or None when the old history already fits its share (nothing changes)."""
    if bound is None or bound.recent_window <= 0:
        return None
    m = level.size
    old_end = max(0, m - bound.recent_window)
    if old_end == 0:
        return None
    cap = int(max(room, 0) * bound.old_share)
    before_cost = old_cost(costs, level, old_end, line_cost, ranges)
    if before_cost <= cap:
        return None
    degraded: list[np.ndarray] = []
    movable = ~pinned[:old_end]

    def merge_placeholders() -> None:
        ph = np.flatnonzero(movable & (level[:old_end] == _PH))
        if ph.size:
            degraded.append(np.stack([ph, level[ph].astype(np.int64), np.full(ph.size, _DROP)], axis=1))
            level[ph] = _DROP

    merge_placeholders()
    for _ in range(256):
        over = old_cost(costs, level, old_end, line_cost, True) - cap
        if over <= 0:
            break
        cand = np.flatnonzero(movable & (level[:old_end] < _DROP))
        if cand.size == 0:
            break
        order = cand[np.lexsort((cand, score[cand]))]  # lowest score first, older first on ties
        lv = level[order]
        nxt = np.minimum(lv + 1, _DROP)
        while True:  # the next level that exists (a summary not written yet is skipped)
            missing = (nxt < _DROP) & (costs[order, np.minimum(nxt, _DROP)] < 0)
            if not missing.any():
                break
            nxt[missing] += 1
        nxt[nxt >= _PH] = _DROP  # old placeholders are range lines
        saved = np.cumsum(costs[order, lv] - np.where(nxt < _DROP, costs[order, np.minimum(nxt, _DROP)], 0))
        k = min(int(np.searchsorted(saved, over)) + 1, order.size)
        chosen = order[:k]
        degraded.append(np.stack([chosen, lv[:k].astype(np.int64), nxt[:k].astype(np.int64)], axis=1))
        level[chosen] = nxt[:k]
    after = old_cost(costs, level, old_end, line_cost, True)
    lv = level[:old_end]
    info = {"old_steps": old_end, "cap": cap, "before": before_cost, "after": after,
            "shown": int(np.count_nonzero(lv < _DROP)), "range_lines": _runs(lv == _DROP)}
    return degraded, info


__all__ = ["HistoryBound", "RANGE_LINE_TOKENS", "fold_old_history", "old_cost", "protected_order"]
