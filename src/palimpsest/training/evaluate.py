"""`palimpsest eval-memory`: how much of the summary's loss does the memory recover?

Over Stage II boundaries of a trajectory file, against the teacher (the frozen actor seeing the
whole history), per target token:
  (a) summary          — the student sees the summary only,
  (b) summary_plus_text — the summary plus the most recent history text, cut to as many positions as
                          the memory uses (equal-budget extra text),
  (c) summary_memory   — the summary plus the memory's soft tokens.
Reported: mean KL(student || teacher), top-1 agreement with the teacher, the positions each student
input uses, and gap_closed = 1 - KL(c) / KL(a).
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from palimpsest.models.actor import FrozenActor
from palimpsest.models.memory import MemoryNetwork
from palimpsest.training.losses import student_logits, teacher_pass

VARIANTS = ("summary", "summary_plus_text", "summary_memory")


def _kl_top1(q_logits: torch.Tensor, p_logits: torch.Tensor) -> tuple[float, float]:
    log_q, log_p = F.log_softmax(q_logits.float(), -1), F.log_softmax(p_logits.float(), -1)
    kl = (log_q.exp() * (log_q - log_p)).sum(-1)  # (R,)
    top1 = (q_logits.argmax(-1) == p_logits.argmax(-1)).float()
    return float(kl.mean()), float(top1.mean())


@torch.inference_mode()
def evaluate_boundary(memory: MemoryNetwork, actor: FrozenActor, sample: dict) -> dict[str, Any]:
    feats, p = teacher_pass(actor, sample, memory.cfg.feature_layer)
    summary, bridge, target, history = sample["summary"], sample["bridge"], sample["target"], sample["history"]
    mem = memory(feats, actor.embed(summary) if summary.numel() else None)  # (M, d)
    k = mem.shape[0]
    recent = history[: max(history.numel() - bridge.numel(), 1)]  # the history text before the assistant prompt
    prefixes = {
        "summary": torch.cat([actor.embed(summary), actor.embed(bridge)]),
        "summary_plus_text": torch.cat([actor.embed(summary), actor.embed(recent[-k:]), actor.embed(bridge)]),
        "summary_memory": torch.cat([actor.embed(summary), mem, actor.embed(bridge)]),
    }
    out: dict[str, Any] = {"teacher_positions": int(history.numel())}
    for name, prefix in prefixes.items():
        kl, top1 = _kl_top1(student_logits(actor, prefix, target), p)
        out[name] = {"kl": kl, "top1": top1, "positions": int(prefix.shape[0])}
    return out


def evaluate(memory: MemoryNetwork, actor: FrozenActor, rows: list[dict], max_boundaries: int | None = None,
             seed: int = 0) -> dict[str, Any]:
    """Aggregate over boundaries (a deterministic sample of ``max_boundaries`` when given)."""
    if not rows:
        raise ValueError("no boundaries to evaluate")
    if max_boundaries is not None and len(rows) > max_boundaries:
        rows = random.Random(seed).sample(rows, max_boundaries)
    per = []
    for r in rows:
        sample = {k: torch.tensor(r[k], dtype=torch.long) for k in ("history", "summary", "bridge", "target")}
        per.append(evaluate_boundary(memory, actor, sample))
    n = len(per)
    mean = {v: {m: sum(x[v][m] for x in per) / n for m in ("kl", "top1", "positions")} for v in VARIANTS}
    kl_a = mean["summary"]["kl"]
    return {
        "boundaries": n,
        "positions": {"teacher": sum(x["teacher_positions"] for x in per) / n, **{v: mean[v]["positions"] for v in VARIANTS}},
        "kl": {v: round(mean[v]["kl"], 5) for v in VARIANTS},
        "top1": {v: round(mean[v]["top1"], 4) for v in VARIANTS},
        "gap_closed": round(1.0 - mean["summary_memory"]["kl"] / kl_a, 4) if kl_a > 0 else None,
        "trajectories": sorted({r["trajectory"] for r in rows}),
    }


def boundaries_from_file(data: Path, tokenizer, max_history_tokens: int, max_observation_chars: int,
                         max_target_tokens: int, split: str = "all", val_fraction: float = 0.2) -> list[dict]:
    from palimpsest.pipelines.remory_data import DataConfig, stage2_samples
    from palimpsest.pipelines.trajectories import read_trajectories

    cfg = DataConfig(max_history_tokens=max_history_tokens, max_observation_chars=max_observation_chars,
                     max_target_tokens=max_target_tokens, val_fraction=val_fraction)
    rows = [r for t in read_trajectories(data).trajectories for r in stage2_samples(t, tokenizer, cfg)]
    return rows if split == "all" else [r for r in rows if r["split"] == split]
