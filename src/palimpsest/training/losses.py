"""REMORY's two losses, through the frozen actor. Gradients reach only the memory network.

Stage I (reconstruction): the memory of a text span, followed by a "repeat" instruction, must let the
actor reproduce the span: cross-entropy on the span's tokens.

Stage II (summary-conditioned continuation): the teacher sees the whole history, the student sees the
summary and the memory; both predict the trajectory's real next assistant response. Loss: reverse KL
sum_j w_j KL(q_j || p_j) over the full vocabulary, q = student, p = teacher, w_j gently favouring the
first response tokens (w_j proportional to 1 / (1 + decay * j), summing to 1).
"""

from __future__ import annotations

from typing import TypedDict

import torch
import torch.nn.functional as F

from palimpsest.models.actor import FrozenActor
from palimpsest.models.memory import MemoryNetwork


class StageISample(TypedDict):
    span: torch.Tensor  # (T,) ids of the text to remember and reproduce
    instruction: torch.Tensor  # (I,) ids of the "repeat the text" instruction


class StageIISample(TypedDict, total=False):
    history: torch.Tensor  # (H,) ids of the history in the actor's chat format, ending with the assistant prompt
    summary: torch.Tensor  # (S,) ids of the same conversation with the history replaced by its summary
    bridge: torch.Tensor  # (G,) ids after the memory (the assistant prompt); optional
    target: torch.Tensor  # (R,) ids of the real next assistant response


def position_weights(n: int, decay: float = 0.05, device=None) -> torch.Tensor:
    w = 1.0 / (1.0 + decay * torch.arange(n, dtype=torch.float32, device=device))
    return w / w.sum()


def reverse_kl(student_logits: torch.Tensor, teacher_logits: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """sum_j w_j KL(q_j || p_j) for logits (R, V); the teacher side carries no gradient."""
    log_q = F.log_softmax(student_logits.float(), dim=-1)  # (R, V)
    log_p = F.log_softmax(teacher_logits.detach().float(), dim=-1)
    kl = (log_q.exp() * (log_q - log_p)).sum(-1)  # (R,)
    return (weights * kl).sum()


def memory_of(memnet: MemoryNetwork, actor: FrozenActor, history: torch.Tensor,
              summary: torch.Tensor | None = None, min_passes: int = 0) -> torch.Tensor:
    """The soft span (M, d) for a history (ids), optionally reading the summary's embeddings.
    ``memnet`` may be wrapped (a DeepSpeed engine or DDP): calling the wrapper keeps its hooks."""
    cfg = memnet.module.cfg if hasattr(memnet, "module") else memnet.cfg
    feats = actor.hidden_states(history, cfg.feature_layer)  # (H, d), no grad: the actor is frozen
    return memnet(feats, actor.embed(summary) if summary is not None and summary.numel() else None, min_passes)


def stage1_loss(memnet: MemoryNetwork, actor: FrozenActor, sample: StageISample, min_passes: int = 0) -> torch.Tensor:
    span, instr = sample["span"], sample["instruction"]
    mem = memory_of(memnet, actor, span, None, min_passes)  # (M, d)
    embeds = torch.cat([mem, actor.embed(instr), actor.embed(span)])[None]  # (1, M + I + T, d)
    t = span.shape[0]
    logits = actor(inputs_embeds=embeds, last=t + 1)[0, :t]  # (T, V): the positions that predict the span
    return F.cross_entropy(logits.float(), span)


@torch.no_grad()
def teacher_pass(actor: FrozenActor, sample: StageIISample, layer: int = -1) -> tuple[torch.Tensor, torch.Tensor]:
    """One forward over [history; target]: the history's hidden states (H, d) at ``layer`` (what the
    memory reads; causal, so the target does not change them) and the teacher's logits (R, V)."""
    hist, target = sample["history"], sample["target"]
    r = target.shape[0]
    out = actor.model(input_ids=torch.cat([hist, target])[None], output_hidden_states=True, use_cache=False,
                      logits_to_keep=r + 1)  # only the positions that predict the target (+ the last one)
    return out.hidden_states[layer][0, : hist.shape[0]], out.logits[0, :r]


def teacher_logits(actor: FrozenActor, sample: StageIISample) -> torch.Tensor:
    """(R, V) the teacher's logits on the target tokens, seeing the whole history."""
    return teacher_pass(actor, sample)[1]


def student_logits(actor: FrozenActor, prefix_embeds: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """(R, V) logits on the target tokens for any student input ``prefix_embeds`` (P, d)."""
    embeds = torch.cat([prefix_embeds, actor.embed(target)])[None]
    r = target.shape[0]
    return actor(inputs_embeds=embeds, last=r + 1)[0, :r]


def stage2_loss(memnet: MemoryNetwork, actor: FrozenActor, sample: StageIISample, decay: float = 0.05,
                min_passes: int = 0) -> torch.Tensor:
    """Reverse KL of the student [summary; memory; bridge] against the teacher [history]. One actor pass
    gives both the teacher's logits and the history features the memory reads."""
    cfg = memnet.module.cfg if hasattr(memnet, "module") else memnet.cfg
    feats, p = teacher_pass(actor, sample, cfg.feature_layer)
    summary = sample["summary"]
    mem = memnet(feats, actor.embed(summary) if summary.numel() else None, min_passes)
    parts = [actor.embed(sample["summary"]), mem]  # the memory sits right after the summary
    if sample.get("bridge") is not None and sample["bridge"].numel():
        parts.append(actor.embed(sample["bridge"]))
    prefix = torch.cat(parts)  # (S + M + G, d)
    q = student_logits(actor, prefix, sample["target"])
    return reverse_kl(q, p, position_weights(sample["target"].shape[0], decay, q.device))
