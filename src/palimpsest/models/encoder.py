"""The serving hook: a trained memory network beside the frozen actor turns (history, summary) into the soft span.

No Ray inside; the serving layer wraps it in a deployment. Models are loaded by reference (a bundle directory
or an MLflow model URI) through ``models.registry``, which owns the bundle format.
"""

from __future__ import annotations

from pathlib import Path

import torch

from palimpsest.models.actor import FrozenActor
from palimpsest.models.memory_network import MemoryNetwork
from palimpsest.models.registry import load_memory
from palimpsest.platform.types import ConfigError


class MemoryEncoder:
    """(history ids, summary ids) -> soft span (S, d_actor) in the actor's input-embedding space. The network runs
    the actor's own layers (LoRA beside them), so it is built beside the actor that serves. Where the network's
    span gate is closed the span is empty (0, d): the actor sees the text alone (``MemoryNetwork.sent``)."""

    def __init__(self, memory: MemoryNetwork, actor: FrozenActor):
        if memory.d != actor.hidden_size:
            raise ConfigError(f"memory was built for hidden size {memory.d}, the actor has {actor.hidden_size}")
        self.memory = memory.eval()
        self.actor = actor

    @classmethod
    def load(cls, ref: str | Path, actor: FrozenActor) -> "MemoryEncoder":
        return cls(load_memory(ref, actor), actor)

    @torch.inference_mode()
    def encode(self, history: torch.Tensor, summary: torch.Tensor | None = None) -> torch.Tensor:
        if history.dim() != 1 or history.numel() == 0:
            raise ValueError("history must be a non-empty 1-D tensor of token ids")
        summary_embeds = self.actor.embed(summary) if summary is not None and summary.numel() else None
        return self.memory.sent(self.memory(history.to(self.actor.device), summary_embeds))

    def slots_for(self, positions: int) -> int:
        return self.memory.slots_for(positions)
