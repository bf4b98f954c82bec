"""Where the relevance predictor is kept: its bundle (``relevance.json`` + ``relevance.npz``, numpy arrays only, never
a pickle), its registration in MLflow as ``palimpsest-relevance``, and the resolver policies are handed to find it.

A reference is a bundle directory or an MLflow model URI (``models:/palimpsest-relevance/latest``,
``models:/palimpsest-relevance/3``, ``runs:/ID/relevance``). The resolver answers None where nothing is registered
under the name (a policy then scores by the cosine) and caches what it loaded; a bundle whose features or
architecture this version does not compute is an error naming it, never a silent fallback.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

import numpy as np

from palimpsest.models.registry import register_version, tracking_uri
from palimpsest.platform.policies.relevance import ARCHITECTURE, FEATURES_VERSION, SCALARS, RelevanceHead
from palimpsest.platform.types import ConfigError

REGISTERED_RELEVANCE = "palimpsest-relevance"
RELEVANCE_META = "relevance.json"
RELEVANCE_WEIGHTS = "relevance.npz"


def write_head(out: Path, head: RelevanceHead) -> Path:
    """A bundle directory holding ``head``: its record and its arrays."""
    out.mkdir(parents=True, exist_ok=True)
    np.savez(out / RELEVANCE_WEIGHTS, **head.arrays())
    meta = {"architecture": ARCHITECTURE, "features_version": FEATURES_VERSION, "scalars": list(SCALARS),
            **head.meta}
    (out / RELEVANCE_META).write_text(json.dumps(meta, indent=2, default=str))
    return out


def read_head(path: Path, where: str | None = None) -> RelevanceHead:
    """The head of a bundle directory; one of another architecture or feature version is refused by name."""
    where = where or str(path)
    meta_file, weights = path / RELEVANCE_META, path / RELEVANCE_WEIGHTS
    if not meta_file.is_file() or not weights.is_file():
        raise ConfigError(f"{where} holds no relevance bundle ({RELEVANCE_META} and {RELEVANCE_WEIGHTS} expected)")
    meta = json.loads(meta_file.read_text())
    if meta.get("architecture") != ARCHITECTURE or str(meta.get("features_version")) != FEATURES_VERSION:
        raise ConfigError(f"{where}: a relevance head of architecture {meta.get('architecture')!r}, features "
                          f"v{meta.get('features_version')}; this version computes {ARCHITECTURE!r} features "
                          f"v{FEATURES_VERSION}: train one with `palimpsest train-relevance`")
    with np.load(weights, allow_pickle=False) as arrays:
        return RelevanceHead.from_arrays(arrays, meta)


def _download(ref: str) -> Path | None:
    """A registered version's (or a run's) bundle as a local directory; None where the name has no version."""
    import mlflow

    mlflow.set_tracking_uri(tracking_uri())
    client = mlflow.MlflowClient()
    try:
        if ref.startswith("models:/"):
            name, version = ref[len("models:/"):].split("/", 1)
            if version == "latest":
                versions = client.search_model_versions(f"name='{name}'")
                if not versions:
                    return None
                version = str(max(int(v.version) for v in versions))
            source = client.get_model_version(name, version).source
            return Path(mlflow.artifacts.download_artifacts(artifact_uri=source))
        return Path(mlflow.artifacts.download_artifacts(artifact_uri=ref))
    except Exception as e:
        if "RESOURCE_DOES_NOT_EXIST" in str(e) or "not found" in str(e).lower():
            return None
        raise ConfigError(f"cannot load relevance model {ref}: {e}") from None


def load_head(ref: str) -> RelevanceHead | None:
    """The head ``ref`` names (a bundle directory or an MLflow URI), or None where nothing is registered under it."""
    if Path(ref).is_dir():
        return read_head(Path(ref))
    if not ref.startswith(("models:/", "runs:/")):
        raise ConfigError(f"{ref!r} is neither a relevance bundle directory nor an MLflow model URI")
    path = _download(ref)
    return None if path is None else read_head(path, ref)


class RelevanceResolver:
    """``resolver(ref) -> head or None``: what ``PolicyDeps.relevance`` holds. Loads each reference once (a
    ``latest`` reference is the version registered when it was first asked for) and remembers a miss, so a turn
    never waits on the tracking store twice."""

    def __init__(self) -> None:
        self._heads: dict[str, RelevanceHead | None] = {}
        self._lock = threading.Lock()

    def __call__(self, ref: str) -> RelevanceHead | None:
        with self._lock:
            if ref not in self._heads:
                self._heads[ref] = load_head(ref)
            return self._heads[ref]


def register_head(bundle: Path, run_id: str, register_as: str | None, tags: dict[str, str]) -> str | None:
    """Log a bundle to its training run (``relevance/``) and, with ``register_as``, register it; returns
    'models:/NAME/VERSION'."""
    import mlflow

    mlflow.set_tracking_uri(tracking_uri())
    with mlflow.start_run(run_id=run_id):
        mlflow.log_artifacts(str(bundle), artifact_path="relevance")
    if not register_as:
        return None
    return register_version(register_as, run_id, "relevance",
                            {**tags, "architecture": ARCHITECTURE, "features_version": FEATURES_VERSION})


__all__ = ["REGISTERED_RELEVANCE", "RelevanceResolver", "load_head", "read_head", "register_head", "write_head"]
