"""What every command shares: the ledger's location, options, JSON-only output, one-line failures."""

from __future__ import annotations

import contextlib
import json
import math
import numbers
import os
import sys
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console

from palimpsest.platform.compile.budget import Budget
from palimpsest.platform.policies import (
    load_policy_file,
    parse_policy_config,
)
from palimpsest.platform.types import BudgetError, PalimpsestError

out = Console()
if not out.is_terminal:  # a log or a pipe: progress lines stay whole, never wrapped at 80 columns
    out.soft_wrap = True


err = Console(stderr=True)


DEFAULT_LEDGER = ".palimpsest/ledger.db"


def _budget(budget: int, max_tokens: int = 0) -> Budget:
    """``--budget`` and ``--max-tokens`` as one Budget, the error naming the flag."""
    try:
        return Budget(budget, max_tokens)
    except BudgetError as e:
        flag = "--budget" if "token budget" in str(e) else "--max-tokens"
        raise PalimpsestError(f"{flag}: {e}") from None


def shared_dev_file() -> Path:
    """The dev trajectories of the shared folder beside the project ($PALIMPSEST_SHARED overrides)."""
    rel = Path("data") / "trajectories" / "dev.jsonl"
    roots = [os.environ.get("PALIMPSEST_SHARED"), Path.cwd().parent / "shared",
             Path(__file__).resolve().parents[2].parent / "shared"]
    for root in roots:
        if root and (Path(root) / rel).is_file():
            return Path(root) / rel
    return Path.cwd().parent / "shared" / rel


LedgerOpt = typer.Option(None, "--ledger", help="ledger file or postgresql:// URL "
                                                  "(default $PALIMPSEST_LEDGER or .palimpsest/ledger.db)")


EmbedderOpt = typer.Option("minilm", "--embedder", help="key embedder: minilm (all-MiniLM-L6-v2) or hashing")


TokenizerOpt = typer.Option("smollm2", "--tokenizer",
                            help="token counting: smollm2 (the actor's), approx, or a tokenizer.json path")


def _ledger_path(path: Optional[str]) -> str:
    """A ledger file or a database URL (kept as text: a URL is not a path)."""
    return str(path or os.environ.get("PALIMPSEST_LEDGER") or DEFAULT_LEDGER)


def _existing(path: str | Path) -> str:
    """A ledger that must exist already: a file is checked here, a database when it is opened."""
    if "://" not in str(path) and not Path(path).is_file():
        raise PalimpsestError(f"no ledger at {path}; `palimpsest import FILE` creates one")
    return str(path)


@contextlib.contextmanager
def _json_stdout(active: bool):
    """With --json, stdout carries the JSON object and nothing else: whatever libraries print while the work
    runs (DeepSpeed's accelerator notice, progress lines) goes to stderr, at the file-descriptor level."""
    if not active:
        yield
        return
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def _finite(value):
    """``value`` with every float that is not a number (NaN, an infinity) as None: JSON has no such numbers."""
    if isinstance(value, numbers.Real) and not isinstance(value, numbers.Integral):  # numpy's floats too
        return float(value) if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def print_json(doc, indent: int | None = None, default=None) -> None:
    """What ``--json`` prints: one strict JSON document on stdout (a figure with no value, such as the mean of no
    pairs, is null), written as is, never through a console that would wrap it."""
    text = json.dumps(_finite(doc), indent=indent, default=default, allow_nan=False)
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def _fail(message: str) -> None:
    err.print(f"[bold red]error:[/] {message}", highlight=False)
    sys.exit(2)


def _policy_config(policy: str, config_file: Optional[Path]):
    cfg = load_policy_file(config_file) if config_file else parse_policy_config(policy)
    if cfg.type != policy:
        raise PalimpsestError(f"--policy {policy} does not match the type {cfg.type!r} in {config_file}")
    return cfg


IncludeTrainOpt = typer.Option(False, "--include-train", help="also score trajectories the memory trained on")


MaxTargetOpt = typer.Option(48, "--max-target-tokens", min=1)


WindowOpt = typer.Option(None, "--window", help="the actor's window (default: the serve config's)")


SeedOpt = typer.Option(0, "--seed")


TeacherCacheOpt = typer.Option(None, "--cache", help="teacher cache (Parquet; default .palimpsest/teachers.parquet)")


ReplayLedgerOpt = typer.Option(None, "--ledger", help="cache ledger (default .palimpsest/replay-<tokenizer>.db)")


EvalMlflowOpt = typer.Option(True, "--mlflow/--no-mlflow", help="log the evaluation as an MLflow run")


DeviceOpt = typer.Option("cpu", "--device", help="where the actor and the memory run (cpu, cuda, cuda:1)")
