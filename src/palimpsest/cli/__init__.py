"""The `palimpsest` command line.

    palimpsest import FILE                      trajectories (JSONL) into the ledger, enriched
    palimpsest render --session ID --policy P --budget N [--at T]
    palimpsest glimpse --session ID STEP_ID     the raw text of one step
    palimpsest audit --session ID               every audited turn of a session
    palimpsest policies                         names and default configs
    palimpsest view                             PACE and ACE side by side on a real trajectory
    palimpsest train-relevance --config F       the relevance predictor (Ray Train, MLflow)
    palimpsest serve [--config F]               the composed HTTP app (Ray Serve + vLLM) on this machine
    palimpsest ab report                        per-arm A/B comparison with confidence intervals
    palimpsest ab status                        candidate arms: stage, decisions and their evidence
    palimpsest demo                             the main job: memory, serving, live A/B traffic, report

The ledger is ``--ledger PATH``, else ``$PALIMPSEST_LEDGER``, else ``.palimpsest/ledger.db``.
Every refused input ends with one line on stderr naming the problem and exit status 2.
"""

from __future__ import annotations

import sys

import click
import typer

from palimpsest.cli import (
    ledger_commands,
    model_commands,
    relevance_commands,
    replay_commands,
    serve_commands,
)
from palimpsest.cli.common import _fail, _json_stdout  # noqa: F401  (the tests call _json_stdout)
from palimpsest.platform.types import PalimpsestError

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Palimpsest: compress the view, never the source.")
models_app = typer.Typer(help="Offline model assets.", no_args_is_help=True)
ab_app = typer.Typer(help="A/B rollouts of policies and memory models.", no_args_is_help=True)

# the commands, in the order `palimpsest --help` lists them
app.command("import")(ledger_commands.import_cmd)
app.command()(ledger_commands.render)
app.command()(ledger_commands.glimpse)
app.command()(ledger_commands.audit)
app.command()(ledger_commands.policies)
app.command()(replay_commands.replay)
app.command()(replay_commands.report)
app.command()(model_commands.train)
app.command("train-relevance")(relevance_commands.train_relevance)
app.command("eval-actions")(model_commands.eval_actions)
app.command("eval-memory")(model_commands.eval_memory)
app.command("eval-reconstruction")(model_commands.eval_reconstruction)
models_app.command("prepare")(model_commands.models_prepare)
app.command()(ledger_commands.view)
app.command()(serve_commands.demo)
app.command()(serve_commands.serve)
ab_app.command("report")(serve_commands.ab_report)
ab_app.command("status")(serve_commands.ab_status)
app.add_typer(models_app, name="models")
app.add_typer(ab_app, name="ab")


# click's, and those of the click that typer vendors (typer >= 0.2x raises its own for a bad option value)
USAGE_ERRORS = (click.ClickException, getattr(typer, "TyperException", click.ClickException))


def main() -> None:
    try:
        rc = app(standalone_mode=False)  # returns the exit code of typer.Exit instead of raising
    except PalimpsestError as e:
        _fail(str(e))
    except typer.Exit as e:
        sys.exit(e.exit_code)
    except (typer.Abort, KeyboardInterrupt):
        sys.exit(130)
    except USAGE_ERRORS as e:  # usage errors carry their own message (naming the option) and exit code 2
        if hasattr(e, "show"):
            e.show()
        else:
            _fail(str(e))
        sys.exit(getattr(e, "exit_code", 2))
    sys.exit(rc if isinstance(rc, int) else 0)
