"""How one step looks at each resolution. The only place that knows the text layout of a step.

Every segment starts with a header naming the step id, so the actor can ``glimpse`` any step it
sees, and content of an untrusted authority (tool output, retrieved pages) is always inside a
delimited block that its own text cannot close.
"""

from __future__ import annotations

import re

from palimpsest.platform.types import Authority, Resolution, Session, Step, StepRecord

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


def header(step: Step | StepRecord, step_id: int, resolution: Resolution) -> str:
    return f"### #{step_id} t={step.t} {step.kind} ({resolution.label})\n"


def render_full_body(step: Step | StepRecord) -> str:
    parts = []
    if step.thought:
        parts.append(f"thought: {step.thought}")
    if step.action:
        parts.append(f"action: {step.action}")
    if step.observation is not None:
        parts.append(authority_block(step.observation, step.authority))
    return "\n".join(parts)


def key_text(step: Step | StepRecord) -> str:
    """R_full as an embedder reads it: the step's own words, without the prompt's markup."""
    return "\n".join(x for x in (step.thought, step.action, step.observation) if x)


def render_placeholder_body(step: Step | StepRecord, step_id: int) -> str:
    """One line of at most ~20 tokens: the step id (for ``glimpse``), kind, tool or command, and a gist."""
    tool = f" {step.tool}" if step.tool and step.tool != step.kind else ""
    what = gist(step.action or step.thought or "(no action)", 36)
    if tool and what.startswith(step.tool):
        what = what[len(step.tool):].lstrip() or what
    return f"[#{step_id} {step.kind}{tool}] {what}"


def render_segment(step: Step | StepRecord, step_id: int, resolution: Resolution, body: str) -> str:
    """The text of one history segment. A placeholder is one line; every other resolution gets a
    header line and ends with a blank line, so segments tokenise independently."""
    if resolution is Resolution.PLACEHOLDER:
        return body + "\n"
    return header(step, step_id, resolution) + body + "\n\n"


def render_prefix(session: Session) -> list[tuple[str, str, str]]:
    """(kind, role, text) of the stable prefix: system, tools, task. Byte-identical on every turn."""
    out = []
    if session.system:
        out.append(("system", "system", session.system.rstrip() + "\n\n"))
    if session.tools:
        out.append(("tools", "system", "## Tools\n" + session.tools.rstrip() + "\n\n"))
    out.append(("task", "user", "## Task\n" + session.task.rstrip() + "\n\n"))
    return out


def render_fold(text: str, upto: int) -> str:
    return f"## Summary of steps 0..{upto - 1}\n{text.rstrip()}\n\n"

