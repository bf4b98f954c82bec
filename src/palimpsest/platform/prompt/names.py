"""Which identifiers a summarised step names: the ones a later action may reuse, first, within the same caps.

A step shown as a detailed or brief summary keeps a capped list of the identifiers (paths, names, ids) its result
showed. The abstraction writer ranks them by how often the result returns to them, from the step alone. At a
compaction the session says more, from its past only (``name_order``):

1. the identifiers of the step that the next ``RECUR_WINDOW`` steps name again (the agent went back to them:
   what it goes back to once, it tends to reuse);
2. then those the step introduced: no earlier step, nor the task, nor the step's own action named them;
3. then the rest; each group by how often the result names it.

Both read only steps up to ``i + RECUR_WINDOW``: once those exist, a step's text is the same at every later turn,
so a boundary's kept region (its oldest steps) renders byte for byte again and the prefix cache holds it. Measured
in BENCHMARKS.md ("Identifiers in every degraded form").
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from palimpsest.platform.prompt.abstraction import Abstraction, render_brief, render_detailed
from palimpsest.platform.prompt.salient import extract_salient, step_identifiers, uniq
from palimpsest.platform.types import Resolution

if TYPE_CHECKING:
    from palimpsest.platform.ledger import SessionSnapshot

#: how many steps after a step count as "named again" (fitted on the fit half of dev_extra, 2, 3, 4, 6 tried)
RECUR_WINDOW = 4


def _first_named(snap: "SessionSnapshot") -> dict[str, int]:
    """token -> the first step that names it (-1: the task or the system prompt), built once per snapshot."""
    got = snap._memo.get("first_named")
    if got is None:
        got = {}
        for text in (snap.session.task or "", getattr(snap.session, "system", "") or ""):
            ids, paths, urls, _ = extract_salient(text)
            for tok in paths + ids + urls:
                got.setdefault(tok, -1)
        for k, s in enumerate(snap.steps):
            for tok in step_identifiers(s.action or "", s.observation or ""):
                got.setdefault(tok, k)
        snap._memo["first_named"] = got
    return got


def name_order(snap: "SessionSnapshot", i: int, a: Abstraction) -> list[str]:
    """Step i's paths and identifiers (its abstraction's), the ones a later action may reuse first (module doc)."""
    step = snap.steps[i]
    obs, action = step.observation or "", step.action or ""
    pool = uniq(a.paths + a.identifiers, len(a.paths) + len(a.identifiers) + 1)
    later: set[str] = set()
    for s in snap.steps[i + 1: i + 1 + RECUR_WINDOW]:
        later.update(step_identifiers(s.action or "", s.observation or ""))
    first = _first_named(snap)

    def group(tok: str) -> int:
        if tok in later:
            return 0
        return 1 if first.get(tok, i) == i and tok not in action else 2

    return sorted(pool, key=lambda tok: (group(tok), -obs.count(tok)))


def summary_body(snap: "SessionSnapshot", i: int, res: Resolution) -> str | None:
    """The text of step i at ``res``: a detailed or brief summary names its identifiers in ``name_order``; every
    other resolution (and a step with no abstraction yet) is the stored text."""
    if res not in (Resolution.DETAILED, Resolution.BRIEF) or snap.body(i, res) is None:
        return snap.body(i, res)
    a = snap.abstraction(i)
    if a is None:
        return snap.body(i, res)
    order = name_order(snap, i, a)
    return render_detailed(a, order) if res is Resolution.DETAILED else render_brief(a, order)


__all__ = ["RECUR_WINDOW", "name_order", "summary_body"]
