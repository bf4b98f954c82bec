"""The served app: the demo, `palimpsest serve`, the A/B report and the candidates' rollout status."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from palimpsest.cli.common import (
    _existing,
    err,
    out,
    print_json,
    shared_dev_file,
)
from palimpsest.demo import run_main_demo
from palimpsest.experiments.ab_report import ab_summary, log_ab
from palimpsest.experiments.ab_report import summary_markdown as ab_markdown
from palimpsest.experiments.gate import markdown as rollout_markdown
from palimpsest.experiments.gate import status as rollout_status
from palimpsest.platform import Ledger
from palimpsest.serving.local import LocalServer
from palimpsest.serving.serve_config import load_serve_config


def demo(
    data: Optional[Path] = typer.Option(None, help="trajectories (default: ../shared/data/trajectories/dev.jsonl)"),
    config: Path = typer.Option(Path("configs/serve/demo.yaml"), "--config", help="serve config of the live run"),
    train_config: Path = typer.Option(Path("configs/train/remory_demo.yaml"), "--train-config",
                                      help="memory training config used when no memory model is registered"),
    port: int = typer.Option(8000, min=1, max=65535),
    every: int = typer.Option(8, min=1, help="a turn every N steps of each trajectory"),
    first: Optional[int] = typer.Option(None, min=1, help="the first turn comes after this many steps (default: 4; "
                                                         "8 with --control)"),
    max_turns: Optional[int] = typer.Option(None, min=1, help="turns per session, each trajectory once per arm "
                                                             "(default: 1; 2 with --full)"),
    concurrency: Optional[int] = typer.Option(None, min=1, max=64, help="sessions driven at once (default: all, "
                                                                       "at most 16)"),
    limit: Optional[int] = typer.Option(None, min=1, help="only the first N trajectories that fit the budget "
                                                         "(default: 10, the dev file's then dev_extra.jsonl's beside "
                                                         "it; every one of the dev file with --control or --full)"),
    control: bool = typer.Option(False, "--control", help="the controls: the weak `last2` against `pace` (epochs) and "
                                                         "`pace-per-turn`, and `pace` against itself (A/A), at budget "
                                                         "4,096 with an 8K reference window"),
    full: bool = typer.Option(False, "--full", help="the larger run: every trajectory, two turns per session from "
                                                   "step 4, LLM summaries of every step appended (BENCHMARKS.md: "
                                                   "its time)"),
) -> None:
    """The main job: models, memory training if needed, the composed app, live A/B traffic, the report."""
    run_main_demo(out, data or shared_dev_file(), config, train_config, port=port, every=every, max_turns=max_turns,
                  concurrency=concurrency, limit=limit, control=control, full=full, first=first)


def serve(
    config: Optional[Path] = typer.Option(None, "--config",
                                          help="a ServeConfig YAML or a `serve run` config (default: embedded)"),
    host: str = typer.Option("127.0.0.1", "--host"),
    port: int = typer.Option(8000, "--port", min=1, max=65535),
) -> None:
    """Run the composed app locally until SIGTERM or Ctrl-C (then shut it down cleanly)."""
    import signal
    import threading


    cfg = load_serve_config(config)
    stop = threading.Event()
    server = LocalServer(cfg, host=host, port=port).start()
    # After Ray's start-up: its core worker installs its own SIGTERM handler, which would end the process
    # without shutting Serve down.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        err.print(f"serving at {server.url} (OpenAPI: {server.url}/docs; OpenAI base URL: {server.url}/v1); "
                  f"arms {server.info['arms']}; memory {server.info['memory']['models']['default']['model'] or 'off'}")
        stop.wait()
    finally:
        err.print("shutting down ...")
        server.stop()


def ab_report(
    ledger: str = typer.Option(".palimpsest/serve-ledger.db", "--ledger", help="the serving ledger (file or URL)"),
    since: float = typer.Option(0.0, "--since", help="only turns served after this unix time"),
    prefix: str = typer.Option("", "--prefix", help="only sessions whose id starts with this"),
    arms: Optional[str] = typer.Option(None, "--arms", help="comma-separated arms, control first (default: all)"),
    as_json: bool = typer.Option(False, "--json", help="print the summary as JSON only"),
    track: bool = typer.Option(False, "--mlflow/--no-mlflow", help="also log the comparison as an MLflow run"),
    experiment: str = typer.Option("palimpsest-ab", "--experiment"),
) -> None:
    """Per-arm comparison with 95% intervals: outcomes, shadow fidelity, tokens, latency by stage, prefix-cache hit
    rate, glimpses, errors; the smallest difference detectable at 80% power, and the paired comparison of
    trajectories run once per arm (sessions named ID@ARM)."""

    with Ledger(_existing(ledger)) as led:
        served = [r for r in led.served(since) if r["session_id"].startswith(prefix)]
        outcomes = [o for o in led.outcomes(since) if o["session_id"].startswith(prefix)]
        shadows = [r for r in led.shadows(since) if r["session_id"].startswith(prefix)]
        calls = [r for r in led.served(since, kind="summary") if r["session_id"].startswith(prefix)]
    summary = ab_summary(served, outcomes, [a.strip() for a in arms.split(",")] if arms else None, shadows, calls)
    md = ab_markdown(summary)
    if track:
        run_id, uri = log_ab(summary, experiment, {"ledger": str(ledger), "since": since, "prefix": prefix}, md)
        summary["mlflow"] = {"run_id": run_id, "tracking_uri": uri}
    if as_json:
        print_json(summary, default=float)
        return
    out.print(md, markup=False, highlight=False, soft_wrap=True)
    if track:
        out.print(f"MLflow run {summary['mlflow']['run_id']} at {summary['mlflow']['tracking_uri']}")


def ab_status(
    ledger: str = typer.Option(".palimpsest/serve-ledger.db", "--ledger", help="the serving ledger (file or URL)"),
    as_json: bool = typer.Option(False, "--json", help="print the status as JSON only"),
) -> None:
    """Each candidate arm's rollout: the stage in force (dark, canary, promoted, withdrawn), every decision with its
    evidence, and the paired shadow records since its stage began, as the serving replicas read them."""
    with Ledger(_existing(ledger)) as led:
        state = rollout_status(led)
    if as_json:
        print_json(state, default=float)
        return
    out.print(rollout_markdown(state), markup=False, highlight=False, soft_wrap=True)
