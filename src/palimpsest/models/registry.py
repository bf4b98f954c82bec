"""Where models are found and how a memory model is kept: the actor's folder, the MLflow tracking store (one
session helper for every run Palimpsest logs), the memory bundle format, and its registration.

One module owns these so that training, serving, evaluation and the demo resolve a name, read a bundle and
open a tracking run the same way. Nothing here imports from ``pipelines`` or ``serving``, and torch and MLflow
are imported only inside the functions that need them.

A memory **bundle** is a directory with ``memory.json`` (:class:`MemoryBundle`: the architecture, the network's
config, the actor, the policy the samples were compiled with and the data record) and ``memory.pt`` (the
network's state dict, its own parameters only): loadable without DeepSpeed, and never a pickled module. A
**model reference** is a bundle directory or an MLflow model URI (``models:/palimpsest-memory/latest``,
``runs:/...``); a registered version's source is its run's logged bundle.
"""

from __future__ import annotations

import json
import os
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from palimpsest.models.assets import smollm2_dir
from palimpsest.models.memory import ARCHITECTURE, MemoryConfig, MemoryRead
from palimpsest.platform.types import ConfigError, PalimpsestError

if TYPE_CHECKING:
    from palimpsest.models.memory_network import MemoryNetwork

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


@dataclass(frozen=True)
class MemoryBundle:
    """What a memory bundle records (``memory.json``), read in one place: its architecture, the network's config,
    the actor it was trained beside, the policy its samples were compiled with, and the data record (the
    build's settings, its split, the file's sha). Everything else reads a bundle through this record."""

    architecture: str
    memory: dict  # models.memory.MemoryConfig, as JSON
    actor: dict  # the training config's actor section (path, dtype) and its hidden size
    policy: dict = field(default_factory=dict)
    data: dict = field(default_factory=dict)
    name: str | None = None

    @classmethod
    def from_json(cls, meta: dict, where: str) -> "MemoryBundle":
        arch = meta.get("architecture")
        if arch != ARCHITECTURE:
            was = repr(arch) if arch else "'resampler' (a Perceiver-style network over the actor's last states)"
            raise ConfigError(f"{where}: a memory of architecture {was}; this version serves {ARCHITECTURE!r} "
                              "(the actor's own layers with LoRA): train a new one with `palimpsest train`")
        try:
            return cls(architecture=arch, memory=dict(meta["memory"]), actor=dict(meta["actor"]),
                       policy=dict(meta.get("policy") or {}), data=dict(meta.get("data") or {}), name=meta.get("name"))
        except (KeyError, TypeError, ValueError) as e:
            raise ConfigError(f"{where}: the bundle record is incomplete: {e}") from None

    def to_json(self) -> dict:
        return asdict(self)

    @property
    def budget(self) -> int | None:
        """The student's budget the memory was trained at."""
        b = self.data.get("budget")
        return int(b) if b is not None else None

    @property
    def read(self) -> MemoryRead:
        """What the memory reads, as it was trained to (its data's ``memory_tokens`` and ``max_observation_chars``;
        a field the record lacks at ``MemoryRead``'s default)."""
        given = {"max_history_tokens": self.data.get("memory_tokens"),
                 "max_field_chars": self.data.get("max_observation_chars")}
        return MemoryRead(**{k: int(v) for k, v in given.items() if v is not None})

    @property
    def max_target_tokens(self) -> int | None:
        v = self.data.get("max_target_tokens")
        return int(v) if v is not None else None

    @property
    def train_trajectories(self) -> set[str] | None:
        """The trajectories its samples came from (None: not recorded)."""
        v = self.data.get("train_trajectories")
        return set(v) if v is not None else None

    @property
    def policy_hash(self) -> str | None:
        return self.policy.get("hash")


def bundle_record(memory: dict, actor: dict, **extra) -> dict:
    """The ``memory.json`` of a bundle of this architecture: the network's config (``MemoryConfig.to_dict()``), the
    actor (``path``, ``dtype``, ``hidden_size``, ``layers``, ...) and ``extra`` (policy, data, name)."""
    return {"architecture": ARCHITECTURE, "memory": memory, "actor": actor, **extra}


def _bundle_dir(ref: str | Path) -> Path:
    """A model reference as a local bundle directory: the directory itself, or a registered version's files
    (``models:/NAME/VERSION``, ``runs:/ID/checkpoint``) downloaded from the tracking store."""
    if Path(str(ref)).is_dir():
        return Path(str(ref))
    ref = str(ref)
    if not ref.startswith(("models:/", "runs:/")):
        raise ConfigError(f"{ref!r} is neither a memory bundle directory nor an MLflow model URI")
    import mlflow

    mlflow.set_tracking_uri(tracking_uri())
    try:
        if ref.startswith("models:/"):
            name, version = ref[len("models:/"):].split("/", 1)
            client = mlflow.MlflowClient()
            if version == "latest":
                version = str(max(int(v.version) for v in client.search_model_versions(f"name='{name}'")))
            mv = client.get_model_version(name, version)
            path = mlflow.artifacts.download_artifacts(artifact_uri=mv.source)
        else:
            path = mlflow.artifacts.download_artifacts(artifact_uri=ref)
    except Exception as e:
        raise ConfigError(f"cannot load memory model {ref}: {e}") from None
    return Path(path)


