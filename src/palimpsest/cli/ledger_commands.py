"""Commands over the ledger: import trajectories, render a compiled turn, glimpse, audit, the policies, and the
side-by-side view."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
import yaml
from rich.table import Table

from palimpsest.cli.common import (
    EmbedderOpt,
    LedgerOpt,
    TokenizerOpt,
    _budget,
    _existing,
    _ledger_path,
    _policy_config,
    err,
    out,
    print_json,
    shared_dev_file,
)
from palimpsest.evaluation.replay import (
    session_cost,
)
from palimpsest.pipelines.environment import open_runtime
from palimpsest.pipelines.trajectories import import_file
from palimpsest.pipelines.view import run_demo
from palimpsest.platform import Ledger, Runtime
from palimpsest.platform.compile.budget import Budget
from palimpsest.platform.policies import (
    default_configs,
)
from palimpsest.platform.prompt.chat import tool_tokens
from palimpsest.platform.types import PalimpsestError
from palimpsest.serving.serve_config import ActorConfig


def import_cmd(
    file: Path = typer.Argument(..., help="trajectories, one JSON object per line"),
    ledger: Optional[str] = LedgerOpt,
    enrich: bool = typer.Option(True, help="write summaries and keys now (otherwise on first use)"),
    embedder: str = EmbedderOpt,
    tokenizer: str = TokenizerOpt,
) -> None:
    """Import agent trajectories into the ledger (each becomes a session named by its id)."""
    from rich.progress import Progress


    if not file.is_file():
        raise PalimpsestError(f"trajectory file not found: {file}")
    rt = open_runtime(_ledger_path(ledger), embedder, tokenizer)
    with rt.ledger as led:
        with Progress(console=err, transient=True) as bar:
            task = bar.add_task("importing", total=None)

            def done(traj) -> None:
                if enrich and led.count(traj.id):
                    rt.enrich(traj.id)
                bar.advance(task)

            report = import_file(led, file, on_trajectory=done)
        table = Table("session", "steps", title=f"imported into {led.path}")
        for sid, n in report.imported:
            table.add_row(sid, str(n))
        out.print(table)
    for e in report.errors:
        err.print(f"[red]refused:[/] {e}", highlight=False)
    if report.errors:
        raise typer.Exit(1 if report.imported else 2)


def render(
    session: str = typer.Option(..., "--session", help="session id"),
    policy: str = typer.Option(..., "--policy", help="policy name (see `palimpsest policies`)"),
    budget: int = typer.Option(..., "--budget", help="token budget of what the actor receives (prompt + max_tokens)"),
    at: Optional[int] = typer.Option(None, "--at", help="compile the context before step T (default: next step)"),
    max_tokens: Optional[int] = typer.Option(None, "--max-tokens",
                                             help="tokens kept for the reply (default: the serve config's "
                                                  "actor.max_tokens)"),
    policy_config: Optional[Path] = typer.Option(None, "--policy-config", help="YAML config of the policy"),
    show_prompt: bool = typer.Option(True, "--prompt/--no-prompt", help="print the compiled context"),
    cached_rate: float = typer.Option(0.1, "--cached-rate", min=0.0, max=1.0,
                                      help="price of a cached input token against an uncached one (the cost block)"),
    as_json: bool = typer.Option(False, "--json",
                                 help="print one JSON object (ids, text, messages, plan) and nothing else"),
    ledger: Optional[str] = LedgerOpt,
    embedder: str = EmbedderOpt,
    tokenizer: str = TokenizerOpt,
) -> None:
    """Compile one turn's prompt exactly as the actor would receive it, and show it with its plan."""
    if at is not None and at < 0:
        raise PalimpsestError(f"--at must be >= 0, got {at}")
    reserve = ActorConfig().max_tokens if max_tokens is None else max_tokens
    limit = _budget(budget, reserve)  # --budget, --max-tokens: checked here, once
    cfg = _policy_config(policy, policy_config)
    rt = open_runtime(_existing(_ledger_path(ledger)), embedder, tokenizer)
    with rt.ledger as led:
        sess = led.session(session)  # unknown session -> a clear error before any work
        rt.enrich(session)
        turn = rt.turn(session, cfg, limit, at=at, record=False)
        if as_json:

            cost = session_cost(rt, session, cfg, limit, turn.t, cached_rate)
    p = turn.prompt
    if as_json:
        spans = {s.t: s for s in p.segments if s.t is not None and s.kind == "step"}
        prefix = sum(1 for s in p.segments if s.kind in ("system", "task"))

        history = p.tokens - p.prefix_tokens
        tools = tool_tokens(rt.ledger.tokenizer, sess)
        print_json({
            "session": session, "t": turn.t, "policy": turn.plan.policy, "config_hash": turn.plan.config_hash,
            "tokenizer": rt.ledger.tokenizer.name, "budget": budget, "max_tokens": reserve,
            "prompt_token_ids": p.ids, "prompt_text": p.text, "messages": list(p.messages),
            "soft_slot": len(p.context_ids),
            "tokens": {"prompt": p.tokens, "prefix": p.prefix_tokens, "history": history, "tools": tools, "soft": 0,
                       "max_tokens": reserve, "total": p.tokens + reserve},
            "prefix_messages": prefix, "parts": "prompt = prefix + history; prefix is the system message and the task "
                                                 "(tools: what the tool declarations add to it); soft is 0 here: a "
                                                 "memory arm adds its soft positions when serving",
            "prompt_hash": p.prompt_hash, "prefix_hash": p.prefix_hash,
            "elided": turn.plan.info.get("elided", []),
            "compaction": turn.plan.info.get("compaction"), "epoch": turn.plan.info.get("epoch"),
            "cost": cost,
            "plan": [{"t": e.t, "step_id": e.step_id, "resolution": e.resolution.label, "reason": e.reason,
                      "score": e.score, "messages": list(spans[e.t].messages) if e.t in spans else None}
                     for e in turn.plan.entries()],
        })
        return
    table = Table("t", "step", "resolution", "score", "reason", title=f"{policy} plan at t={turn.t}")
    for e in turn.plan.entries():
        table.add_row(str(e.t), f"#{e.step_id}", e.resolution.label, f"{e.score:.3g}", e.reason)
    out.print(table)
    if turn.plan.degradations:
        out.print(f"degraded to fit the budget: {len(turn.plan.degradations)} level steps")
    for e in turn.plan.info.get("elided", []):
        out.print(f"step #{e['step_id']} (t={e['t']}, {e['chars']} characters) shown head and tail to fit")
    if show_prompt:
        out.rule("compiled prompt (the actor's ids, decoded)")
        out.print(p.text, markup=False, highlight=False)
    out.print(f"tokens: {p.tokens} + max_tokens {reserve} / budget {budget} (prefix {p.prefix_tokens}); "
              + ", ".join(f"{k} {v}" for k, v in turn.plan.counts().items()))


