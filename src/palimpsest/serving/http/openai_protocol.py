"""OpenAI chat messages -> a session and its steps. Every message is recorded or refused; none is dropped.

An agent framework resends its whole message list every turn. The proxy reads it as: leading
system/developer messages = the session's system prompt, the first user message = the task, then each
assistant message with the user/tool/system messages that follow it = one step (action, observation). An
assistant message followed directly by another is a step without an observation. Messages that come
before any action (a user or system speaking twice) are a step of their own. An assistant's tool calls and
the tool messages answering them (by ``tool_call_id``, each checked against the calls) are recorded
structurally with their step (``palimpsest.platform.prompt.toolcalls``). A request ends with what the reply
answers (a user, tool or system message): a trailing assistant message (a prefill to continue) is refused,
as is the legacy ``function_call`` format and any other field of a message that would be ignored. Matching
is by position and content hash: steps already in the ledger must hash the same (resending history is a
no-op), a changed one is a conflict, new ones are appended. Content the text actor cannot read (images,
audio, files) is refused with an error naming the message and part.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace

from palimpsest.platform.prompt import toolcalls
from palimpsest.platform.types import Authority, PalimpsestError, StepRecord
from palimpsest.serving.http.errors import HistoryConflict


def plain(content) -> str:
    """A message's content as text (its text parts joined), as the template renders it."""
    if content is None or isinstance(content, str):
        return content or ""
    return "\n".join(p.get("text", "") for p in content if isinstance(p, dict))


def _text(content, where: str = "content") -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = []
    for j, p in enumerate(content):  # OpenAI content parts: text is read, anything else is refused
        if isinstance(p, dict) and p.get("type") in ("text", "input_text") and isinstance(p.get("text"), str):
            extra = sorted(k for k in set(p) - {"type", "text"} if p[k] not in (None, "", [], {}))
            if extra:
                raise PalimpsestError(f"{where}[{j}].{extra[0]}: not read by this endpoint (nothing is ignored "
                                      "silently; remove the field)")
            parts.append(p["text"])
            continue
        kind = p.get("type") if isinstance(p, dict) else type(p).__name__
        raise PalimpsestError(f"{where}[{j}]: a {kind!r} content part cannot be read by the text actor "
                              "(send text parts only)")
    return "\n".join(parts)


def _tool_calls(m) -> list[dict]:
    """An assistant message's tool calls as the ledger records them (arguments as JSON text)."""
    out = []
    for c in getattr(m, "tool_calls", None) or []:
        args = c.function.arguments
        if not isinstance(args, str):
            args = json.dumps(args, ensure_ascii=False, sort_keys=True)
        out.append({"id": c.id, "name": c.function.name, "arguments": args})
    return out


_ROLE = {"function": "tool", "developer": "system"}


#: Fields an OpenAI client echoes back on an assistant message, empty: nothing to record
_EMPTY_OK = (None, "", [], {})


def _check_fields(m, i: int) -> None:
    """Every field of a message is read: one that would be ignored, non-empty, is refused by name."""
    if getattr(m, "name", None) and m.role not in ("tool", "function"):
        raise PalimpsestError(f"messages[{i}].name: a participant's name is not recorded (only a tool message's "
                              "name is: the tool it answers for); remove the field")
    for name, value in (getattr(m, "model_extra", None) or {}).items():
        if value in _EMPTY_OK:
            continue
        if name == "function_call":
            raise PalimpsestError(f"messages[{i}].function_call: the legacy function-call format is not served; "
                                  "send tool_calls (each with an id) and tool messages with tool_call_id")
        raise PalimpsestError(f"messages[{i}].{name}: not read by this endpoint (nothing is ignored silently; "
                              "remove the field)")


def _action(m, i: int) -> tuple[str, list[dict]]:
    calls = _tool_calls(m)
    return toolcalls.action_text(_text(m.content, f"messages[{i}].content"), calls), calls


