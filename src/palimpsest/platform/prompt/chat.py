"""The actor-facing prompt: the one module that turns a compiled plan into chat messages and token ids.

Serving sends what this module builds, replay measures it, ``palimpsest render`` prints it and the
REMORY data builder trains on it; no other code lays out a prompt.

Layout (the history in the model's own roles):

    system     the session's system prompt, its tool declarations, and the ``glimpse`` tool
    user       the task
    user       the rolling summary, when the plan has one
    per step   assistant (thought and action), then its result: a tool message, or a user message where
               the principal spoke; a degraded step keeps both roles and its place, its content becomes
               the detailed, brief or placeholder rendering (``palimpsest.platform.prompt.render.step_messages``)
    user       one line in place of each hidden run of steps (their ids, to glimpse)
    assistant  the generation prompt that the next action follows

The soft-memory slot is where REMORY puts it: after the summary part of the context (the prefix, the
rolling summary and every step before the recent raw turns), before the trailing run of steps shown at
full resolution (``soft_slot``). The ids are ``context + [soft] + bridge``, split there: ``bridge`` is the
recent raw turns and the assistant prompt, and the budget counts exactly these ids (see
``palimpsest.platform.compile.compiler``). Glimpses answered within a turn are appended as an assistant
``glimpse(#ID)`` call and a tool message with the step's text (after the slot).

What the memory reads (``memory_input``) is defined by the same compiled prompt: the raw text of the
steps the plan rendered below full resolution or hid, oldest first, and the context before the slot.
Serving, ``eval-actions`` and the REMORY data builder all call it.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import numpy as np

from palimpsest.platform.prompt.names import summary_body
from palimpsest.platform.prompt.render import (
    head_tail,
    observation_role,
    range_message,
    range_names,
    render_placeholder_body,
    step_messages,
)
from palimpsest.platform.prompt.tokens import ChatTokenizer
from palimpsest.platform.types import Fold, Resolution, Session, Step, StepRecord

if TYPE_CHECKING:
    from palimpsest.platform.ledger.snapshot import SessionSnapshot
    from palimpsest.platform.types import CompiledTurn

GLIMPSE_TOOL = ("## Memory tool\nOlder steps may be shown summarised or as one-line placeholders `[#ID ...]`. "
                "To read the full text of step #ID before acting, reply with exactly `glimpse(#ID)` and nothing else.")
_GLIMPSE_CALL = re.compile(r"^\s*glimpse\(\s*#?(\d{1,18})\s*\)\s*$")
DEFAULT_SYSTEM = "You are a helpful agent."


def glimpse_call(text: str) -> int | None:
    """The step id of a reply that is a glimpse call, else None."""
    m = _GLIMPSE_CALL.match(text or "")
    return int(m.group(1)) if m else None


def message(role: str, content: str) -> dict:
    return {"role": role, "content": content}


def declared_tools(tools: str | None) -> list[dict] | None:
    """A session's tool declarations when they are OpenAI function tools (a JSON list), else None (free text)."""
    if not tools:
        return None
    try:
        doc = json.loads(tools)
    except ValueError:
        return None
    if isinstance(doc, list) and doc and all(isinstance(t, dict) and isinstance(t.get("function"), dict) for t in doc):
        return doc
    return None


def prefix_messages(session: Session) -> list[dict]:
    """The stable prefix: byte-identical on every turn of a session, so a prefix cache survives re-rendering.

    Declared function tools ride on the system message (``tools``): the chat template renders them in its
    own format, or the tokenizer writes them into the system text (``palimpsest.platform.prompt.tokens.for_template``).
    Tools given as free text are part of the system text."""
    system = [session.system.strip() or DEFAULT_SYSTEM]
    tools = declared_tools(session.tools)
    if session.tools and tools is None:
        system.append("## Tools\n" + session.tools.strip())
    system.append(GLIMPSE_TOOL)
    first = message("system", "\n\n".join(system))
    if tools:
        first["tools"] = tools
    return [first, message("user", session.task.strip() or "(no task)")]


