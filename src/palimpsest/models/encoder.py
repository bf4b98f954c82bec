"""The serving hook: load a trained memory network and turn (history, summary) into the soft span.

No Ray inside; the serving layer wraps it in a deployment. A model reference is either an MLflow
model URI (``models:/palimpsest-memory/latest``, ``runs:/...``) or a training checkpoint directory
holding the exported bundle (``memory.json`` + ``memory.pt``).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from palimpsest.models.actor import FrozenActor
from palimpsest.models.memory import MemoryConfig, MemoryNetwork
from palimpsest.models.registry import REGISTERED_MODEL  # noqa: F401  (re-exported)
from palimpsest.platform.types import ConfigError

BUNDLE_WEIGHTS = "memory.pt"
BUNDLE_META = "memory.json"


def load_bundle(path: str | Path) -> MemoryNetwork:
    """A MemoryNetwork from an exported bundle; a checkpoint of another architecture is a clear error."""
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


def load_memory(ref: str | Path) -> MemoryNetwork:
    """From a checkpoint directory or an MLflow model URI (the tracking store from $MLFLOW_TRACKING_URI,
    else the project's local one)."""
    if Path(ref).is_dir():
        return load_bundle(ref)
    ref = str(ref)
    if not ref.startswith(("models:/", "runs:/")):
        raise ConfigError(f"{ref!r} is neither a checkpoint directory nor an MLflow model URI")
    import mlflow

    from palimpsest.models.registry import tracking_uri

    mlflow.set_tracking_uri(tracking_uri())
    try:
        net = mlflow.pytorch.load_model(ref)
    except Exception as e:
        raise ConfigError(f"cannot load memory model {ref}: {e}") from None
    if not isinstance(net, MemoryNetwork):
        raise ConfigError(f"{ref} is a {type(net).__name__}, not a memory network")
    return net.eval()


class MemoryEncoder:
    """(history ids, summary ids) -> soft span (S, d_actor) in the actor's input-embedding space."""

    def __init__(self, memory: MemoryNetwork, actor: FrozenActor):
        if memory.cfg.d_actor != actor.hidden_size:
            raise ConfigError(f"memory was trained for hidden size {memory.cfg.d_actor}, the actor has {actor.hidden_size}")
        self.memory = memory.eval()
        self.actor = actor

    @classmethod
    def load(cls, ref: str | Path, actor: FrozenActor) -> "MemoryEncoder":
        return cls(load_memory(ref), actor)

    @torch.inference_mode()
    def encode(self, history: torch.Tensor, summary: torch.Tensor | None = None) -> torch.Tensor:
        if history.dim() != 1 or history.numel() == 0:
            raise ValueError("history must be a non-empty 1-D tensor of token ids")
        feats = self.actor.hidden_states(history, self.memory.cfg.feature_layer)
        summary_embeds = self.actor.embed(summary) if summary is not None and summary.numel() else None
        return self.memory(feats, summary_embeds)

    def slots_for(self, positions: int) -> int:
        return self.memory.slots_for(positions)
