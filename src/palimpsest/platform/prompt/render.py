"""How one step looks at each resolution. The only place that knows the text layout of a step.

Every segment starts with a header naming the step id, so the actor can ``glimpse`` any step it
sees, and content of an untrusted authority (tool output, retrieved pages) is always inside a
delimited block that its own text cannot close.
"""

from __future__ import annotations

import re
from typing import Sequence

from palimpsest.platform.prompt import toolcalls
from palimpsest.platform.prompt.salient import RANGE_ID_CHARS, RANGE_IDS, capped, placeholder_ids, range_ids
from palimpsest.platform.types import Authority, Resolution, Step, StepRecord

_WS = re.compile(r"\s+")


def gist(text: str | None, max_chars: int = 80) -> str:
    """One line, at most ``max_chars`` characters, whitespace collapsed."""
    s = _WS.sub(" ", text or "").strip()
    return s if len(s) <= max_chars else s[: max_chars - 1].rstrip() + "…"


def _neutralise(text: str) -> str:
    # Untrusted text must not close (or open) its own block: a forged tag could otherwise promote
    # tool output into instruction position.
    return re.sub(r"<(/?)(untrusted|observation)", r"<\\\1\2", text, flags=re.I)


def authority_block(text: str, authority: str | Authority, inline: bool = False) -> str:
    auth = Authority(authority)
    tag = "observation" if auth.trusted or auth is Authority.USER else "untrusted"
    body = _neutralise(text)
    if inline:
        return f'<{tag} source="{auth.value}">{body}</{tag}>'
    return f'<{tag} source="{auth.value}">\n{body}\n</{tag}>'


def render_full_body(step: Step | StepRecord) -> str:
    """The whole raw step as one text (what ``glimpse`` returns)."""
    parts = []
    if step.thought:
        parts.append(f"thought: {step.thought}")
    if step.action:
        parts.append(f"action: {step.action}")
    if step.observation is not None:
        parts.append(authority_block(step.observation, step.authority))
    return "\n".join(parts)


#: How many characters of a step's text the key embedding reads: its head and its tail, so an output
#: whose verdict comes last (a test run, a traceback) is represented by both ends (docs/methods.md).
KEY_HEAD_CHARS = 400
KEY_TAIL_CHARS = 240


def head_tail(text: str, head: int, tail: int, sep: str = "\n…\n") -> str:
    """``text`` itself when it has at most head + tail characters, else its head and tail joined by ``sep``."""
    if len(text) <= head + tail:
        return text
    return text[:head] + sep + (text[-tail:] if tail else "")


def own_words(step: Step | StepRecord) -> str:
    """The step's own words (thought, action, observation), without the prompt's markup."""
    return "\n".join(x for x in (step.thought, step.action, step.observation) if x)


def key_text(step: Step | StepRecord) -> str:
    """R_full as an embedder reads it: the step's own words as a head-and-tail view that fits the embedder's
    window (MiniLM reads 256 word pieces)."""
    return head_tail(own_words(step), KEY_HEAD_CHARS, KEY_TAIL_CHARS)


def render_placeholder_body(step: Step | StepRecord, step_id: int) -> str:
    """One line of at most ~20 tokens: the step id (for ``glimpse``), kind, tool or command, and a gist."""
    tool = f" {step.tool}" if step.tool and step.tool != step.kind else ""
    what = gist(step.action or step.thought or "(no action)", 36)
    if tool and what.startswith(step.tool):
        what = what[len(step.tool):].lstrip() or what
    return f"[#{step_id} {step.kind}{tool}] {what}"


# -- a step as chat messages -------------------------------------------------------------------------

#: How a step shown at full may be masked (a plan's ``masked`` column): as it is; its result replaced by one line
#: naming the step (observation masking, a cleared tool result); its tool input cleared too (``clear_tool_inputs``).
UNMASKED, RESULT_MASKED, INPUT_MASKED = 0, 1, 2


