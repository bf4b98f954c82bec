"""`palimpsest train-relevance`: the relevance predictor's training job (``training/relevance_trainer.py``)."""

from __future__ import annotations

from pathlib import Path

import typer

from palimpsest.cli.common import _json_stdout, print_json
from palimpsest.training.relevance_trainer import launch, load_config


def train_relevance(config: Path = typer.Option(..., "--config", help="configs/relevance/train.yaml"),
                    track: bool = typer.Option(True, "--mlflow/--no-mlflow",
                                               help="log and register in MLflow")) -> None:
    """Train the relevance predictor on Ray Train (the fit half) and register it as palimpsest-relevance."""

    cfg = load_config(config)
    with _json_stdout(True):  # what Ray and the worker print goes to stderr
        summary = launch(cfg, track=track)
    print_json(summary, indent=2, default=str)
