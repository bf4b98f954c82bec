"""Plan -> prompt. The only place that knows the prompt layout and the only one that enforces the budget.

Layout: the stable prefix (system, tools, task; byte-identical on every turn of a session, so a
prefix cache survives re-rendering), then the rolling summary if the plan has one, then every
visible step in order at its resolution; the latest steps come last.

Budget: when the planned context overflows, the lowest-scored unpinned steps are degraded one
level at a time (full -> detailed -> brief -> placeholder -> drop), lowest score first, until it
fits; each degradation is recorded in the plan. The prefix and the pinned latest step are never
degraded: a budget that cannot hold them is an error. Token counts are per segment (stored in the
ledger at write time), so the prompt's size is their exact sum, and compiling costs O(M) numpy work
plus rendering only the steps that are shown.
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING

import numpy as np

from palimpsest.platform.render import render_fold, render_prefix, render_segment
from palimpsest.platform.tokens import Tokenizer
from palimpsest.platform.types import (
    BudgetError,
    Prompt,
    RenderPlan,
    Resolution,
    Segment,
)

if TYPE_CHECKING:
    from palimpsest.platform.ledger import SessionSnapshot

_DROP = int(Resolution.DROP)


def validate_budget(budget: object) -> int:
    if isinstance(budget, bool) or not isinstance(budget, (int, np.integer)) or budget <= 0:
        raise BudgetError(f"the token budget must be a positive integer, got {budget!r}")
    return int(budget)


def _costs(snap: "SessionSnapshot") -> np.ndarray:
    """(M, 5) token cost per resolution; DROP costs 0; a representation not written yet is -1."""
    m = snap.t
    costs = np.zeros((m, 5), dtype=np.int64)
    costs[:, :4] = snap.tokens
    return costs


def _available_at_or_below(costs: np.ndarray, level: np.ndarray) -> np.ndarray:
    """The first level >= ``level`` whose representation exists (placeholder always does)."""
    out = level.copy()
    rows = np.arange(costs.shape[0])
    for _ in range(_DROP):
        missing = costs[rows, out] < 0
        if not missing.any():
            break
        out[missing] += 1
    return out


def _next_cheaper(costs: np.ndarray, idx: np.ndarray, level: np.ndarray) -> np.ndarray:
    """For each step in ``idx``, the next lower level that exists and costs strictly less."""
    cur = costs[idx, level]
    nxt = np.full(idx.size, _DROP, dtype=level.dtype)
    found = np.zeros(idx.size, dtype=bool)
    for lv in range(1, _DROP):
        c = costs[idx, lv]
        ok = ~found & (lv > level) & (c >= 0) & (c < cur)
        nxt[ok] = lv
        found |= ok
    return nxt


def _degrade(costs: np.ndarray, level: np.ndarray, pinned: np.ndarray, score: np.ndarray,
             excess: int) -> tuple[np.ndarray, int] | None:
    """One vectorised pass: degrade the lowest-scored unpinned steps one level each, in score order,
    until ``excess`` tokens are saved (or every candidate was degraded once). Mutates ``level``;
    returns the (t, before, after) rows and the tokens saved, or None when nothing can be degraded."""
    cand = np.flatnonzero(~pinned & (level < _DROP))
    if cand.size == 0:
        return None
    order = cand[np.lexsort((cand, score[cand]))]  # lowest score first, older first on ties
    nxt = _next_cheaper(costs, order, level[order])
    cum = np.cumsum(costs[order, level[order]] - costs[order, nxt])
    k = min(int(np.searchsorted(cum, excess)) + 1, order.size)  # the shortest prefix that saves enough
    chosen, before, after = order[:k], level[order[:k]].copy(), nxt[:k]
    level[chosen] = after
    return np.stack([chosen, before, after], axis=1).astype(np.int64), int(cum[k - 1])


def _hidden_runs(level: np.ndarray) -> list[tuple[int, int]]:
    """Maximal runs [a, b] of dropped steps."""
    hidden = np.concatenate([[False], level == _DROP, [False]]).astype(np.int8)
    edges = np.flatnonzero(np.diff(hidden))
    return [(int(a), int(b) - 1) for a, b in zip(edges[::2], edges[1::2])]


def _range_line(snap: "SessionSnapshot", a: int, b: int) -> str:
    first, last = snap.steps[a], snap.steps[b]
    if a == b:
        return f"[t={first.t} hidden: glimpse(#{first.id})]\n"
    return f"[t={first.t}..{last.t} hidden ({b - a + 1} steps, ids #{first.id}..#{last.id}): glimpse any]\n"


def compile_plan(snap: "SessionSnapshot", plan: RenderPlan, budget: int, tokenizer: Tokenizer) -> Prompt:
    """Render ``plan`` within ``budget``; mutates ``plan`` (final resolutions and degradations)."""
    budget = validate_budget(budget)
    if len(plan) != snap.t:
        raise ValueError(f"plan covers {len(plan)} steps but the snapshot has {snap.t}")
    prefix = render_prefix(snap.session)
    prefix_counts = tokenizer.count_batch([text for _, _, text in prefix])
    prefix_tokens = sum(prefix_counts)

    costs = _costs(snap)
    level = _available_at_or_below(costs, plan.resolution.astype(np.int64))
    rows = np.arange(snap.t)
    # A summary never costs more than the raw step it stands for: show the raw one instead.
    summary = (level == Resolution.DETAILED) | (level == Resolution.BRIEF)
    level[summary & (costs[rows, level] >= costs[:, Resolution.FULL])] = Resolution.FULL

    pinned = plan.pinned
    need = prefix_tokens + int(costs[pinned, Resolution.FULL].sum())
    if need > budget:
        raise BudgetError(
            f"budget {budget} cannot hold the prefix ({prefix_tokens} tokens) plus the latest step "
            f"({need - prefix_tokens} tokens) of session {snap.session.id!r}"
        )
    level[pinned] = Resolution.FULL

    fold = plan.fold
    fold_text = render_fold(fold.text, fold.upto) if fold is not None else None
    fold_tokens = tokenizer.count(fold_text) if fold_text else 0

    total = prefix_tokens + fold_tokens + int(costs[rows, level].sum())
    degraded: list[np.ndarray] = []
    while total > budget:
        step = _degrade(costs, level, pinned, plan.score, total - budget)
        if step is None:
            break
        degraded.append(step[0])
        total -= step[1]
    runs, run_texts, run_counts = [], [], []
    if plan.fold_ranges:
        # Hidden runs of steps show as one line each, so the actor knows they exist and can glimpse
        # them; the lines cost tokens too, so degrade further until everything fits.
        while True:
            runs = _hidden_runs(level)
            run_texts = [_range_line(snap, a, b) for a, b in runs]
            run_counts = tokenizer.count_batch(run_texts)
            if total + sum(run_counts) <= budget:
                break
            step = _degrade(costs, level, pinned, plan.score, total + sum(run_counts) - budget)
            if step is None:
                break
            degraded.append(step[0])
            total -= step[1]
        total += sum(run_counts)
    if total > budget and fold_text is not None:
        total -= fold_tokens
        fold_text, fold_tokens = None, 0
        plan.info["fold_dropped"] = True

    plan.resolution = level.astype(np.int8)
    plan.degraded = np.concatenate(degraded) if degraded else np.zeros((0, 3), dtype=np.int64)

    segments = [Segment(kind, role, text, n) for (kind, role, text), n in zip(prefix, prefix_counts)]
    if fold_text is not None:
        segments.append(Segment("fold", "user", fold_text, fold_tokens))
    run_at = {a: (text, n) for (a, _), text, n in zip(runs, run_texts, run_counts)}
    for i in np.flatnonzero((level < _DROP) | np.isin(np.arange(snap.t), list(run_at))).tolist():
        step = snap.steps[i]
        if i in run_at:
            text, n = run_at[i]
            segments.append(Segment("range", "user", text, n, t=step.t, step_id=step.id, resolution=Resolution.DROP))
            continue
        res = Resolution(int(level[i]))
        text = render_segment(step, step.id, res, snap.body(i, res))
        segments.append(Segment("step", "user", text, int(costs[i, res]), t=step.t, step_id=step.id, resolution=res))
    tokens = sum(s.tokens for s in segments)
    prefix_text = "".join(text for _, _, text in prefix)
    body = "".join(s.text for s in segments)
    return Prompt(
        segments=tuple(segments),
        tokens=tokens,
        prefix_tokens=prefix_tokens,
        prefix_hash=hashlib.sha256(prefix_text.encode()).hexdigest(),
        prompt_hash=hashlib.sha256(body.encode()).hexdigest(),
    )