def glimpse(
    step_id: str = typer.Argument(..., help="the step id a placeholder shows, e.g. 42 or #42"),
    session: str = typer.Option(..., "--session"),
    ledger: Optional[str] = LedgerOpt,
) -> None:
    """Print the raw text of one step of a session (counts against the turn's glimpse limit)."""
    with Ledger(_existing(_ledger_path(ledger))) as led:
        out.print(Runtime(led).glimpse(session, step_id), markup=False, highlight=False)


def audit(session: str = typer.Option(..., "--session"), ledger: Optional[str] = LedgerOpt) -> None:
    """Show every audited turn of a session."""
    with Ledger(_existing(_ledger_path(ledger))) as led:
        rows = led.audit(session)
    table = Table("t", "policy", "config", "budget", "tokens", "prompt hash", "resolutions", "degraded")
    for r in rows:
        table.add_row(str(r["t"]), r["policy"], r["config_hash"], str(r["budget"]), str(r["tokens"]),
                      r["prompt_hash"][:12], " ".join(f"{k}={v}" for k, v in r["counts"].items() if v),
                      str(len(r["degradations"])))
    out.print(table)


def policies() -> None:
    """List the policies and their default configs."""
    for name, cfg in default_configs().items():
        out.rule(name)
        out.print((cfg.__doc__ or "").strip(), highlight=False)
        out.print(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False).rstrip(), markup=False)


def view(
    data: Optional[Path] = typer.Option(None, help="trajectories (default: ../shared/data/trajectories/dev.jsonl)"),
    trajectory: Optional[str] = typer.Option(None, help="trajectory id (default: the longest)"),
    budget: int = typer.Option(16000, help="token budget"),
    ledger: Optional[Path] = typer.Option(None, help="ledger file (default: .palimpsest/demo.db)"),
    embedder: str = EmbedderOpt,
    tokenizer: str = TokenizerOpt,
) -> None:
    """Import the dev trajectories and show PACE and ACE side by side on one of them (offline, no server)."""
    path = data or shared_dev_file()
    if not path.is_file():
        raise PalimpsestError(f"no trajectories at {path}; pass --data FILE")

    Budget(budget)
    run_demo(out, path, trajectory, budget, open_runtime(ledger or Path(".palimpsest/demo.db"), embedder, tokenizer))
