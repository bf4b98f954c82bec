"""Where models are found and how a memory model is kept: the actor's folder, the MLflow tracking store (one
session helper for every run Palimpsest logs), the memory bundle format, and its registration.

One module owns these so that training, serving, evaluation and the demo resolve a name, read a bundle and
open a tracking run the same way. Nothing here imports from ``pipelines`` or ``serving``, and torch and MLflow
are imported only inside the functions that need them.

A memory **bundle** is a directory with ``memory.json`` (the network's config, the actor's embedding norm,
the actor, the policy the samples were compiled with and the data split) and ``memory.pt`` (full weights):
loadable without DeepSpeed. A **model reference** is a bundle directory or an MLflow model URI
(``models:/palimpsest-memory/latest``, ``runs:/...``).
"""

from __future__ import annotations

import json
import os
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from palimpsest.models.assets import smollm2_dir
from palimpsest.platform.types import ConfigError, PalimpsestError

if TYPE_CHECKING:
    from palimpsest.models.memory import MemoryNetwork

REGISTERED_MODEL = "palimpsest-memory"  # the MLflow registry name training registers under
BUNDLE_WEIGHTS = "memory.pt"
BUNDLE_META = "memory.json"


# ---------------------------------------------------------------------------------------------- tracking


def tracking_uri() -> str:
    """``$MLFLOW_TRACKING_URI`` (a server in production, exported from config), else the project's local store."""
    uri = os.environ.get("MLFLOW_TRACKING_URI")
    if uri:
        return uri
    root = Path(".palimpsest").resolve()
    root.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{root / 'mlflow.db'}"


def experiment_id(mlflow, name: str) -> str:
    """The id of experiment ``name``, created (artifacts beside a local store) when it does not exist."""
    exp = mlflow.get_experiment_by_name(name)
    if exp is not None:
        return exp.experiment_id
    artifacts = os.environ.get("PALIMPSEST_MLFLOW_ARTIFACTS")
    if artifacts is None and tracking_uri().startswith("sqlite:"):
        artifacts = (Path(".palimpsest") / "mlartifacts").resolve().as_uri()
    return mlflow.create_experiment(name, artifact_location=artifacts)


@contextmanager
def tracking_errors():
    """A tracking store that cannot be used (an unreachable server, an unwritable database) inside this block is
    a clear error naming it, not a stack trace."""
    try:
        yield
    except PalimpsestError:
        raise
    except Exception as e:
        raise PalimpsestError(f"MLflow tracking at {tracking_uri()} is not usable: {e}") from None


def mlflow_experiment(name: str) -> tuple[Any, str]:
    """``(mlflow, experiment id)`` with the tracking URI set: the one way a run is opened."""
    import mlflow

    with tracking_errors():
        mlflow.set_tracking_uri(tracking_uri())
        return mlflow, experiment_id(mlflow, name)


# ---------------------------------------------------------------------------------------------- lookups


def resolve_actor_path(model: str) -> Path:
    """``smollm2`` -> the cached SmolLM2 folder (prepared offline); anything else is a local HF model folder."""
    if model == "smollm2":

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
    """What a memory model's bundle records (``memory.json``), for a bundle directory or a registered
    ``models:/NAME/VERSION`` (read from the checkpoint its run logged); {} when there is none to read."""
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


# ---------------------------------------------------------------------------------------------- the bundle


def write_bundle(out: Path, state: dict, meta: dict) -> None:
    """Write a bundle: full weights (a state dict of CPU tensors) and what they are (``meta``)."""
    import torch

    out.mkdir(parents=True, exist_ok=True)
    torch.save(state, out / BUNDLE_WEIGHTS)
    (out / BUNDLE_META).write_text(json.dumps(meta, indent=2))


def load_bundle(path: str | Path) -> "MemoryNetwork":
    """A MemoryNetwork from a bundle; a checkpoint of another architecture is a clear error."""
    import torch

    # deferred: loads torch
    from palimpsest.models.memory import MemoryConfig, MemoryNetwork

    path = Path(path)
    meta_file, weights = path / BUNDLE_META, path / BUNDLE_WEIGHTS
    if not meta_file.is_file() or not weights.is_file():
        raise ConfigError(f"{path} holds no memory bundle ({BUNDLE_META} and {BUNDLE_WEIGHTS} expected)")
    meta = json.loads(meta_file.read_text())
    try:
        net = MemoryNetwork(MemoryConfig(**meta["memory"]), embed_norm=meta["embed_norm"])
        net.load_state_dict(torch.load(weights, weights_only=True), strict=True)
    except (TypeError, ValueError, RuntimeError, KeyError) as e:
        raise ConfigError(f"{path}: the checkpoint does not match a memory network of its config: {e}") from None
    return net.eval()


def load_memory(ref: str | Path) -> "MemoryNetwork":
    """From a bundle directory or an MLflow model URI (the tracking store from $MLFLOW_TRACKING_URI, else the
    project's local one)."""
    # deferred: loads torch
    from palimpsest.models.memory import MemoryNetwork

    if Path(ref).is_dir():
        return load_bundle(ref)
    ref = str(ref)
    if not ref.startswith(("models:/", "runs:/")):
        raise ConfigError(f"{ref!r} is neither a checkpoint directory nor an MLflow model URI")
    import mlflow

    mlflow.set_tracking_uri(tracking_uri())
    try:
        net = mlflow.pytorch.load_model(ref)
    except Exception as e:
        raise ConfigError(f"cannot load memory model {ref}: {e}") from None
    if not isinstance(net, MemoryNetwork):
        raise ConfigError(f"{ref} is a {type(net).__name__}, not a memory network")
    return net.eval()


def register_bundle(bundle: Path, run_id: str, register_as: str | None, tags: dict[str, str]) -> str | None:
    """Log a bundle to its training run (``checkpoint/``, and the policy record as ``policy.json``) and, with
    ``register_as``, register it as an MLflow model with ``tags``; returns 'models:/NAME/VERSION'."""
    import mlflow

    mlflow.set_tracking_uri(tracking_uri())
    with mlflow.start_run(run_id=run_id):
        mlflow.log_artifacts(str(bundle), artifact_path="checkpoint")
        # the resolved policy config the samples were compiled with, content and hash, beside the checkpoint
        policy = json.loads((bundle / BUNDLE_META).read_text()).get("policy") or {}
        mlflow.log_dict(policy, "policy.json")
        if not register_as:
            return None
        info = mlflow.pytorch.log_model(load_bundle(bundle), name="memory", serialization_format="pickle",
                                        pip_requirements=[], registered_model_name=register_as)
    version = str(info.registered_model_version)
    client = mlflow.MlflowClient()
    for key, value in {**tags, "policy_hash": policy.get("hash")}.items():
        if value:
            client.set_model_version_tag(register_as, version, key, value)
    return f"models:/{register_as}/{version}"
