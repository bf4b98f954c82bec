"""`make demo`: import real trajectories, then show PACE and ACE side by side on one of them."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.table import Table

from palimpsest.pipelines.trajectories import import_file
from palimpsest.platform import Runtime
from palimpsest.platform.compile.budget import Budget
from palimpsest.platform.prompt.render import gist
from palimpsest.platform.types import CompiledTurn, PalimpsestError, Resolution, Segment


def _excerpt(seg: Segment | None, width: int = 90) -> str:
    if seg is None:
        return "[dim]-[/]"
    body = seg.text if seg.resolution is Resolution.PLACEHOLDER else seg.text.split("\n", 1)[-1]
    return f"[bold]{seg.resolution.label}[/] ({seg.tokens} tok) {gist(body, width)}".replace("[", "\\[").replace(
        "\\[bold]", "[bold]").replace("\\[/]", "[/]")


def run_demo(out: Console, data: Path, trajectory: str | None, budget: int, rt: Runtime) -> None:
    with rt.ledger as led:
        report = import_file(led, data, on_trajectory=lambda tr: rt.enrich(tr.id) if led.count(tr.id) else None)
        for e in report.errors:
            out.print(f"[red]refused:[/] {e}", highlight=False)
        if not report.imported:
            raise PalimpsestError(f"no trajectory of {data} could be imported")
        sid = trajectory or max(report.imported, key=lambda x: x[1])[0]
        if sid not in dict(report.imported):
            raise PalimpsestError(f"trajectory {sid!r} is not in {data}")
        out.print(f"imported {len(report.imported)} trajectories ({sum(n for _, n in report.imported)} steps) "
                  f"into {led.path}; keys by {rt.embedder.name}, tokens by {led.tokenizer.name}")
        turns: dict[str, CompiledTurn] = {p: rt.turn(sid, p, Budget(budget)) for p in ("full", "pace", "ace")}
        snap = rt.snapshot(sid)
    full_tokens = rt.compile(snap, rt.policy("full"), Budget(1 << 40)).prompt.tokens  # the whole history, exactly

    summary = Table("policy", "tokens", "of full history", "full", "detailed", "brief", "placeholder", "drop",
                    "degraded", title=f"{sid}: context before step {turns['pace'].t}, budget {budget}")
    for name, turn in turns.items():
        c = turn.plan.counts()
        summary.add_row(name, str(turn.prompt.tokens), f"{turn.prompt.tokens / full_tokens:.0%}", str(c["full"]),
                        str(c["detailed"]), str(c["brief"]), str(c["placeholder"]), str(c["drop"]),
                        str(len(turn.plan.degradations)))
    out.print(f"full history: {full_tokens} tokens")
    out.print(summary)

    side = Table("t", f"PACE ({turns['pace'].prompt.tokens} tokens)", f"ACE ({turns['ace'].prompt.tokens} tokens)",
                 title="the two renderings, step by step", show_lines=False)
    by_t = {name: {s.t: s for s in turns[name].prompt.segments if s.kind == "step"} for name in ("pace", "ace")}
    hidden = 0
    for t in range(turns["pace"].t):
        pace, ace = by_t["pace"].get(t), by_t["ace"].get(t)
        if pace is None and ace is None:
            hidden += 1
            continue
        side.add_row(str(t), _excerpt(pace), _excerpt(ace))
    side.caption = f"{hidden} steps shown by neither policy are left out of this table"
    out.print(side)
    out.print("Every step stays in the ledger verbatim: `palimpsest glimpse --session ID STEP` restores any of them.")