def fold_message(fold: Fold) -> dict:
    return message("user", f"## Summary of steps 0..{fold.upto - 1}\n{fold.text.strip()}")


def glimpse_messages(step_id: int, text: str) -> list[dict]:
    """A glimpse answered inside a turn: the model's call, then the step's text as the tool's answer."""
    return [message("assistant", f"glimpse(#{step_id})"), message("tool", f"## Step #{step_id}\n{text.strip()}")]


def with_glimpse(tokenizer: "ChatTokenizer", messages: Sequence[dict], step_id: int, text: str,
                 room: int, split: int | None = None) -> tuple[list[dict], "ChatIds"] | None:
    """``messages`` with a glimpse of step ``step_id`` appended, its text cut (head and tail, marked) so that
    the ids stay within ``room``; None when not even a notice fits (the turn then ends with what it has).
    ``split`` keeps the soft-memory slot where the compiled prompt has it."""
    cap = len(text)
    for _ in range(12):
        shown = text if cap >= len(text) else head_tail(
            text, cap * 2 // 3, cap - cap * 2 // 3,
            f"\n[... {len(text) - cap} characters of step #{step_id} elided for the budget ...]\n")
        msgs = list(messages) + glimpse_messages(step_id, shown)
        ids = chat_ids(tokenizer, msgs, split)
        if len(ids) <= room:
            return msgs, ids
        if cap == 0:
            break
        # Shrink in proportion: the text's own tokens against what the room leaves for them.
        own = max(len(tokenizer.encode(shown)), 1)
        fits = own - (len(ids) - room)
        cap = 0 if fits <= 8 else min(int(cap * fits / own * 0.95), cap - 1)
    msgs = list(messages) + glimpse_messages(step_id, "(too long for the budget)")
    ids = chat_ids(tokenizer, msgs, split)
    return (msgs, ids) if len(ids) <= room else None


@dataclass(frozen=True)
class ChatIds:
    """The actor's input: ``context`` (the chat up to the soft-memory slot) and ``bridge`` (the messages after
    the slot and the assistant prompt the next action follows). Without soft memory the actor receives
    ``context + bridge``."""
    context: tuple[int, ...]
    bridge: tuple[int, ...]
    text: str | None = None  # the template's text the ids were encoded from
    split: int | None = None  # the message index the soft slot fell before (None: no split point at all)

    @property
    def all(self) -> list[int]:
        return list(self.context) + list(self.bridge)

    def __len__(self) -> int:
        return len(self.context) + len(self.bridge)


def chat_ids(tokenizer: ChatTokenizer, messages: Sequence[dict], split: int | None = None) -> ChatIds:
    """The exact ids of ``messages`` under the model's chat template, split at the soft-memory slot: before
    message ``split`` (default: after the last message, before the assistant prompt). A template whose text
    for the first ``split`` messages is not a prefix of the whole chat's splits after the last message; one
    that rewrites even that does not split at all."""
    full = tokenizer.template(messages, True)
    for k in ([split] if split is not None and 0 < split < len(messages) else []) + [len(messages)]:
        context = tokenizer.template(messages[:k], False)
        if not full.startswith(context):
            continue
        ids = ChatIds(tuple(tokenizer.encode(context)), tuple(tokenizer.encode(full[len(context):])), full, k)
        # A slot inside the history must not change a single id of what a text-only arm receives: where the
        # two halves encode otherwise than the whole, the slot moves to the end.
        if k == len(messages) or ids.all == tokenizer.encode(full):
            return ids
    return ChatIds(tuple(tokenizer.encode(full)), (), full, None)


def soft_slot(level: Sequence[int], spans: Sequence[tuple[int, int, int]], base: int, n_messages: int) -> int:
    """The message index of the soft-memory slot of a compiled history: the first message of the trailing
    run of steps shown at full resolution (the recent raw turns), ``n_messages`` (the end) when the last
    step shown is not raw. ``spans`` are ``history_messages``' (index, first message, n), ``base`` the
    number of prefix messages before them."""
    full = int(Resolution.FULL)
    at = n_messages
    newer = None
    for i, first, _n in reversed(spans):
        # a degraded step or a range line ends the raw tail, and so does a gap: steps hidden without a line
        if int(level[i]) != full or (newer is not None and i != newer - 1):
            break
        at, newer = base + first, i
    return at