def _answers(calls: list[dict], obs: list[tuple[int, object]], call_at: int | None) -> list[toolcalls.Result]:
    """The messages that answer an action, each checked against the calls it names."""
    ids = {c["id"] for c in calls}
    out = []
    for k, o in obs:
        tcid = getattr(o, "tool_call_id", None) or (getattr(o, "model_extra", None) or {}).get("tool_call_id")
        # A tool message after an action without structured calls keeps its id as it came (older agents write
        # the call in the text); one naming a call its action did not make is refused.
        if tcid is not None and calls:
            if tcid not in ids:
                raise PalimpsestError(f"messages[{k}].tool_call_id: {tcid!r} answers none of the tool calls of "
                                      f"messages[{call_at}] ({', '.join(sorted(ids))})")
        out.append(toolcalls.Result(_ROLE.get(o.role, o.role), _text(o.content, f"messages[{k}].content"), tcid,
                                    o.name if o.role in ("tool", "function") else None))
    return out


@dataclass(frozen=True)
class ParsedChat:
    system: str
    task: str
    steps: list[StepRecord]
    # per step, the hashes of the same messages under the other reading of a user message that answers an
    # action (tool output or the principal's words): a session recorded under either reading stays valid
    alternates: list[frozenset[str]] = field(default_factory=list)


def parse_messages(messages, user_after_action: str = "tool") -> ParsedChat:
    """``user_after_action``: the authority of user messages that answer an assistant action (``tool``: agents
    such as mini-swe-agent send command output as user messages; ``user``: they are the principal's words).
    A ``tool`` message is always TOOL output, a system message mid-conversation SYSTEM."""
    i, n = 0, len(messages)
    for k, m in enumerate(messages):
        _check_fields(m, k)
    if messages[-1].role == "assistant":
        raise PalimpsestError(f"messages[{n - 1}]: a trailing assistant message (a prefill to continue) is not "
                              "served; end the list with the user, tool or system message the reply answers")
    system = []
    while i < n and messages[i].role in ("system", "developer"):
        system.append(_text(messages[i].content, f"messages[{i}].content"))
        i += 1
    if i >= n or messages[i].role != "user":
        raise PalimpsestError("the message list needs a user message (the task) after the system messages")
    task = _text(messages[i].content, f"messages[{i}].content")
    if not task.strip():
        raise PalimpsestError("the first user message (the task) is empty")
    i += 1
    steps: list[StepRecord] = []
    alternates: list[frozenset[str]] = []
    while i < n:
        m = messages[i]
        if m.role != "assistant":
            # Messages before any action of this step (the principal, or the operator, speaking again).
            j = i
            while j < n and messages[j].role != "assistant":
                j += 1
            group = messages[i:j]
            roles = {g.role for g in group}
            authority = (Authority.TOOL if roles & {"tool", "function"} else
                         Authority.SYSTEM if roles <= {"system", "developer"} else Authority.USER)
            answers = _answers([], list(zip(range(i, j), group)), None)
            rec = StepRecord(t=len(steps), kind="message", action="", observation="\n".join(a.content for a in answers),
                             authority=authority, calls=toolcalls.encode([], answers))
            steps.append(rec)
            alternates.append(_unstructured(rec))
            i = j
            continue
        action, calls = _action(m, i)
        j = i + 1
        while j < n and messages[j].role != "assistant":
            j += 1
        obs_msgs = messages[i + 1: j]
        if not obs_msgs:  # another assistant message follows (the list never ends with one): no observation, ever
            rec = StepRecord(t=len(steps), kind="respond", action=action, observation=None,
                             authority=Authority.MODEL, calls=toolcalls.encode(calls, []))
            steps.append(rec)
            alternates.append(_unstructured(rec))
            i = j
            continue
        roles = {o.role for o in obs_msgs}
        said: list = []  # trailing user messages after tool output, when they are the principal's words
        if roles & {"tool", "function"}:
            authority = Authority.TOOL
            if user_after_action == "user":
                last_tool = max(k for k, o in enumerate(obs_msgs) if o.role in ("tool", "function"))
                after = obs_msgs[last_tool + 1:]
                if after and all(o.role == "user" for o in after):  # the principal spoke after the output
                    said = [(i + 2 + last_tool + k, o) for k, o in enumerate(after)]
                    obs_msgs = obs_msgs[: last_tool + 1]
        elif roles <= {"system", "developer"}:
            authority = Authority.SYSTEM
        else:
            authority = Authority.TOOL if user_after_action == "tool" else Authority.USER
        tool = next((o.name for o in obs_msgs if o.role in ("tool", "function") and o.name), None)
        answers = _answers(calls, list(zip(range(i + 1, j), obs_msgs)), i)
        rec = StepRecord(t=len(steps), kind="tool_call" if authority is Authority.TOOL else "message",
                         action=action, observation="\n".join(a.content for a in answers),
                         authority=authority, tool=tool, calls=toolcalls.encode(calls, answers))
        steps.append(rec)
        if roles <= {"user"}:  # the other reading of user messages that answer an action
            other = Authority.USER if authority is Authority.TOOL else Authority.TOOL
            alternates.append(frozenset({replace(rec, authority=other,
                                                 kind="message" if other is Authority.USER else "tool_call").sha256()})
                              | _unstructured(rec))
        else:
            alternates.append(_unstructured(rec))
        if said:
            steps.append(StepRecord(t=len(steps), kind="message", action="",
                                    observation="\n".join(_text(o.content, f"messages[{k}].content") for k, o in said),
                                    authority=Authority.USER))
            alternates.append(frozenset())
        i = j
    alternates += [frozenset()] * (len(steps) - len(alternates))
    return ParsedChat(system="\n\n".join(s for s in system if s), task=task, steps=steps, alternates=alternates)


