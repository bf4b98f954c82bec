"""The deterministic abstraction writer (ACE's message-maintenance layer, in pure Python).

From one raw step it extracts a structured :class:`Abstraction` (outcome, summary, critical facts,
identifiers, paths, URLs, numbers, error lines, failed actions with reasons, follow-ups) and
renders the ``detailed`` and ``brief`` texts from it. It is the default summariser and the
fallback whenever an LLM summariser is slow or down, so it must never fail on any input.

Content that came from the environment stays inside an untrusted block in every text rendered
here (see :func:`palimpsest.platform.prompt.render.authority_block`).
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field
from functools import lru_cache

from palimpsest.platform.prompt.render import authority_block, gist
from palimpsest.platform.prompt.salient import extract_salient, ranked_ids, uniq
from palimpsest.platform.types import Authority, StepRecord

WRITER_NAME = "rule-abstraction"
WRITER_VERSION = "2"

# An error line starts like one (a listing of source code that merely mentions `except FooError:`
# is not a failure), or carries one of the shell's unmistakable messages anywhere.
_ERROR_LINE = re.compile(
    r"^\s*(?:Traceback \(most recent call last\)|[A-Z]\w*(?:Error|Exception|Exit)\b(?::|$)|E\s{2,}\S|FAILED\b|FAIL:"
    r"|ERROR\b|fatal:|error:|Segmentation fault)"
    r"|No such file or directory|command not found|Permission denied|exit code [1-9]\d*\]"
)
_FOLLOW_UP = re.compile(r"\b(next|then|need to|needs to|should|TODO|let me|let's|I will|I'll|plan)\b", re.I)
_RETURNCODE = re.compile(r"<returncode>\s*(-?\d+)\s*</returncode>|exit code (-?\d+)")

_IDS_DETAILED = 48
_IDS_BRIEF = 10
_FACT_LINES = 8
_LINE_CHARS = 200




@dataclass(frozen=True)
class Abstraction:
    t: int
    kind: str
    tool: str | None
    authority: str
    outcome: str  # ok | error | empty | unknown
    summary: str
    critical_facts: list[str] = field(default_factory=list)
    identifiers: list[str] = field(default_factory=list)
    paths: list[str] = field(default_factory=list)
    urls: list[str] = field(default_factory=list)
    numbers: list[str] = field(default_factory=list)
    error_lines: list[str] = field(default_factory=list)
    failed_actions: list[dict[str, str]] = field(default_factory=list)
    follow_ups: list[str] = field(default_factory=list)
    key_ids: list[str] = field(default_factory=list)  # the few paths and ids the output is most about

    def to_json(self) -> str:
        return json.dumps(asdict(self), ensure_ascii=False, sort_keys=True)

    @classmethod
    def from_json(cls, s: str) -> "Abstraction":
        return cls(**json.loads(s))

    def salient(self) -> frozenset[str]:
        """The tokens a step is about: what the rule elasticizer matches against."""
        return frozenset(self.identifiers) | frozenset(self.paths) | frozenset(self.urls)


@lru_cache(maxsize=262_144)
def step_facts(step_id: int, abstraction_json: str, action: str) -> tuple[frozenset[str], bool, bool]:
    """(salient tokens of the step, failed?, has follow-ups?) from its stored abstraction and its action.

    Cached by content: steps never change, so policies pay the JSON parse once per step, not per turn.
    """
    a = Abstraction.from_json(abstraction_json)
    ids, paths, urls, _ = extract_salient(action, limit=64)
    salient = a.salient() | frozenset(ids) | frozenset(paths) | frozenset(urls)
    return salient, a.outcome == "error" or bool(a.failed_actions), bool(a.follow_ups)


def _outcome(obs: str | None, errors: list[str]) -> str:
    if obs is None:
        return "unknown"
    m = _RETURNCODE.search(obs)
    if m:
        code = int(m.group(1) or m.group(2))
        if code != 0:
            return "error"
    if errors:
        return "error"
    body = re.sub(r"</?(returncode|output)>|\d+", "", obs).strip()
    return "ok" if body else "empty"


def _fact_lines(obs: str, identifiers: list[str], errors: list[str]) -> list[str]:
    """Lines worth keeping verbatim: errors first, then the lines densest in identifiers."""
    wanted = set(identifiers[:_IDS_DETAILED])
    scored = []
    for i, line in enumerate(obs.splitlines()):
        s = line.strip()
        if not s or s in errors:
            continue
        hits = sum(1 for w in re.findall(r"[\w.]+", s) if w in wanted)
        if hits:
            scored.append((-hits, i, s[:_LINE_CHARS]))
    scored.sort()
    keep = sorted(scored[: _FACT_LINES], key=lambda x: x[1])
    return errors[:3] + [s for _, _, s in keep]


def abstract_step(step: StepRecord) -> Abstraction:
    """The structured abstraction of one raw step. Pure and deterministic."""
    obs = step.observation or ""
    errors = uniq((ln.strip()[:_LINE_CHARS] for ln in obs.splitlines() if _ERROR_LINE.search(ln)), 6)
    ids, paths, urls, numbers = extract_salient(obs)
    # The brief keeps the most frequent ones: what an output keeps returning to is what it is about.
    key_ids = ranked_ids(obs, ids, paths, _IDS_BRIEF)
    outcome = _outcome(step.observation, errors)
    summary = gist(step.action or step.thought or step.kind, 160)
    failed = ([{"action": gist(step.action, 120), "reason": errors[0] if errors else "non-zero exit"}]
              if outcome == "error" else [])
    follow = uniq(
        (s.strip()[:_LINE_CHARS] for s in re.split(r"(?<=[.!?])\s+|\n", step.thought or "") if _FOLLOW_UP.search(s)), 2
    )
    return Abstraction(
        t=step.t,
        kind=step.kind,
        tool=step.tool,
        authority=step.authority.value,
        outcome=outcome,
        summary=summary,
        critical_facts=_fact_lines(obs, ids, errors),
        identifiers=ids[: _IDS_DETAILED * 2],
        key_ids=key_ids,
        paths=paths[:24],
        urls=urls[:12],
        numbers=numbers[:16],
        error_lines=errors,
        failed_actions=failed,
        follow_ups=follow,
    )


def _first(items: list[str], order: list[str] | None, n: int) -> list[str]:
    """``items[:n]``, or with ``order`` (the identifiers the session may reuse, first: ``platform.prompt.names``) the
    items ``order`` names first, in its order, then the rest as they were: within the same cap."""
    if not order:
        return items[:n]
    have = set(items)
    return uniq([x for x in order if x in have] + items, n)


def render_detailed(a: Abstraction, order: list[str] | None = None) -> str:
    """The detailed text; ``order`` puts the identifiers a later step may reuse first within each list's cap."""
    lines = [f"action: {a.summary}", f"outcome: {a.outcome}"]
    for f in a.failed_actions:
        lines.append(f"failed: {f['reason']}")
    for fu in a.follow_ups:
        lines.append(f"next: {fu}")
    facts = []
    if a.critical_facts:
        facts.append("facts:\n" + "\n".join(f"- {x}" for x in a.critical_facts))
    for label, items in (("paths", _first(a.paths, order, 16)), ("ids", _first(a.identifiers, order, _IDS_DETAILED)),
                         ("urls", a.urls[:8]), ("numbers", a.numbers[:12])):
        if items:
            facts.append(f"{label}: " + ", ".join(items))
    text = "\n".join(lines)
    if facts:
        text += "\n" + authority_block("\n".join(facts), a.authority)
    return text