def prefix_tokens(tokenizer: ChatTokenizer, session: Session) -> int:
    """The exact size of the stable prefix, with the assistant prompt: what every turn costs at least."""
    return prefix_size(tokenizer, prefix_messages(session))


def prefix_size(tokenizer: ChatTokenizer, prefix: list[dict]) -> int:
    """``len(chat_ids(tokenizer, prefix))``, remembered: a session's prefix is the same on every turn."""
    key = (getattr(tokenizer, "key", tokenizer.name), prefix[0]["content"], prefix[1]["content"],
           json.dumps(prefix[0].get("tools"), sort_keys=True))
    n = _PREFIX.get(key)
    if n is None:
        n = len(chat_ids(tokenizer, prefix))
        if len(_PREFIX) >= 4096:
            _PREFIX.pop(next(iter(_PREFIX)))
        _PREFIX[key] = n
    return n


_PREFIX: dict[tuple[str, str, str, str], int] = {}


def tool_tokens(tokenizer: ChatTokenizer, session: Session) -> int:
    """Tokens the tool declarations (the session's and the glimpse tool) add to the prefix: the exact prefix
    minus the exact prefix without them."""
    bare = [message("system", session.system.strip() or DEFAULT_SYSTEM),  # neither tools nor the glimpse tool
            message("user", session.task.strip() or "(no task)")]
    return prefix_tokens(tokenizer, session) - len(chat_ids(tokenizer, bare))


def message_overhead(tokenizer: ChatTokenizer) -> int:
    """Tokens the template adds around one message's content (ChatML: ``<|im_start|>role\n`` ... ``<|im_end|>\n``),
    measured once per tokenizer: the planning estimate of a step adds it per message."""
    key = getattr(tokenizer, "key", tokenizer.name)
    cached = _OVERHEAD.get(key)
    if cached is None:
        one = [message("system", "s"), message("user", "u")]
        two = one + [message("assistant", "a")]
        cached = max(len(tokenizer.encode(tokenizer.template(two, False)))
                     - len(tokenizer.encode(tokenizer.template(one, False))) - len(tokenizer.encode("a")), 0)
        _OVERHEAD[key] = cached
    return cached


_OVERHEAD: dict[str, int] = {}


def history_messages(snap: "SessionSnapshot", level, fold: Fold | None, ranges: "bool | np.ndarray",
                     elide: dict[int, int] | None = None, masked=None) -> tuple[list[dict], list[tuple[int, int, int]]]:
    """The messages of a plan's history (after the prefix) and, per step shown, (index, first message, n).

    ``level[i]`` is step i's resolution (DROP: not shown); with ``ranges`` True every run of dropped steps is one
    line in place, with an (M,) bool mask only the runs holding a masked step. ``elide`` maps a step index to the
    character cap of its fields (oversized steps); ``masked`` (M,) how each step shown at full is masked
    (``render.RESULT_MASKED``, ``INPUT_MASKED``), or None."""
    msgs: list[dict] = []
    spans: list[tuple[int, int, int]] = []
    if fold is not None:
        msgs.append(fold_message(fold))
    level = np.asarray(level)
    drop = int(Resolution.DROP)
    # Only the shown steps and the starts of hidden runs are visited: O(shown + runs), not O(M).
    shown = np.flatnonzero(level < drop)
    hidden = np.concatenate([[False], level == drop, [False]]).astype(np.int8)
    edges = np.flatnonzero(np.diff(hidden))
    runs = {int(a): int(b) - 1 for a, b in zip(edges[::2], edges[1::2])} if ranges is not False else {}
    if isinstance(ranges, np.ndarray):  # only the runs holding a step the mask names get a line
        runs = {a: b for a, b in runs.items() if ranges[a: b + 1].any()}
    names = range_names(snap.steps, runs) if runs else {}
    order = sorted(set(shown.tolist()) | set(runs)) if runs else shown.tolist()
    levels = level[order].tolist() if len(order) else []
    for i, lv in zip(order, levels):
        if lv == drop:
            j = runs[i]
            spans.append((i, len(msgs), 1))
            msgs.append(range_message(snap.steps[i], snap.steps[j], j - i + 1, *names[i]))
            continue
        res = Resolution(lv)
        step = snap.steps[i]
        parts = step_messages(step, step.id, res, summary_body(snap, i, res) if res is not Resolution.FULL else None,
                              elide=(elide or {}).get(i), mask=0 if masked is None else int(masked[i]))
        spans.append((i, len(msgs), len(parts)))
        msgs.extend(parts)
    return msgs, spans


