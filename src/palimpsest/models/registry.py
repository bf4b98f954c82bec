"""Where models are found: the actor's folder, the MLflow tracking store, and the registered memory network.

One module owns these lookups so that training, serving, evaluation and the demo resolve a name the same
way (nothing here imports from ``pipelines``; the tracking helpers there build on this one).
"""

from __future__ import annotations

import os
from pathlib import Path

from palimpsest.platform.types import ConfigError

REGISTERED_MODEL = "palimpsest-memory"  # the MLflow registry name training registers under


def tracking_uri() -> str:
    """``$MLFLOW_TRACKING_URI`` (a server in production, exported from config), else the project's local store."""
    uri = os.environ.get("MLFLOW_TRACKING_URI")
    if uri:
        return uri
    root = Path(".palimpsest").resolve()
    root.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{root / 'mlflow.db'}"


def resolve_actor_path(model: str) -> Path:
    """``smollm2`` -> the cached SmolLM2 folder (prepared offline); anything else is a local HF model folder."""
    if model == "smollm2":
        from palimpsest.models.assets import smollm2_dir

        return smollm2_dir()
    path = Path(model).expanduser().resolve()
    if not (path / "config.json").is_file():
        raise ConfigError(f"actor model {model!r}: {path} holds no HF model (config.json missing)")
    return path


def resolve_memory_ref(model: str | None) -> str | None:
    """``auto`` -> the latest registered ``palimpsest-memory`` version if any, else None (memory off)."""
    if model is None or model == "" or model == "off":
        return None
    if model != "auto":
        return model
    try:
        import mlflow

        mlflow.set_tracking_uri(tracking_uri())
        versions = mlflow.MlflowClient().search_model_versions(f"name='{REGISTERED_MODEL}'")
    except Exception:
        return None
    if not versions:
        return None
    latest = max(versions, key=lambda v: int(v.version))
    return f"models:/{REGISTERED_MODEL}/{latest.version}"


def memory_meta(ref: str | None) -> dict:
    """What a memory model's bundle records (``memory.json``: its config, actor, the policy its samples were
    compiled with and its data split), for a bundle directory or a registered ``models:/NAME/VERSION``
    (read from the checkpoint its run logged); {} when there is none to read."""
    import json

    from palimpsest.models.encoder import BUNDLE_META

    if not ref:
        return {}
    local = Path(str(ref), BUNDLE_META)
    if local.is_file():
        return json.loads(local.read_text())
    if not str(ref).startswith("models:/"):
        return {}
    try:
        import mlflow

        name, version = str(ref)[len("models:/"):].split("/", 1)
        mlflow.set_tracking_uri(tracking_uri())
        client = mlflow.MlflowClient()
        if version == "latest":
            version = str(max(int(v.version) for v in client.search_model_versions(f"name='{name}'")))
        run_id = client.get_model_version(name, version).run_id
        path = mlflow.artifacts.download_artifacts(run_id=run_id, artifact_path=f"checkpoint/{BUNDLE_META}")
        return json.loads(Path(path).read_text())
    except Exception:  # an older registration without a logged checkpoint, or no store: nothing recorded
        return {}