#: a brief's identifiers: at most this many paths and ids (then one URL), the abstraction's ``key_ids`` or, given an
#: ``order``, its first ones
BRIEF_NAMES = _IDS_BRIEF + 3


def render_brief(a: Abstraction, order: list[str] | None = None) -> str:
    """The one-line brief; ``order`` (``platform.prompt.names``) replaces the most frequent paths and ids by the
    identifiers a later step may reuse, first, within the same number of items."""
    head = f"{a.summary[:100]} -> {a.outcome}"
    if a.failed_actions:
        head += f" ({gist(a.failed_actions[0]['reason'], 60)})"
    keys = a.key_ids if order is None else uniq(order, BRIEF_NAMES)
    seen = uniq(keys + a.urls[:1], _IDS_BRIEF + 4)
    if seen:
        head += " " + authority_block(", ".join(seen), a.authority, inline=True)
    return head


@dataclass(frozen=True)
class Summaries:
    abstraction: Abstraction
    detailed: str
    brief: str


class RuleSummarizer:
    """The default summariser: deterministic, instant, never fails."""

    name = WRITER_NAME
    version = WRITER_VERSION

    def summarize(self, step: StepRecord) -> Summaries:
        a = abstract_step(step)
        return Summaries(a, render_detailed(a), render_brief(a))


def is_untrusted(authority: str | Authority) -> bool:
    return not Authority(authority).trusted