def messages_at(session: Session, steps: Sequence[Step | StepRecord], resolutions: Sequence[Resolution],
                bodies: Sequence[str | None] | None = None, max_field_chars: int | None = None,
                compact: bool = False) -> list[dict]:
    """The prefix and ``steps`` each at its resolution (``bodies``: the summary texts), without a ledger:
    how training samples are laid out exactly as served turns are. A step's id is its ledger id where it
    has one, else its index t. ``compact``: fields cut with a bare ``COMPACT_ELISION`` (``step_messages``)."""
    msgs = prefix_messages(session)
    for k, (s, res) in enumerate(zip(steps, resolutions)):
        step_id = getattr(s, "id", s.t)
        body = None if bodies is None else bodies[k]
        if res is Resolution.PLACEHOLDER and body is None:
            body = render_placeholder_body(s, step_id)
        msgs.extend(step_messages(s, step_id, res, body, elide=max_field_chars, compact=compact))
    return msgs


def raw_history_messages(session: Session, steps: Sequence[Step | StepRecord],
                         max_field_chars: int | None = None, compact: bool = False) -> list[dict]:
    """The raw steps at full resolution after the prefix: what the memory network reads and what the
    teacher sees. ``max_field_chars`` keeps each field's head and tail (the actor's window is finite);
    ``compact`` joins them with a bare ``COMPACT_ELISION`` (the memory's read)."""
    return messages_at(session, steps, [Resolution.FULL] * len(steps), None, max_field_chars, compact)


#: The smallest share of a field's characters the memory's read cuts to before it gives up covering every
#: left-out step (below it, a field is little more than its elision marker) and keeps the newest instead.
MIN_SHARE_CHARS = 48

#: Characters of raw step text per id, a generous bound: text of more characters than this times a number
#: of ids surely exceeds them, so the read never tokenizes more than that to find its share.
_CHARS_PER_TOKEN = 8

#: What the memory reads, by version; recorded with the training data and the bundle (``data.memory_read``),
#: and served models trained on another are warned about. 1: the newest left-out steps whole, the front cut
#: (never recorded); 2: every left-out step at an equal share of characters, the prefix at most half.
MEMORY_READ_VERSION = 2


def _water_level(lengths: Sequence[int], cap: int, total: int) -> int:
    """The largest share c <= cap with sum(min(length, c)) <= total (0 when even c = 1 exceeds it)."""
    lo, hi = 0, cap
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if sum(min(n, mid) for n in lengths) <= total:
            lo = mid
        else:
            hi = mid - 1
    return lo


def left_out(resolution: Sequence[int]) -> list[int]:
    """Indices of the steps a plan rendered below full resolution or hid: what the text left out."""
    full = int(Resolution.FULL)
    return [i for i, lv in enumerate(np.asarray(resolution).tolist()) if lv != full]