def _unstructured(rec: StepRecord) -> frozenset[str]:
    """The hash the same step had before tool calls were recorded structurally (sessions recorded then stay
    valid when the agent resends them)."""
    return frozenset() if rec.calls is None else frozenset({replace(rec, calls=None).sha256()})


def new_steps(existing_hashes: list[str], steps: list[StepRecord],
              alternates: list[frozenset[str]] | None = None) -> list[StepRecord]:
    """The steps not recorded yet; a recorded position whose content differs (under every reading in
    ``alternates``) is a :class:`HistoryConflict`."""
    for k, (have, step) in enumerate(zip(existing_hashes, steps)):
        if have != step.sha256() and not (alternates and k < len(alternates) and have in alternates[k]):
            raise HistoryConflict(f"message list rewrites recorded step t={k} (messages are matched by position "
                                  "and content hash; recorded history cannot change)")
    if len(steps) < len(existing_hashes):
        raise HistoryConflict(f"message list holds {len(steps)} steps but the session already has "
                              f"{len(existing_hashes)}: history cannot be removed")
    return steps[len(existing_hashes):]


def step_view(s) -> dict:
    """A recorded step on the wire (``GET /v1/sessions/{id}/steps``): its text fields, authority and hash, and,
    for a tool-calling step, the calls and each answer with its ``tool_call_id``."""
    sc = toolcalls.decode(s)
    out = {"t": s.t, "step_id": s.id, "kind": s.kind, "thought": s.thought, "action": s.action,
           "observation": s.observation, "authority": s.authority.value, "tool": s.tool, "sha256": s.sha256,
           "tool_calls": [toolcalls.wire(c) for c in sc.tool_calls] if sc else [],
           "results": [{"role": r.role, "tool_call_id": r.tool_call_id, "name": r.name, "content": r.content}
                       for r in sc.results] if sc else []}
    ids = [r.tool_call_id for r in sc.results if r.tool_call_id] if sc else []
    out["tool_call_id"] = ids[0] if len(ids) == 1 else (ids or None)
    return out