def masked_note(step_id: int) -> str:
    """The line that stands for a masked result: it names the step, which ``glimpse`` shows whole."""
    return f"[#{step_id} result hidden: glimpse(#{step_id})]"


def input_note(step: Step | StepRecord, step_id: int) -> str:
    """The line that stands for a cleared tool input (a plain step's action): the tool and the step."""
    return f"[#{step_id} {step.tool or step.kind} input cleared: glimpse(#{step_id})]"


def observation_role(authority: Authority) -> str:
    """The chat role of a step's result: the principal's words are a user turn, everything else a tool turn
    (tool output, retrieved pages, system notices, the model's own earlier output)."""
    return "user" if authority is Authority.USER else "tool"


#: How a compact cut joins a field's head and tail (the memory's read: one or two ids, where the marker
#: naming the step and its glimpse costs about twenty).
COMPACT_ELISION = "\n…\n"


def _elide(text: str, limit: int | None, step_id: int, compact: bool = False) -> str:
    """Head and tail of ``text`` within ``limit`` characters, with a marker naming the step and what was cut
    (``compact``: a bare ``COMPACT_ELISION``)."""
    if limit is None or len(text) <= limit:
        return text
    head = max(limit * 2 // 3, 0)
    tail = max(limit - head, 0)
    cut = len(text) - head - tail
    mark = COMPACT_ELISION if compact else \
        f"\n[... {cut} characters of step #{step_id} elided; glimpse(#{step_id}) shows them ...]\n"
    return text[:head] + mark + (text[-tail:] if tail else "")


def _observation_text(step: Step | StepRecord, text: str) -> str:
    if step.authority is Authority.USER:
        return text
    return authority_block(text, step.authority)


def step_messages(step: Step | StepRecord, step_id: int, resolution: Resolution, body: str | None,
                  elide: int | None = None, compact: bool = False, mask: int = UNMASKED) -> list[dict]:
    """The chat messages of one history step at ``resolution``: the agent's turn (thought and action) as an
    assistant message, then its result as a tool message (or a user message where the principal spoke).

    A tool-calling step at FULL keeps its structure: the assistant message carries its ``tool_calls`` and
    each answer is its own message naming its ``tool_call_id``. Degrading a step changes the content,
    never the roles or the order: a summarised step keeps its assistant line (a placeholder naming the
    step id) and puts the summary where the result was; a placeholder keeps both messages as one line
    each. ``elide`` caps each field at that many characters (head and tail, with a marker naming the
    step): how an oversized latest step is still shown; ``compact`` joins head and tail with a bare
    ``COMPACT_ELISION`` instead (the memory's read). ``mask`` (at FULL only): the result is ``masked_note``, in its
    own role and place (each answer keeps its ``tool_call_id``), and with ``INPUT_MASKED`` the tool input too.
    """
    acted = bool(step.action or step.thought)
    has_obs = step.observation is not None
    out: list[dict] = []
    if resolution is Resolution.FULL:
        structure = toolcalls.decode(step)
        if structure is not None:
            return _structured(step, step_id, structure, elide, compact, mask)
        if acted or not has_obs:
            action = input_note(step, step_id) if mask == INPUT_MASKED and step.action else step.action
            said = "\n".join(_elide(x, elide, step_id, compact) for x in (step.thought, action) if x)
            out.append(_msg("assistant", said or "(no action)"))
        if has_obs:
            out.append(_msg(observation_role(step.authority), masked_note(step_id) if mask else
                            _observation_text(step, _elide(step.observation or "", elide, step_id, compact))))
        return out
    line = render_placeholder_body(step, step_id)
    if resolution is Resolution.PLACEHOLDER:
        if acted or not has_obs:
            out.append(_msg("assistant", line))
        if has_obs:
            kept = placeholder_ids(step.observation, line)  # the result's words: inside its authority block
            named = f"; it names {authority_block(', '.join(kept), step.authority, inline=True)}" if kept else ""
            note = f"[#{step_id} result hidden: glimpse(#{step_id}){named}]" if acted else line
            out.append(_msg(observation_role(step.authority), note))
        return out
    summary = f"[#{step_id} {resolution.label} summary; glimpse(#{step_id}) for the full step]\n{body or ''}"
    if not has_obs:
        return [_msg("assistant", summary)]
    if acted:
        out.append(_msg("assistant", line))
    out.append(_msg(observation_role(step.authority), _observation_text(step, summary)))
    return out


def _msg(role: str, content: str) -> dict:
    return {"role": role, "content": content}


def _structured(step: Step | StepRecord, step_id: int, sc: "toolcalls.StepCalls", elide: int | None,
                compact: bool = False, mask: int = UNMASKED) -> list[dict]:
    """A tool-calling step at FULL: the assistant's calls and each answer, as the agent sent them (``mask``: the
    answers' contents, and with ``INPUT_MASKED`` the calls' arguments, cleared; ids and names stay)."""
    said = "\n".join(_elide(x, elide, step_id, compact) for x in (step.thought, sc.content) if x)
    out: list[dict] = []
    if sc.tool_calls or said or not sc.results:
        m = _msg("assistant", said)
        if sc.tool_calls:
            m["tool_calls"] = [toolcalls.wire({**c, "arguments": "" if mask == INPUT_MASKED else
                                               _elide(c.get("arguments") or "", elide, step_id, compact)})
                               for c in sc.tool_calls]
        out.append(m)
    for r in sc.results:
        text = _elide(r.content, elide, step_id, compact)
        m = _msg(r.role, masked_note(step_id) if mask else
                 text if r.role == "user" else authority_block(text, step.authority))
        if r.tool_call_id is not None:
            m["tool_call_id"] = r.tool_call_id
        if r.name:
            m["name"] = r.name
        out.append(m)
    return out


def step_text(step: Step | StepRecord, step_id: int, resolution: Resolution, body: str | None) -> str:
    """The contents of a step's messages, joined: what the ledger counts (an estimate the compiler then
    corrects with the exact ids of the assembled chat)."""
    return "\n".join(m["content"] for m in step_messages(step, step_id, resolution, body))


def range_message(first: Step, last: Step, n: int, names: Sequence[str] = (),
                  authority: str | Authority = Authority.TOOL) -> dict:
    """The line that stands for hidden steps ``first..last``: their t and id range (``glimpse`` reaches each)
    and the identifiers they introduced that the session may reuse (``names``, ``salient.range_ids``),
    inside the block of the least trusted ``authority`` among the steps they came from."""
    kept = f"; they name {authority_block(', '.join(names), authority, inline=True)}" if names else ""
    if n == 1:
        return _msg("user", f"[t={first.t} hidden: glimpse(#{first.id}){kept}]")
    return _msg("user", f"[t={first.t}..{last.t} hidden ({n} steps, ids #{first.id}..#{last.id}): glimpse any"
                        f"{kept}]")


def range_names(steps: Sequence[Step | StepRecord],
                runs: dict[int, int]) -> dict[int, tuple[list[str], Authority]]:
    """For each hidden run (first step -> last), the identifiers its range line keeps (``salient.range_ids``,
    within ``RANGE_IDS`` items and ``RANGE_ID_CHARS``) and the authority they are shown under: the least
    trusted among those steps (retrieved, tool, user, model, system: the identifiers of a tool's result are
    never shown as the user's words, nor as instructions)."""
    ranked = range_ids(steps, sorted(runs.items()))
    out = {}
    for i, j in runs.items():
        auth = min((Authority(s.authority) for s in steps[i: j + 1]), key=_TRUST.index)
        out[i] = (capped(ranked[i], RANGE_IDS, RANGE_ID_CHARS, words=True), auth)
    return out


#: Authorities from the least trusted to the most: a range line's names are shown under its steps' lowest.
_TRUST = [Authority.RETRIEVED, Authority.TOOL, Authority.USER, Authority.MODEL, Authority.SYSTEM]
