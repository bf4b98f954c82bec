"""Offline replay of trajectories under policies, and its report."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
import yaml

from palimpsest.cli.common import (
    EmbedderOpt,
    ReplayLedgerOpt,
    TokenizerOpt,
    _budget,
    err,
    out,
    print_json,
)
from palimpsest.evaluation.replay import run_replay, summary_markdown, write_outputs
from palimpsest.evaluation.replay_report import write_report
from palimpsest.pipelines.environment import open_runtime
from palimpsest.pipelines.replay_sessions import TimedEmbedder
from palimpsest.pipelines.tracking import log_replay
from palimpsest.platform.policies import (
    PolicyConfigBase,
    load_policy_file,
    parse_policy_config,
)
from palimpsest.platform.types import PalimpsestError
from palimpsest.serving.serve_config import ActorConfig


def _policy_set(names: str, config_file: Optional[Path]) -> dict:
    """Labels -> configs. A YAML file holds one config (it replaces that type's defaults) or a mapping
    of labels to configs (variants such as `window_k20: {type: window, k: 20}`)."""
    variants: dict[str, PolicyConfigBase] = {}
    if config_file:
        data = yaml.safe_load(config_file.read_text()) if config_file.is_file() else None
        if not isinstance(data, dict):
            raise PalimpsestError(f"{config_file}: expected a policy config or a mapping of labels to configs")
        if "type" in data:
            cfg = load_policy_file(config_file)
            variants[cfg.type] = cfg
        else:
            for label, body in data.items():
                try:
                    variants[str(label)] = parse_policy_config(body)
                except PalimpsestError as e:
                    raise PalimpsestError(f"{config_file}: {label}: {e}") from None
    labels = [n.strip() for n in names.split(",") if n.strip()]
    if not labels:
        raise PalimpsestError("--policy needs at least one policy name")
    if len(set(labels)) != len(labels):
        raise PalimpsestError(f"--policy lists a policy twice: {names}")
    return {label: variants[label] if label in variants else parse_policy_config(label) for label in labels}


def replay(
    data: Path = typer.Option(..., "--data", help="trajectories (JSONL, the shared schema)"),
    policy: str = typer.Option(..., "--policy", help="comma-separated policy names or labels from --policy-config"),
    budget: int = typer.Option(..., "--budget", help="token budget of every compiled context"),
    out_dir: Path = typer.Option(..., "--out", help="output folder (steps.parquet, summary.json, summary.md)"),
    policy_config: Optional[Path] = typer.Option(None, "--policy-config",
                                                 help="YAML: one config, or labels -> configs"),
    concat: bool = typer.Option(False, "--concat", help="replay all trajectories as one continuous session"),
    repeat: int = typer.Option(1, "--repeat", min=1, max=1000,
                               help="with --concat: the trajectories N times over, one session N times as long"),
    as_json: bool = typer.Option(False, "--json", help="print the summary JSON to stdout and nothing else"),
    cached_rate: float = typer.Option(0.1, "--cached-rate", min=0.0, max=1.0,
                                      help="price of a cached input token against an uncached one (billed per turn)"),
    max_tokens: Optional[int] = typer.Option(None, "--max-tokens", min=0,
                                             help="tokens each prompt keeps free for the reply (default: the serve "
                                                  "config's actor.max_tokens, as serving reserves it)"),
    ledger: Optional[Path] = ReplayLedgerOpt,
    embedder: str = EmbedderOpt,
    tokenizer: str = TokenizerOpt,
    mlflow: bool = typer.Option(True, "--mlflow/--no-mlflow", help="log the replay as an MLflow run"),
) -> None:
    """Replay trajectories under several policies: need recall, token cost, longevity."""
    import json as _json

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn


    if repeat > 1 and not concat:
        raise PalimpsestError("--repeat needs --concat (it repeats the trajectories inside one session)")

    reserve = _budget(budget, ActorConfig().max_tokens if max_tokens is None else max_tokens).reply
    policies = _policy_set(policy, policy_config)
    if not data.is_file():
        raise PalimpsestError(f"trajectory file not found: {data}")
    cache = ledger or Path(f".palimpsest/replay-{Path(tokenizer).name}.db")
    rt = open_runtime(cache, embedder, tokenizer, wrap=TimedEmbedder)
    timer = rt.embedder
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=err, transient=True) as bar:
        result = run_replay(rt, data, policies, budget, concat=concat, timer=timer, progress=bar, reserve=reserve,
                            repeat=repeat, cached_rate=cached_rate)
    rt.ledger.close()
    write_outputs(result, out_dir)
    if mlflow:

        result.summary["mlflow_run_id"] = log_replay(result.summary, out_dir)
        (out_dir / "summary.json").write_text(_json.dumps(result.summary, indent=2) + "\n")
    for s in result.summary["skipped"]:
        err.print(f"[yellow]skipped:[/] {s['trajectory']}: {s['reason']}", highlight=False)
    if as_json:
        print_json(result.summary)
    else:
        out.print(summary_markdown(result.summary), markup=False, highlight=False)
        out.print(f"written to {out_dir}")


def report(dirs: list[Path] = typer.Argument(..., help="replay output folders (several budgets plot together)"),
           out_dir: Optional[Path] = typer.Option(None, "--out",
                                                  help="where to write (default: the first DIR)")) -> None:
    """Write report.md and PNG plots from one or more replay outputs."""
    path = write_report(dirs, out_dir or dirs[0])
    out.print(f"report written to {path}")
