"""A turn under compaction epochs: a boundary compacts the history to the low watermark once
(``compiler.compile_plan``), and every turn until the next boundary appends its new steps to that prompt byte
for byte, so the actor's prefix cache holds it (``platform/compile/epochs.py`` owns the boundary and its watermarks)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import numpy as np

from palimpsest.platform.compile import compiler
from palimpsest.platform.compile.budget import Budget
from palimpsest.platform.compile.compiler import assemble_prompt, compile_plan, messages_per_step, prefix_segments
from palimpsest.platform.compile.epochs import (
    Boundary,
    Compaction,
    boundary_of,
    empty_boundary,
    estimate_extension,
    extend,
    extended_plan,
)
from palimpsest.platform.compile.folding import RANGE_LINE_TOKENS
from palimpsest.platform.prompt.chat import (
    chat_ids,
    message_overhead,
    prefix_messages,
    prefix_size,
)
from palimpsest.platform.prompt.tokens import ChatTokenizer
from palimpsest.platform.types import (
    BudgetError,
    Prompt,
    RenderPlan,
    Resolution,
)

if TYPE_CHECKING:
    from palimpsest.platform.ledger import SessionSnapshot

_DROP = int(Resolution.DROP)


def compile_epoch(snap: "SessionSnapshot", plan_at: Callable[[int], RenderPlan], limit: Budget,
                  tokenizer: ChatTokenizer, prev: Boundary | None, compaction: Compaction,
                  policy: tuple[str, str] = ("", ""), recent: int = 1) -> tuple[RenderPlan, Prompt, Boundary, bool]:
    """One turn of a compaction epoch (:mod:`palimpsest.platform.compile.epochs`): the previous boundary's prompt plus
    the steps appended since, raw, unless those ids plus the reserve would pass ``compaction.high`` x the total;
    then a boundary: ``plan_at(plan budget)`` plans anew and the prompt is compacted to ``compaction.low`` x
    budget. A boundary never degrades the policy's ``recent`` latest steps (PACE's N, the latest step for
    every policy): where the low watermark cannot hold them in full, it compacts to the lowest higher target
    that can, in tenths of the budget up to halfway to the high watermark (so the epoch still has room to
    grow); where none can, to the low watermark. Where the low watermark cannot hold the prefix and the latest
    step at all, the lowest higher target that can, up to the whole budget. The audit's ``recent`` says which
    happened. Returns (plan, prompt, the boundary in effect, whether this turn is a new boundary). ``policy``:
    the policy's (name, config hash), named by the plan of an append-only turn."""
    if not isinstance(limit, Budget):
        raise TypeError(f"limit must be a Budget, got {type(limit).__name__}")
    budget, reserve = limit.total, limit.reserve
    prefix = prefix_messages(snap.session)
    prefix_tokens = prefix_size(tokenizer, prefix)
    overhead = message_overhead(tokenizer)
    base = prev if prev is not None and prev.t <= snap.t else empty_boundary(prefix, prefix_segments(prefix))
    high = int(compaction.high * budget)
    base_tokens = int(base.info.get("tokens", prefix_tokens))
    if prev is not None and base is prev and prev.t == snap.t:
        # A boundary stored at this very step is this step's prompt, as stored, whatever the watermark (it may
        # sit past it where only the whole budget held the prefix): a retry of the turn and the replica that
        # lost the race to compact it serve it byte for byte, and never compact again
        msgs, segments = extend(base, snap, overhead)
        ids = chat_ids(tokenizer, msgs, base.split)
        if len(ids) + reserve <= budget:
            plan = extended_plan(base, snap, *policy)
            return plan, assemble_prompt(tokenizer, prefix, msgs, ids, segments, prefix_tokens, reserve), base, False
    estimate = estimate_extension(base, snap, base_tokens, overhead, messages_per_step(snap))
    before = estimate
    # An extension far past the watermark (a long history met for the first time) is not counted exactly.
    if estimate + reserve <= high * 1.25 + 64:
        msgs, segments = extend(base, snap, overhead)
        ids = chat_ids(tokenizer, msgs, base.split)
        before = len(ids)
        if len(ids) + reserve <= high:
            plan = extended_plan(base, snap, *policy)
            return plan, assemble_prompt(tokenizer, prefix, msgs, ids, segments, prefix_tokens, reserve), base, False
    low = max(int(compaction.low * budget), 1)
    # The oldest region as the previous boundary rendered it, within `keep` of the room: the cache keeps it.
    kept = _kept_prefix(base, snap, overhead, int(compaction.keep * max(low - reserve - prefix_tokens, 0)))

    def planned(plan_budget: int) -> RenderPlan:
        plan = plan_at(plan_budget)
        if kept:
            plan.resolution[:kept] = base.resolution[:kept]
            plan.frozen = np.zeros(len(plan), dtype=bool)
            plan.frozen[:kept] = True
            plan.lined = _lined(base, snap, kept)
            plan.reason_code[:kept] = len(plan.reasons)
            plan.reasons.append(f"kept as the compaction boundary at t={base.t} rendered it (the prefix cache "
                                "holds it)")
            plan.info["kept"] = {"steps": kept, "boundary_t": base.t}
        return plan

    n_recent = min(max(int(recent), 1), snap.t)

    def whole(p: RenderPlan) -> bool:
        """The latest ``n_recent`` steps are shown in full (none of them cut to its head and tail)."""
        if not n_recent:
            return True
        cut = {e["t"] for e in p.info.get("elided", [])}
        return bool((p.resolution[len(p) - n_recent:] == Resolution.FULL).all()) and not any(
            s.t in cut for s in snap.steps[len(p) - n_recent:])

    # the low watermark, then higher targets for the recent steps, at most halfway to the high watermark (a
    # boundary at the high one would make the next turn one too); where none of them can hold the prefix and
    # the latest step, the high watermark, then the budget
    ceiling = (low + high) // 2
    raised = [b for b in range(low + budget // 10, ceiling, budget // 10 or 1)] + [ceiling] if ceiling > low else []
    first = chosen = None
    error: BudgetError | None = None
    for target in dict.fromkeys([low, *raised, high, budget]):
        if reserve >= target:
            continue  # this watermark cannot hold even the reserve
        at = limit.of_total(target)
        try:
            attempt = planned(at.prompt)
            compiled = compile_plan(snap, attempt, at, tokenizer, slot="end")
        except BudgetError as e:
            error = e
            continue
        first = first or (attempt, compiled, target)
        if whole(attempt) and target <= ceiling:
            chosen = (attempt, compiled, target)
            break
        if target >= ceiling:
            break  # no target up to the ceiling keeps them (or none below it fit at all): the first that fit
    if first is None:
        raise error or BudgetError(f"the budget of {budget} cannot hold the reserve of {reserve}")
    plan, prompt, target = chosen or first
    recent_info = {"n": n_recent, "full": whole(plan), "first_target": first[2], "raised": target != first[2]}
    low = target
    kept = np.concatenate([base.resolution, np.full(snap.t - base.t, Resolution.FULL, np.int8)])
    changed = int(np.count_nonzero(kept != plan.resolution)) if kept.size == len(plan) else len(plan)
    info = {"t": snap.t, "previous_t": base.t, "previous_id": base.id, "before": int(before), "reserve": int(reserve),
            "high": high, "target": low, "after": prompt.tokens, "changed": changed,
            "trigger": f"{before} + {reserve} > {compaction.high:g} x {budget}" if base.t or snap.t else "start",
            "tokens": prompt.tokens, "recent": recent_info}
    plan.info["compaction"] = info
    return plan, prompt, boundary_of(plan, prompt.messages, prompt.segments, budget, info), True


def _lined(b: Boundary, snap: "SessionSnapshot", kept: int) -> np.ndarray:
    """(M,) bool: the hidden steps of the kept region that boundary ``b`` drew inside a range line (its range
    segments name each run's first step by id), so that the next compile draws those lines again, whatever hid
    them."""
    out = np.zeros(snap.t, dtype=bool)
    firsts = {s.step_id for s in b.segments if s.kind == "range"}
    for i, j in compiler._hidden_runs(b.resolution[:kept].astype(np.int64)):
        if int(snap.step_ids[i]) in firsts:
            out[i: j + 1] = True
    return out


def _kept_prefix(b: Boundary, snap: "SessionSnapshot", overhead: int, limit: int) -> int:
    """How many of the oldest steps a compaction keeps as boundary ``b`` rendered them: the longest run from
    step 0 whose estimated cost (one line per hidden run) is within ``limit``, not ending inside a hidden
    run (its line would change), and only where each level's text still exists."""
    n = min(b.t, snap.t)
    if n <= 0 or limit <= 0:
        return 0
    lv = b.resolution[:n].astype(np.int64)
    costs = compiler.step_costs(snap.upto(n), overhead)  # one owner of per-step costs
    cost = costs[np.arange(n), lv]
    missing = np.flatnonzero(cost < 0)
    if missing.size:
        n = int(missing[0])
        lv, cost = lv[:n], cost[:n]
    hidden = lv == _DROP
    starts = hidden & ~np.concatenate([[False], hidden[:-1]]) if n else hidden
    cum = np.cumsum(np.where(hidden, 0, cost) + starts * (overhead + RANGE_LINE_TOKENS))
    j = int(np.searchsorted(cum, limit, side="right"))
    while j > 0 and j < n and hidden[j - 1] and hidden[j]:
        j -= 1  # back to the start of that run: a longer run would rewrite its line
    if 0 < j < n and hidden[j - 1]:
        while j > 0 and hidden[j - 1]:
            j -= 1
    return j
