"""The memory network's one config (``MemoryConfig``) and its architecture's name; torch-free.

The training YAML's ``memory:`` section is this model, a bundle's ``memory`` record is its JSON, and the network
(``models.memory_network.MemoryNetwork``, the actor's own layers with LoRA) is built from it. What the
architecture is and why: see ``models/memory_network.py``.
"""

from __future__ import annotations

import math
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = ["ARCHITECTURE", "LORA_TARGETS", "MemoryConfig", "MemoryRead"]

ARCHITECTURE = "actor-lora/1"  # what a bundle records (models.registry); a bundle of any other is refused by name
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class MemoryRead(BaseModel):
    """What the memory reads of a compiled turn: one spec, written into a bundle by its training (its data's
    ``memory_tokens`` and ``max_observation_chars``) and read from the bundle by serving and evaluation
    (``models.registry.MemoryBundle.read``, ``platform.prompt.chat.memory_read``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_history_tokens: int = Field(1024, ge=16, description="at most this many tokens of the steps the compiled "
                                    "prompt left out")
    max_field_chars: int = Field(400, ge=64, description="each field of a step it reads is cut to this (head and "
                                 "tail)")


class MemoryConfig(BaseModel):
    """The memory network's shape. Sizes that come from the actor (width, layers, heads) are the actor's."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    block_size: int = Field(256, ge=2, le=32768, description="B: source positions per block (the seed: <= 1,024)")
    queries: int = Field(16, ge=1, description="Q: soft tokens per block")
    max_slots: int = Field(128, ge=1, description="m: most soft tokens of one history; older ones are merged")
    lora_rank: int = Field(16, ge=1, le=1024)
    lora_alpha: float = Field(32.0, gt=0, description="LoRA scale alpha / rank")
    lora_targets: tuple[str, ...] = Field(LORA_TARGETS, min_length=1, description="the projections of every layer "
                                          "that get adapters")
    summary_layers: int = Field(3, ge=0, description="layers, evenly spaced, whose input also reads the summary "
                                "through a gated cross-attention (0: the summary is not read)")
    source_view: Literal["prefix", "block"] = Field("prefix", description="a slot reads the block up to its own "
                                                    "position (prefix) or the whole block")
    slot_input: Literal["share_end", "mean"] = Field("share_end", description="what a slot's input adds its "
                                                     "per-slot vector to: the embedding of the source token at the "
                                                     "end of its share (share_end), or the mean vocabulary "
                                                     "embedding (mean: every slot of a block starts alike)")
    span_gate: bool = Field(True, description="a learned gate on the whole span, closed as the network starts: "
                            "where it is closed no soft span is sent and the actor sees the text alone (the "
                            "memory's neutral state; MemoryNetwork.openness)")
    gate_bias: float = Field(-4.0, ge=-20.0, le=20.0, description="the span gate's starting logit (-4: open with "
                             "probability 0.018; the gate sends the span at >= 0.5)")

    @model_validator(mode="after")
    def _sizes(self) -> "MemoryConfig":
        if self.queries >= self.block_size:
            raise ValueError(f"queries ({self.queries}) must be fewer than block_size ({self.block_size}): "
                             "a block must shrink into its memory")
        if self.max_slots < self.queries:
            raise ValueError(f"max_slots ({self.max_slots}) must be at least queries ({self.queries})")
        unknown = sorted(set(self.lora_targets) - set(LORA_TARGETS))
        if unknown:
            raise ValueError(f"lora_targets: unknown projections {unknown} (known: {', '.join(LORA_TARGETS)})")
        return self

    def first_level(self, positions: int) -> int:
        """Soft tokens a history of ``positions`` source positions yields before any merge: Q per block of B."""
        return math.ceil(max(positions, 1) / self.block_size) * self.queries

    def slots_for(self, positions: int) -> int:
        """How many soft tokens a history of ``positions`` source positions yields: one block of B positions gives
        Q tokens, up to ``max_slots`` (never fewer for a longer history). The one formula: the network, the data
        builder, the training config's checks and the served turn's room all ask it."""
        return min(self.first_level(positions), self.max_slots)

    def to_dict(self) -> dict:
        return self.model_dump(mode="json")
