"""Plan -> prompt. The only place that enforces the budget, in the actor's own tokens.

The layout belongs to :mod:`palimpsest.platform.prompt.chat` (stable prefix, then the history in its own
roles, then the assistant prompt); this module decides how much of it fits.

Budget (:class:`palimpsest.platform.compile.budget.Budget`): the prompt's exact ids (chat template, tool
declarations, every message) plus its reserve (the reply's ``max_tokens`` and the soft-memory positions)
must be at most its total. Planning uses the
per-step counts stored in the ledger plus a per-message overhead (an estimate, O(M) numpy): while the
estimate overflows, the lowest-scored unpinned steps are degraded one level at a time (full -> detailed
-> brief -> placeholder -> drop), lowest score first, every step older than the policy's recent window
before any step inside it. History older than that window first folds into range lines once it costs more
than its share of the room (:mod:`palimpsest.platform.compile.folding`), so a session of any length keeps room for
its recent steps. Then the chat is assembled and its ids counted;
while they overflow, degradation continues from the measured excess. The pinned latest step is never
degraded: when it alone does not fit, its fields are shown head and tail with a marker naming the step
(``glimpse`` shows the rest), and the plan's ``info["elided"]`` says so. Only a budget below the prefix
plus a minimal rendering of the latest step is an error.
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING

import numpy as np

from palimpsest.platform.compile.budget import Budget
from palimpsest.platform.compile.folding import RANGE_LINE_TOKENS, fold_old_history, protected_order
from palimpsest.platform.prompt.chat import (
    ChatIds,
    chat_ids,
    history_messages,
    message_overhead,
    prefix_messages,
    prefix_size,
    soft_slot,
)
from palimpsest.platform.prompt.masking import masked_costs, masked_of, shown_levels
from palimpsest.platform.prompt.tokens import ChatTokenizer
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
#: The smallest share of each field of an oversized step that is still shown (characters, head + tail).
MIN_ELIDE_CHARS = 120
#: The share of the room (budget - reserve - prefix) an oversized pinned step is cut to, so the rest of the
#: history still has the other half.
ELIDE_SHARE = 0.5
_MAX_ROUNDS = 64


def messages_per_step(snap: "SessionSnapshot") -> np.ndarray:
    """(M,) how many messages a step renders as: its turn and its result, or one of them (built once per
    snapshot; ``SessionSnapshot.upto`` slices it)."""
    cached = snap._memo.get("messages_per_step")
    if cached is None or cached.shape[0] != snap.t:
        cached = step_message_counts(snap.steps)
        snap._memo["messages_per_step"] = cached
    return cached


def step_message_counts(steps) -> np.ndarray:
    """(n,) messages each step renders as: its turn and its result, or one of them."""
    return np.fromiter(((1 + ((bool(s.action or s.thought)) and s.observation is not None)) for s in steps),
                       dtype=np.int64, count=len(steps))


def step_costs(snap: "SessionSnapshot", overhead: int) -> np.ndarray:
    """(M, 5) estimated tokens per resolution, template overhead included; DROP costs 0; a representation
    not written yet is -1."""
    costs = np.zeros((snap.t, 5), dtype=np.int64)
    costs[:, :4] = snap.tokens
    extra = messages_per_step(snap) * overhead
    costs[:, :4] = np.where(costs[:, :4] >= 0, costs[:, :4] + extra[:, None], -1)
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


#: the score at or above which a plan's step is one of the policy's recent steps (``scored_plan_start``)
PROTECTED = 1e9


def _degrade(costs: np.ndarray, level: np.ndarray, pinned: np.ndarray, score: np.ndarray,
             excess: int, last: np.ndarray | None = None) -> tuple[np.ndarray, int] | None:
    """One vectorised pass: degrade the lowest-scored unpinned steps one level each, in score order,
    until ``excess`` tokens are saved (or every candidate was degraded once). ``last`` steps (a policy's
    recent steps, which its plan scores ``PROTECTED`` or above: PACE's last N, ACE's latest) are candidates
    only once no other step can be degraded: a pass that needs more than one level of every other step never
    takes a level of theirs. A boundary's frozen region (``pinned`` here until released) is not a candidate: its
    steps keep their levels while the recent ones give theirs (measured: releasing it first cost pace 0.07 far
    recall at 16K on dev, BENCHMARKS.md).
    Mutates ``level``; returns the (t, before, after) rows and the tokens saved, or None when nothing can be
    degraded."""
    cand = np.flatnonzero(~pinned & (level < _DROP))
    if cand.size == 0:
        return None
    if last is not None:
        others = cand[~last[cand]]
        if others.size:
            cand = others
    order = cand[np.lexsort((cand, score[cand]))]  # lowest score first, older first on ties
    nxt = _next_cheaper(costs, order, level[order])
    cum = np.cumsum(costs[order, level[order]] - costs[order, nxt])
    k = min(int(np.searchsorted(cum, excess)) + 1, order.size)  # the shortest prefix that saves enough
    chosen, before, after = order[:k], level[order[:k]].copy(), nxt[:k]
    level[chosen] = after
    return np.stack([chosen, before, after], axis=1).astype(np.int64), int(cum[k - 1])


def _lined_runs(level: np.ndarray, mask: "bool | np.ndarray") -> list[tuple[int, int]]:
    """The runs of dropped steps that get a line: all of them (``mask`` True), or those holding a masked step."""
    runs = _hidden_runs(level)
    return runs if mask is True else [(a, b) for a, b in runs if mask[a: b + 1].any()]


def _hidden_runs(level: np.ndarray) -> list[tuple[int, int]]:
    """Maximal runs [a, b] of dropped steps."""
    hidden = np.concatenate([[False], level == _DROP, [False]]).astype(np.int8)
    edges = np.flatnonzero(np.diff(hidden))
    return [(int(a), int(b) - 1) for a, b in zip(edges[::2], edges[1::2])]


def _longest_field(snap: "SessionSnapshot", i: int) -> int:
    s = snap.steps[i]
    return max(len(s.thought or ""), len(s.action or ""), len(s.observation or ""))


def _cap_for(lengths: list[int], target: int) -> int:
    """The per-field character cap c with sum(min(len, c)) about ``target`` (the long fields share the cut)."""
    lengths = sorted(lengths)
    left, n = target, len(lengths)
    for k, length in enumerate(lengths):
        if length * (n - k) >= left:
            return max(left // max(n - k, 1), MIN_ELIDE_CHARS)
        left -= length
    return max(lengths[-1] if lengths else MIN_ELIDE_CHARS, MIN_ELIDE_CHARS)


def _initial_caps(snap: "SessionSnapshot", costs: np.ndarray, pinned_idx: np.ndarray, room: int) -> dict[int, int]:
    """Character caps that bring the pinned steps, when they do not fit ``room`` as they are, down to
    ``ELIDE_SHARE`` of it (each in proportion to its size): the rest of the history keeps the other part."""
    full = costs[pinned_idx, Resolution.FULL]
    if int(full.sum()) <= room:
        return {}
    caps = {}
    for i, cost in zip(pinned_idx.tolist(), full.tolist()):
        share = max(room, 0) * ELIDE_SHARE * cost / max(int(full.sum()), 1)
        fields = [len(x or "") for x in (snap.steps[i].thought, snap.steps[i].action, snap.steps[i].observation)]
        per_token = sum(fields) / max(cost, 1)
        caps[i] = _cap_for([f for f in fields if f], int(share * per_token * 0.9))
    return caps


def compile_plan(snap: "SessionSnapshot", plan: RenderPlan, limit: Budget, tokenizer: ChatTokenizer,
                 slot: str = "recent") -> Prompt:
    """Render ``plan`` so that its exact ids plus the reserve fit ``limit``; mutates ``plan`` (final
    resolutions, degradations, and ``info["elided"]`` for oversized steps shown head and tail). ``slot``:
    the soft-memory slot before the trailing run of raw steps (``recent``, per-turn planning) or after the
    whole history (``end``, a compaction boundary: the steps appended since follow it)."""
    if not isinstance(limit, Budget):
        raise TypeError(f"limit must be a Budget, got {type(limit).__name__}")
    budget, reserve = limit.total, limit.reserve
    if len(plan) != snap.t:
        raise ValueError(f"plan covers {len(plan)} steps but the snapshot has {snap.t}")
    if slot not in ("recent", "end"):
        raise ValueError(f"slot must be 'recent' or 'end', got {slot!r}")
    slot_at_end = slot == "end"
    room = limit.prompt
    prefix = prefix_messages(snap.session)
    prefix_tokens = prefix_size(tokenizer, prefix)
    if prefix_tokens > room:
        raise BudgetError(f"budget {budget} cannot hold the fixed prefix ({prefix_tokens} tokens) of session "
                          f"{snap.session.id!r}" + (f" plus the reserve of {reserve}" if reserve else ""))
    overhead = message_overhead(tokenizer)
    costs = step_costs(snap, overhead)
    whole = prefix_tokens + int(np.maximum(costs[:, Resolution.FULL], 0).sum())  # the whole history, raw
    masked = plan.masked = masked_of(plan)  # steps shown full with their result as a line (platform.prompt.masking)
    if masked is not None:
        costs[:, Resolution.FULL] = masked_costs(snap, masked, overhead, costs[:, Resolution.FULL])
    level = _available_at_or_below(costs, plan.resolution.astype(np.int64))
    chose_drop = level == Resolution.DROP  # the policy's own drops (ACE's seed renders them as nothing)
    lines_for_drops = True  # off only where the budget cannot hold even the lines (then the ids go unnamed)
    rows = np.arange(snap.t)
    # A summary never costs more than the raw step it stands for: show the raw one instead.
    summary = (level == Resolution.DETAILED) | (level == Resolution.BRIEF)
    level[summary & (costs[rows, level] >= costs[:, Resolution.FULL])] = Resolution.FULL

    pinned = plan.pinned
    pinned_idx = np.flatnonzero(pinned)
    level[pinned] = Resolution.FULL
    frozen = plan.frozen if plan.frozen is not None and np.any(plan.frozen) else None
    keep = pinned | frozen if frozen is not None else pinned  # never degraded (frozen: unless nothing else can)
    caps = _initial_caps(snap, costs, pinned_idx, room - prefix_tokens)
    for i in caps:  # the estimate of an elided step: its share of what is left
        costs[i, Resolution.FULL] = min(int(costs[i, Resolution.FULL]),
                                        int(max(room - prefix_tokens, 0) * ELIDE_SHARE) // max(len(caps), 1))

    fold = plan.fold
    fold_tokens = (fold.tokens + overhead) if fold is not None else 0
    degraded: list[np.ndarray] = []
    # Old history at a bounded cost (platform.compile.folding): the recent window is degraded last, and history older
    # than it folds into range lines once it costs more than its share of the room.
    bound = plan.history
    order = protected_order(plan.score, bound.recent_window if bound is not None else 0)
    last = np.asarray(plan.score) >= PROTECTED  # the policy's recent steps: degraded only once nothing else can be
    line_cost = overhead + RANGE_LINE_TOKENS
    ranges = plan.fold_ranges
    folded = fold_old_history(costs, level, order, keep, bound, room - prefix_tokens - fold_tokens, line_cost,
                              ranges)
    if folded is not None:  # each folded step's reason says so (one audit row per step, not per level)
        changed = np.concatenate(folded[0])[:, 0] if folded[0] else np.zeros(0, dtype=np.int64)
        if changed.size:
            code = len(plan.reasons)
            plan.reasons.append(f"old history over {bound.old_share:g} of the room: folded")
            plan.reason_code[changed] = code
        plan.info["folded"] = folded[1]
        ranges = plan.fold_ranges = True
    folded_lines = bool(ranges)  # the policy's or the fold's lines (every run): kept whatever the budget
    lined = plan.lined if plan.lined is not None and np.any(plan.lined) else None

    def lines() -> "bool | np.ndarray":
        """Which hidden runs get a line: every run (the policy's or the fold's lines); else the runs holding a
        step the compiler hid (a policy's own drops stay as its seed renders them) or one the previous boundary
        drew inside a line (``plan.lined``: its kept region renders byte for byte); False for none."""
        if folded_lines:
            return True
        if not lines_for_drops:
            return False
        hidden = level == Resolution.DROP
        m = hidden & ~chose_drop
        if lined is not None:
            m |= lined & hidden
        return m if m.any() else False

    def lines_cost(mask) -> int:
        return 0 if mask is False else len(_lined_runs(level, mask)) * line_cost

    total = prefix_tokens + fold_tokens + int(costs[rows, level].sum())
    while True:  # the estimate: cheap, O(M) per pass
        ranges = lines()
        runs_cost = lines_cost(ranges)
        if total + runs_cost <= room:
            break
        step = _degrade(costs, level, keep, order, total + runs_cost - room, last)
        if step is None and keep is not pinned:
            keep = _release(plan, pinned)
            continue
        if step is None:
            break
        degraded.append(step[0])
        total -= step[1]

    # The exact count: assemble, count the ids, degrade further from the measured excess.
    for _ in range(_MAX_ROUNDS):
        ranges = lines()
        msgs, spans = history_messages(snap, level, fold, ranges, caps, masked)
        at = (len(prefix) + len(msgs) if slot_at_end
              else soft_slot(shown_levels(level, masked), spans, len(prefix), len(prefix) + len(msgs)))
        ids = chat_ids(tokenizer, prefix + msgs, at)
        over = len(ids) - room
        if over <= 0:
            break
        step = _degrade(costs, level, keep, order, over, last)
        if step is not None:
            degraded.append(step[0])
            continue
        if ranges is not False and not folded_lines:  # the compiler's lines go before the kept region or the fold
            lines_for_drops = False
            plan.info["range_lines_dropped"] = True
            continue
        if keep is not pinned:
            keep = _release(plan, pinned)
            continue
        if fold is not None:
            fold = None
            plan.info["fold_dropped"] = True
            continue
        if not _tighten(snap, caps, pinned_idx, ids, tokenizer, over):
            raise BudgetError(
                f"budget {budget} cannot hold the prefix ({prefix_tokens} tokens) plus a minimal rendering of the "
                f"latest step of session {snap.session.id!r} ({len(ids) - prefix_tokens} tokens)"
                + (f" and the reserve of {reserve}" if reserve else ""))
    else:  # pragma: no cover - each round degrades a step, drops the fold or tightens a cap
        raise BudgetError(f"could not fit session {snap.session.id!r} into {budget} tokens")

    # What the whole history would cost, from the stored per-step counts (an estimate: serving reports the
    # tokens a turn saved against it without encoding the whole history every turn).
    plan.info["full_tokens_estimate"] = whole
    plan.resolution = level.astype(np.int8)
    if isinstance(ranges, np.ndarray):  # the runs drawn with a line: a recompile of this plan draws them again
        plan.lined = np.zeros(len(level), dtype=bool)
        for a, b in _lined_runs(level, ranges):
            plan.lined[a: b + 1] = True
    plan.degraded = np.concatenate(degraded) if degraded else np.zeros((0, 3), dtype=np.int64)
    if caps:
        plan.info["elided"] = [{"t": snap.steps[i].t, "step_id": snap.steps[i].id, "max_field_chars": c,
                                "chars": sum(len(x or "") for x in (snap.steps[i].thought, snap.steps[i].action,
                                                                    snap.steps[i].observation))}
                               for i, c in sorted(caps.items())]
    messages = prefix + msgs
    segments = prefix_segments(prefix)
    base = len(prefix)
    if fold is not None:
        segments.append(Segment("fold", "user", msgs[0]["content"], fold_tokens, messages=(base, base + 1)))
    for i, first, n in spans:
        step = snap.steps[i]
        lv = int(level[i])
        text = "\n".join(m["content"] for m in msgs[first: first + n])
        kind = "range" if lv == _DROP else "step"
        segments.append(Segment(kind, msgs[first]["role"], text, int(costs[i, lv]), t=step.t, step_id=step.id,
                                resolution=Resolution(lv), messages=(base + first, base + first + n)))
    return assemble_prompt(tokenizer, prefix, messages, ids, segments, prefix_tokens, reserve)


def _release(plan: RenderPlan, pinned: np.ndarray) -> np.ndarray:
    """The kept region cannot stay as it was within the budget: it may be degraded like the rest."""
    plan.info.setdefault("kept", {})["released"] = True
    return pinned


def prefix_segments(prefix: list[dict]) -> list[Segment]:
    return [Segment("system", "system", prefix[0]["content"], 0, messages=(0, 1)),
            Segment("task", "user", prefix[1]["content"], 0, messages=(1, 2))]


def assemble_prompt(tokenizer: ChatTokenizer, prefix: list[dict], messages: list[dict], ids: ChatIds,
                    segments: list[Segment], prefix_tokens: int, reserve: int) -> Prompt:
    """The ``Prompt`` of counted ``messages`` (their ``ids``, split at the soft slot)."""
    # The text the actor receives: its ids decoded (piece by piece from the tokenizer's cache where it has one).
    fast = getattr(tokenizer, "decode_encoded", None)
    text = fast(ids.text) if fast is not None and ids.text is not None else tokenizer.decode(ids.all)
    prefix_text = tokenizer.template(prefix, False)
    return Prompt(
        segments=tuple(segments),
        tokens=len(ids),
        prefix_tokens=prefix_tokens,
        prefix_hash=hashlib.sha256(prefix_text.encode()).hexdigest(),
        prompt_hash=hashlib.sha256(text.encode()).hexdigest(),
        messages=tuple(messages),
        context_ids=ids.context,
        bridge_ids=ids.bridge,
        text=text,
        reserve=int(reserve),
        soft_at=ids.split if ids.split is not None else len(messages),
    )


def _tighten(snap: "SessionSnapshot", caps: dict[int, int], pinned_idx: np.ndarray, ids, tokenizer,
             over: int) -> bool:
    """Lower the character cap of the largest pinned step so that about ``over`` tokens go; False when every
    pinned step is already at its minimal rendering."""
    best, best_len = None, MIN_ELIDE_CHARS
    for i in pinned_idx.tolist():
        cap = caps.get(i, _longest_field(snap, i))
        if cap > best_len:
            best, best_len = i, cap
    if best is None:
        return False
    per_token = max(len(tokenizer.decode(list(ids.context[-256:]))) / 256, 1.0) if len(ids.context) >= 256 else 3.0
    cut = int((over + 8) * per_token * 1.2 / 2) + 16  # two long fields at most lose it, a margin for markers
    caps[best] = max(best_len - cut, MIN_ELIDE_CHARS)
    return True


