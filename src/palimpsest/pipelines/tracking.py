"""MLflow tracking: one small helper for every run Palimpsest logs (replays, training, A/B reports).

Where runs go, in order of precedence:

1. the config: ``tracking.uri`` / ``tracking.artifact_location`` of a training or serve config, applied
   with :func:`configure` (which exports them, so Ray workers and Serve replicas inherit them);
2. ``$MLFLOW_TRACKING_URI`` and ``$PALIMPSEST_MLFLOW_ARTIFACTS``;
3. a local SQLite store under ``.palimpsest/`` with artifacts beside it, so nothing needs a server.

In production the URI is a tracking server (``http://mlflow:5000``) and the artifact location an
object store (``s3://bucket/palimpsest``); :func:`check` tells at start-up whether the server answers.
"""

from __future__ import annotations

import math
import os
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from palimpsest.models.registry import mlflow_experiment, read_bundle, tracking_errors, tracking_uri
from palimpsest.platform.types import PalimpsestError

EXPERIMENT_REPLAY = "palimpsest-replay"
EXPERIMENT_ACTIONS = "palimpsest-eval-actions"


def configure(uri: str | None = None, artifact_location: str | None = None) -> str:
    """Apply a config's tracking settings (None keeps the environment's); returns the URI in force."""
    if uri:
        os.environ["MLFLOW_TRACKING_URI"] = uri
    if artifact_location:
        os.environ["PALIMPSEST_MLFLOW_ARTIFACTS"] = artifact_location
    return tracking_uri()


def check(uri: str | None = None, timeout_s: float = 5.0) -> None:
    """Fail fast, naming the server, when a tracking server does not answer its health check
    (a local store needs no check)."""
    uri = uri or tracking_uri()
    if not uri.startswith(("http://", "https://")):
        return
    try:
        with urllib.request.urlopen(uri.rstrip("/") + "/health", timeout=timeout_s) as r:
            if r.status == 200:
                return
            reason = f"HTTP {r.status}"
    except urllib.error.HTTPError as e:
        reason = f"HTTP {e.code}"
    except (urllib.error.URLError, OSError) as e:
        reason = str(getattr(e, "reason", e))
    raise PalimpsestError(f"cannot reach the MLflow tracking server at {uri}: {reason}")


def _flat(prefix: str, value: Any, out: dict[str, float]) -> None:
    if isinstance(value, dict):
        for k, v in value.items():
            _flat(f"{prefix}.{k}" if prefix else str(k), v, out)
    elif isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        out[prefix.replace("+", "plus")] = float(value)


def log_replay(summary: dict, out_dir: Path) -> str:
    """One parent run per replay, one child run per policy; returns the parent run id."""
    mlflow, exp = mlflow_experiment(EXPERIMENT_REPLAY)
    data = summary["data"]
    with mlflow.start_run(experiment_id=exp, run_name=f"replay-{Path(data['file']).stem}-{summary['budget']}") as run:
        mlflow.log_params({"data.file": data["file"], "data.sha256": data["sha256"], "budget": summary["budget"],
                           "concat": summary.get("concat", False), "embedder": summary["embedder"],
                           "tokenizer": summary["tokenizer"], "policies": ",".join(summary["policies"])})
        for label, cfg in summary["policy_configs"].items():
            mlflow.log_dict(cfg, f"policies/{label}.json")
            with mlflow.start_run(experiment_id=exp, run_name=label, nested=True):
                mlflow.log_params({"policy": label, **{f"config.{k}": v for k, v in cfg.items()},
                                   "budget": summary["budget"], "data.sha256": data["sha256"]})
                metrics: dict[str, float] = {}
                _flat("", {k: v for k, v in summary["policies"][label].items() if k != "recall_by_window"}, metrics)
                mlflow.log_metrics(metrics)
        for name in ("summary.json", "summary.md", "steps.parquet", "report.md"):
            if (out_dir / name).is_file():
                mlflow.log_artifact(str(out_dir / name))
        for png in sorted(out_dir.glob("*.png")):
            mlflow.log_artifact(str(png), artifact_path="plots")
        return run.info.run_id


def log_actions(result: dict, configs: dict[str, dict]) -> str:
    """One run per `eval-actions`: the parameters, every policy's figures as metrics, the result as JSON."""
    mlflow, exp = mlflow_experiment(EXPERIMENT_ACTIONS)
    with mlflow.start_run(experiment_id=exp,
                          run_name=f"eval-actions-{'+'.join(Path(f).stem for f in result['data']['file'].split(', '))}-"
                                   f"{result['budget']}") as run:
        mlflow.log_params({"data.file": result["data"]["file"], "data.sha256": result["data"]["sha256"],
                           "budget": result["budget"], "reference": result["reference"],
                           "policies": ",".join(result["policies"]), "held_out_only": result["held_out_only"]})
        metrics: dict[str, float] = {}
        _flat("", {"policies": result["policies"], "gap_closed": result["gap_closed"],
                   "paired": (result.get("paired") or {}).get("controls", {})}, metrics)
        mlflow.log_metrics(metrics)
        if result.get("paired"):  # eval-memory's verdicts, as tags beside their p-values
            for control, t in result["paired"]["controls"].items():
                mlflow.set_tag(f"paired.{control}".replace("+", "plus"), t["verdict"])
        mlflow.log_dict(result, "eval_actions.json")
        for label, cfg in configs.items():
            mlflow.log_dict(cfg, f"policies/{label}.json")
        return run.info.run_id


def log_rollout(candidate: str, control: str, subject: str, decision: dict, policy: dict, memory: str | None,
                experiment: str) -> str:
    """One run per rollout decision, beside what it concerns: the candidate's policy config and its memory bundle's
    record as artifacts, the evidence's figures as metrics; a registered memory version is tagged with its stage."""
    mlflow, exp = mlflow_experiment(experiment)
    with tracking_errors(), mlflow.start_run(experiment_id=exp,
                                             run_name=f"rollout-{candidate}-{decision.get('to')}") as run:
        mlflow.log_params({"candidate": candidate, "control": control, "subject": subject[:500],
                           "decision": decision.get("decision"), "from": decision.get("from"),
                           "stage": decision.get("to"), "memory.model": memory or "none"})
        metrics: dict[str, float] = {}
        _flat("", {k: v for k, v in decision.items() if k not in ("policy",)}, metrics)
        mlflow.log_metrics(metrics)
        mlflow.log_dict(decision, "rollout_decision.json")
        mlflow.log_dict(policy, "policy.json")
        if memory:
            name, _, version = memory.removeprefix("models:/").partition("/")
            try:  # an unreadable bundle or an unknown version still gets its decision logged
                mlflow.log_dict(read_bundle(memory).to_json(), "memory_bundle.json")
                if memory.startswith("models:/") and version.isdigit():
                    client = mlflow.MlflowClient()
                    client.set_model_version_tag(name, version, "palimpsest.rollout.stage", str(decision.get("to")))
                    client.set_model_version_tag(name, version, "palimpsest.rollout.run", run.info.run_id)
            except Exception as e:
                mlflow.set_tag("memory_bundle.error", str(e)[:500])
        return run.info.run_id