def read_bundle(ref: str | Path) -> MemoryBundle:
    """The record of a memory bundle (a directory or a registered model); a bundle of another architecture, or
    none at all, is a ConfigError naming it."""
    path = _bundle_dir(ref)
    meta_file = path / BUNDLE_META
    if not meta_file.is_file() or not (path / BUNDLE_WEIGHTS).is_file():
        if (path / "MLmodel").is_file():  # a registration of the old architecture: a pickled module
            raise ConfigError(f"{ref}: a pickled memory model of architecture 'resampler'; this version serves "
                              f"{ARCHITECTURE!r} from bundles: train a new one with `palimpsest train`")
        raise ConfigError(f"{ref} holds no memory bundle ({BUNDLE_META} and {BUNDLE_WEIGHTS} expected)")
    return MemoryBundle.from_json(json.loads(meta_file.read_text()), str(ref))


def memory_bundle(ref: str | None) -> MemoryBundle | None:
    """The record of ``ref``, or None when no memory is configured."""
    return read_bundle(ref) if ref else None


# ---------------------------------------------------------------------------------------------- the bundle


def write_bundle(out: Path, state: dict, meta: dict) -> None:
    """Write a bundle: full weights (a state dict of CPU tensors) and what they are (``meta``)."""
    import torch

    out.mkdir(parents=True, exist_ok=True)
    torch.save(state, out / BUNDLE_WEIGHTS)
    (out / BUNDLE_META).write_text(json.dumps(meta, indent=2))


def load_memory(ref: str | Path, actor) -> "MemoryNetwork":
    """The memory network of a bundle directory or an MLflow model URI, beside ``actor`` (a ``FrozenActor``): the
    network runs the actor's own layers, so the actor must be the one it was trained with (its hidden size and
    depth, and the fingerprint of its embeddings where the bundle records it: ``FrozenActor.differs_from``). A
    bundle of another architecture is refused by name."""
    import torch

    # deferred: loads torch
    from palimpsest.models.memory_network import MemoryNetwork

    path = _bundle_dir(ref)
    bundle = read_bundle(path)
    want = bundle.actor
    have = {"hidden_size": actor.hidden_size, "layers": int(actor.model.config.num_hidden_layers)}
    for key, value in have.items():
        if want.get(key) is not None and int(want[key]) != value:
            raise ConfigError(f"{ref}: the memory was trained beside an actor with {key} {want[key]}; "
                              f"this actor has {value}")
    other = actor.differs_from(want)  # the same shape is not the same actor: its weights are checked by name
    if other:
        where = want.get("path") or "path not recorded"
        raise ConfigError(f"{ref}: the memory was trained beside another actor ({where}): {other}. A memory "
                          "reads and writes one actor's own states: serve it beside that actor, or train one "
                          "for this actor")
    try:
        # a bundle recorded before the span gate existed was trained without one
        net = MemoryNetwork(MemoryConfig(**{"span_gate": False, **bundle.memory}), actor)
        net.load_state_dict(torch.load(path / BUNDLE_WEIGHTS, weights_only=True, map_location="cpu"), strict=True)
    except (TypeError, ValueError, RuntimeError) as e:
        raise ConfigError(f"{ref}: the checkpoint does not match a memory network of its config: {e}") from None
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
    # the bundle as it is (state dict + record), no pickled module: the version's source is the logged checkpoint
    return register_version(register_as, run_id, "checkpoint",
                            {**tags, "policy_hash": policy.get("hash"), "architecture": ARCHITECTURE})


def register_version(name: str, run_id: str, artifact: str, tags: dict) -> str:
    """A new version of registered model ``name`` (created on first use) from run ``run_id``'s ``artifact``
    folder, tagged with every non-empty tag; returns its ``models:/`` URI."""
    import mlflow  # heavy: the registry's callers import it only when they register

    client = mlflow.MlflowClient()
    try:
        client.create_registered_model(name)
    except mlflow.exceptions.MlflowException as e:
        if "RESOURCE_ALREADY_EXISTS" not in str(e.error_code):
            raise
    run = client.get_run(run_id)
    version = str(client.create_model_version(name, f"{run.info.artifact_uri}/{artifact}", run_id=run_id).version)
    for key, value in tags.items():
        if value:
            client.set_model_version_tag(name, version, key, str(value))
    return f"models:/{name}/{version}"
