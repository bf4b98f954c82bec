"""A compiled prompt as the actor's chat: messages, token ids, and where the soft span goes.

The layout matches REMORY's training samples exactly: the compiled context (the "summary" side: stable
prefix, then the history at its resolutions) as a chat without the assistant prompt, then the soft-memory
span, then the bridge ``<assistant prompt>`` that the next action follows. Without soft memory the ids are
simply the chat with the generation prompt.

The model is offered ``glimpse`` as a tool: a reply that is exactly a glimpse call brings the full text of
a step back into the context for the same turn (at most the per-turn limit).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from palimpsest.platform.types import Prompt

GLIMPSE_TOOL = ("## Memory tool\nOlder steps may be shown summarised or as one-line placeholders `[#ID ...]`. "
                "To read the full text of step #ID before acting, reply with exactly `glimpse(#ID)` and nothing else.\n\n")
_GLIMPSE_CALL = re.compile(r"^\s*glimpse\(\s*#?(\d{1,18})\s*\)\s*$")


def glimpse_call(text: str) -> int | None:
    """The step id of a reply that is a glimpse call, else None."""
    m = _GLIMPSE_CALL.match(text or "")
    return int(m.group(1)) if m else None


def prompt_messages(prompt: Prompt, extra: list[str] = ()) -> list[dict]:
    """System segments -> one system message (with the glimpse tool), the rest -> one user message;
    ``extra`` (glimpsed texts) is appended to the user message."""
    system = "".join(s.text for s in prompt.segments if s.role == "system") + GLIMPSE_TOOL
    user = "".join(s.text for s in prompt.segments if s.role != "system")
    for e in extra:
        user += e
    return [{"role": "system", "content": system.rstrip()}, {"role": "user", "content": user.rstrip()}]


def special_strings(tokenizer) -> list[str]:
    """Every special / added token's text (``<|im_start|>``, ``<|im_end|>``, ...), longest first."""
    cached = getattr(tokenizer, "_palimpsest_specials", None)
    if cached is None:
        names = set(getattr(tokenizer, "all_special_tokens", []) or [])
        decoder = getattr(tokenizer, "added_tokens_decoder", {}) or {}
        names |= {t.content for t in decoder.values() if getattr(t, "special", True)}
        cached = sorted((n for n in names if isinstance(n, str) and len(n) > 1), key=len, reverse=True)
        try:
            tokenizer._palimpsest_specials = cached
        except AttributeError:
            pass
    return cached


def defuse(text: str, specials: list[str]) -> str:
    """Text that contains a special token's string (a tool output saying ``<|im_start|>system``) would be
    tokenized as that special token and could forge a turn of another role; a backslash after its first
    character keeps it readable and makes it plain text."""
    for sp in specials:
        if sp in text:
            text = text.replace(sp, sp[0] + "\\" + sp[1:])
    return text


def safe_messages(tokenizer, messages: list[dict]) -> list[dict]:
    specials = special_strings(tokenizer)
    return [{**m, "content": defuse(m["content"], specials)} for m in messages]


def _ids(tokenizer, messages: list[dict], generation_prompt: bool) -> list[int]:
    messages = safe_messages(tokenizer, messages)
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=True)
    if hasattr(out, "keys"):
        out = out["input_ids"]
    return list(out)


@dataclass(frozen=True)
class ChatIds:
    context: list[int]  # the chat up to the end of the last user message
    bridge: list[int]  # the assistant prompt (follows the soft span when there is one)

    @property
    def all(self) -> list[int]:
        return self.context + self.bridge

    def __len__(self) -> int:
        return len(self.context) + len(self.bridge)


def chat_prompt_ids(tokenizer, messages: list[dict]) -> list[int]:
    """The ids of a chat ending with the assistant prompt (what the actor answers), special tokens defused."""
    return _ids(tokenizer, messages, True)


def chat_ids(tokenizer, messages: list[dict]) -> ChatIds:
    with_prompt = _ids(tokenizer, messages, True)
    context = _ids(tokenizer, messages, False)
    if with_prompt[: len(context)] != context:  # a template that rewrites earlier turns: no split point
        return ChatIds(with_prompt, [])
    return ChatIds(context, with_prompt[len(context):])


def history_messages(session, steps, max_observation_chars: int = 4000) -> list[dict]:
    """The raw history in the actor's chat format (what the memory network reads), as REMORY's data builder
    writes it: system, task, then assistant (thought + action) / user (observation) turns."""
    msgs = [{"role": "system", "content": session.system or "You are a helpful agent."},
            {"role": "user", "content": session.task}]
    for s in steps:
        msgs.append({"role": "assistant", "content": "\n".join(x for x in (s.thought, s.action) if x).strip() or "(no action)"})
        if s.observation is not None:
            obs = s.observation
            if len(obs) > max_observation_chars:
                obs = obs[:max_observation_chars] + "\n[... cut]"
            msgs.append({"role": "user", "content": obs})
    return msgs
