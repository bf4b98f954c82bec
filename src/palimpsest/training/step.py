"""One optimisation step as a pure function: the thing Ray Train + DeepSpeed wrap, tested on its own."""

from __future__ import annotations

from typing import Sequence

import torch

from palimpsest.models.actor import FrozenActor
from palimpsest.models.memory import MemoryNetwork
from palimpsest.training.losses import stage1_loss, stage2_loss


def batch_loss(memnet: MemoryNetwork, actor: FrozenActor, batch: Sequence[dict], stage: int) -> torch.Tensor:
    """Mean loss over a micro-batch of samples (each a variable-length history: no padding waste)."""
    if stage not in (1, 2):
        raise ValueError(f"stage must be 1 or 2, got {stage}")
    if not batch:
        raise ValueError("empty batch")
    fn = stage1_loss if stage == 1 else stage2_loss
    return torch.stack([fn(memnet, actor, s) for s in batch]).mean()


def train_step(memnet: MemoryNetwork, actor: FrozenActor, optimizer: torch.optim.Optimizer, batch: Sequence[dict],
               stage: int, max_grad_norm: float | None = 1.0) -> dict[str, float]:
    memnet.train()
    optimizer.zero_grad(set_to_none=True)
    loss = batch_loss(memnet, actor, batch, stage)
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(memnet.parameters(), max_grad_norm) if max_grad_norm else None
    optimizer.step()
    return {"loss": float(loss.detach()), "grad_norm": float(norm) if norm is not None else float("nan")}


def init_stage2_from_stage1(stage2: MemoryNetwork, stage1_state: dict) -> None:
    """Stage II starts from the Stage I weights: same architecture, every tensor copied (strict)."""
    stage2.load_state_dict(stage1_state, strict=True)