def memory_input(tokenizer: ChatTokenizer, session: Session, steps: Sequence[Step | StepRecord],
                 resolution: Sequence[int], context_ids: Sequence[int], max_field_chars: int,
                 max_history_tokens: int) -> tuple[list[int], list[int]] | None:
    """What the memory network reads for one compiled prompt: (history, summary) ids, or None when the plan
    left nothing out (the text already shows every step raw). Read version ``MEMORY_READ_VERSION``.

    ``history`` is the raw chat (the session's prefix, then each step at full resolution, every field cut
    to ``max_field_chars``) of **every** step the plan rendered below full resolution or hid, oldest first.
    Fields are cut to their head and tail joined by a bare ``COMPACT_ELISION`` (no marker naming the step:
    the actor never reads this text). When it exceeds ``max_history_tokens``, every field is cut to one
    equal share of characters, the largest (to 8 characters) whose chat fits, so short fields stay whole
    and each left-out step keeps its head and tail; the steps get at least half the ids, a longer prefix
    (tool declarations) losing its head. Only when a share would fall under ``MIN_SHARE_CHARS`` (hundreds of
    left-out steps) are the newest steps kept whole and the front cut. ``summary`` is the context before the
    soft slot (the summary part of the prompt the actor sees), its last ``max_history_tokens``. Serving,
    ``eval-actions`` and the REMORY data builder all call this."""
    idx = left_out(resolution[: len(steps)])
    if not idx:
        return None
    chosen = [steps[i] for i in idx]
    prefix = prefix_size(tokenizer, prefix_messages(session))  # remembered per session: the same every turn
    room = max_history_tokens - min(prefix, max_history_tokens // 2)  # the steps' ids
    fits = prefix + room  # the prefix's head beyond max_history_tokens is cut below

    def read(share: int, which: Sequence[Step | StepRecord] = chosen) -> list[int]:
        return chat_ids(tokenizer, raw_history_messages(session, which, share, compact=True)).all

    lengths = [len(x) for s in chosen for x in (s.thought, s.action, s.observation) if x]
    cap = min(max_field_chars, max(lengths, default=1))
    lo = min(MIN_SHARE_CHARS, cap)
    hi = _water_level(lengths, cap, room * _CHARS_PER_TOKEN)  # no larger share can fit
    history = read(hi) if hi >= lo else None
    if history is not None and len(history) > fits:
        history = read(lo)
        if len(history) > fits:
            history = None
        while history is not None and hi - lo > 8:  # bisect: the largest share that fits, to 8 characters
            mid = (lo + hi) // 2
            ids = read(mid)
            if len(ids) <= fits:
                lo, history = mid, ids
            else:
                hi = mid
    if history is None:  # not even MIN_SHARE_CHARS a field: the newest steps whole, the front cut
        newest: list[Step | StepRecord] = []
        chars = 0
        for s in reversed(chosen):
            chars += sum(min(len(x or ""), max_field_chars) for x in (s.thought, s.action, s.observation)) + 16
            newest.append(s)
            if chars >= room * _CHARS_PER_TOKEN:
                break
        history = read(max_field_chars, newest[::-1])
    return history[-max_history_tokens:], list(context_ids)[-max_history_tokens:]


def memory_read(tokenizer: ChatTokenizer, turn: "CompiledTurn", max_field_chars: int,
                max_history_tokens: int) -> tuple[list[int], list[int]] | None:
    """``memory_input`` of a compiled turn (over the snapshot it was compiled from): the one call serving,
    ``eval-actions`` and the REMORY data builder make."""
    snap = turn.snapshot
    if snap is None:
        raise ValueError("the turn carries no snapshot: compile it with Runtime.compile or Runtime.turn")
    return memory_input(tokenizer, snap.session, snap.steps, turn.plan.resolution, turn.prompt.context_ids,
                        max_field_chars, max_history_tokens)


__all__ = ["ChatIds", "DEFAULT_SYSTEM", "GLIMPSE_TOOL", "chat_ids", "fold_message", "glimpse_call", "glimpse_messages",
           "head_tail", "history_messages", "left_out", "memory_input", "memory_read", "message", "message_overhead",
           "messages_at", "observation_role", "prefix_messages", "prefix_tokens", "range_message",
           "raw_history_messages", "soft_slot", "with_glimpse"]
