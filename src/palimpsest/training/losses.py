"""REMORY's two losses, through the frozen actor. Gradients reach only the memory network.

Stage I (reconstruction): the memory of a text span, followed by a "repeat" instruction, must let the
actor reproduce the span: cross-entropy on the span's tokens.

Stage II (summary-conditioned continuation): the teacher sees the whole history; the student sees the
served prompt of a policy at a budget, with the memory's soft span at its slot (after the summary part,
before the recent raw turns), the memory having read the steps that prompt left out. Both predict the
trajectory's real next assistant response. Loss: reverse KL sum_j w_j KL(q_j || p_j) over the full
vocabulary, q = student, p = teacher, w_j gently favouring the first response tokens (w_j proportional to
1 / (1 + decay * j), summing to 1). The rows are built by ``training.remory_data`` with serving's code.
"""

from __future__ import annotations

from typing import TypedDict

import torch
import torch.nn.functional as F

from palimpsest.models.actor import FrozenActor
from palimpsest.models.memory_network import MemoryNetwork
from palimpsest.training.teachers import coarse_kl


class StageISample(TypedDict, total=False):
    span: torch.Tensor  # (T,) ids of the text to remember and reproduce
    instruction: torch.Tensor  # (I,) ids of the "repeat the text" instruction
    source: torch.Tensor  # (S,) what the memory reads when it is not the span (the ladder's needles: a question
    # follows the memory, and the span is the answer)


class StageIISample(TypedDict, total=False):
    teacher: torch.Tensor  # (H,) the whole history as served (the full policy's prompt, up to the assistant prompt)
    memory: torch.Tensor  # (L,) what the memory reads: the raw chat of the steps the student's prompt left out
    summary: torch.Tensor  # (S,) what the memory's gated attention reads: the context before the soft slot
    context: torch.Tensor  # (C,) the student's ids before the soft slot
    bridge: torch.Tensor  # (G,) the student's ids after it (the recent raw turns, the assistant prompt)
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
              summary: torch.Tensor | None = None, min_passes: int = 0, prefix=None) -> torch.Tensor:
    """The soft span (M, d) for a history (ids), optionally reading the summary's embeddings.
    ``memnet`` may be wrapped (a DeepSpeed engine or DDP): calling the wrapper keeps its hooks. ``prefix``
    (a ``training.step.PrefixCache``) keeps the actor's prefill of a history seen before (what the memory reads)."""
    net = memnet.module if hasattr(memnet, "module") else memnet
    if prefix is not None:  # the actor is frozen: a history's keys and values never change
        src = prefix.get(prefix.key("source", history), lambda: net.source(history))
    else:
        src = net.source(history)  # no grad: the actor's prefill of each block
    return memnet(src, actor.embed(summary) if summary is not None and summary.numel() else None, min_passes)


def stage1_logits(memnet: MemoryNetwork | None, actor: FrozenActor, sample: StageISample,
                  min_passes: int = 0, source: torch.Tensor | None = None) -> torch.Tensor:
    """(T, V) the actor's logits on a span given [memory of the span; "repeat" instruction; span so far]
    (teacher forcing). ``memnet`` None: the instruction alone (the reconstruction check's no-memory baseline);
    ``source``: the ids the memory reads instead of the span (another span: the check's mismatched control)."""
    span, instr = sample["span"], sample["instruction"]
    parts = [actor.embed(instr), actor.embed(span)]
    if source is None:
        source = sample.get("source")  # a question-answer row: the memory reads a text, the span is its answer
    if memnet is not None:
        read = span if source is None else source
        parts.insert(0, memory_of(memnet, actor, read, None, min_passes))  # (M, d)
    t = span.shape[0]
    return actor(inputs_embeds=torch.cat(parts)[None], last=t + 1)[0, :t]  # the positions that predict the span


def stage1_loss(memnet: MemoryNetwork, actor: FrozenActor, sample: StageISample, min_passes: int = 0,
                continuation: float = 0.0) -> torch.Tensor:
    """Reconstruction (cross-entropy of the span after [memory; "repeat"]), mixed with weight ``continuation``
    with continuation: the memory of the span's first half, then the actor predicts the second half from it
    alone (ICAE's pretraining pairs the two objectives)."""
    recon = F.cross_entropy(stage1_logits(memnet, actor, sample, min_passes).float(), sample["span"])
    if continuation <= 0.0:
        return recon
    span = sample["span"]
    half = span.shape[0] // 2
    if half < 1:
        return recon
    head, tail = span[:half], span[half:]
    embeds = torch.cat([memory_of(memnet, actor, head, None, min_passes), actor.embed(tail)])
    t = tail.shape[0]
    logits = actor(inputs_embeds=embeds[None], last=t + 1)[0, :t]
    return (1 - continuation) * recon + continuation * F.cross_entropy(logits.float(), tail)


def batched_logits(actor: FrozenActor, prefixes: list[torch.Tensor], targets: list[torch.Tensor]) -> list[torch.Tensor]:
    """Teacher-forced logits (T_i, V) on each ``targets[i]`` after ``prefixes[i]`` (P_i, d), all rows in one actor
    pass. Rows are padded on the right: the actor is causal, so no real position reads a pad, and every row's
    logits are those of its own pass (each row starts at position 0)."""
    rows = [torch.cat([p, actor.embed(t)]) for p, t in zip(prefixes, targets)]
    starts = [int(p.shape[0]) - 1 for p in prefixes]  # the position that predicts each target's first token
    longest = max(int(r.shape[0]) for r in rows)
    embeds = torch.stack([F.pad(r, (0, 0, 0, longest - r.shape[0])) for r in rows])  # (N, L, d)
    first = min(starts)
    logits = actor(inputs_embeds=embeds, last=longest - first)  # positions first .. L-1
    return [logits[i, s - first: s - first + int(t.numel())] for i, (s, t) in enumerate(zip(starts, targets))]


def stage1_batch_loss(memnet: MemoryNetwork, actor: FrozenActor, samples: list[StageISample],
                      continuation: float = 0.0, prefix=None) -> torch.Tensor:
    """:func:`stage1_loss` of several rows in one batch, the mean of theirs: every memory read together
    (``MemoryNetwork.forward`` on a list: the spans, the question-answer rows' sources and, for continuation,
    the spans' first halves), then one actor pass for reconstruction and one for continuation
    (:func:`batched_logits`). ``prefix`` (a ``training.step.PrefixCache``) keeps each prefill for its next
    visit (the actor is frozen)."""
    if not samples:
        raise ValueError("no Stage I samples")
    net = memnet.module if hasattr(memnet, "module") else memnet

    def source(ids):
        if prefix is None:
            return net.source(ids)
        return prefix.get(prefix.key("source", ids), lambda: net.source(ids))

    reads = [s.get("source", s["span"]) for s in samples]
    cont = [i for i, s in enumerate(samples) if continuation > 0 and s["span"].shape[0] // 2 >= 1]
    heads = [samples[i]["span"][: samples[i]["span"].shape[0] // 2] for i in cont]
    mems = memnet([source(r) for r in reads + heads])  # through the wrapper: its hooks apply
    logits = batched_logits(actor, [torch.cat([m, actor.embed(s["instruction"])]) for m, s in zip(mems, samples)],
                            [s["span"] for s in samples])
    losses = [F.cross_entropy(lg.float(), s["span"]) for lg, s in zip(logits, samples)]
    if cont:  # the memory of the first half, then the second half from it alone
        tails = [samples[i]["span"][samples[i]["span"].shape[0] // 2:] for i in cont]
        for i, lg, t in zip(cont, batched_logits(actor, mems[len(samples):], tails), tails):
            losses[i] = (1 - continuation) * losses[i] + continuation * F.cross_entropy(lg.float(), t)
    return sum(losses) / len(losses)


@torch.no_grad()
def teacher_logits(actor: FrozenActor, sample: StageIISample) -> torch.Tensor:
    """(R, V) the teacher's logits on the target tokens, seeing the whole history."""
    target = sample["target"]
    r = target.shape[0]
    return actor(input_ids=torch.cat([sample["teacher"], target])[None], last=r + 1)[0, :r]


def student_logits(actor: FrozenActor, prefix_embeds: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """(R, V) logits on the target tokens for any student input ``prefix_embeds`` (P, d)."""
    embeds = torch.cat([prefix_embeds, actor.embed(target)])[None]
    r = target.shape[0]
    return actor(inputs_embeds=embeds, last=r + 1)[0, :r]


def stage2_student(memnet: MemoryNetwork, actor: FrozenActor, sample: StageIISample, min_passes: int = 0,
                   prefix=None) -> torch.Tensor:
    """(R, V) the student's logits on the target: [context; memory; bridge; target]. The context (the ids before
    the soft slot) does not depend on the memory: it is prefilled without a graph (once per row when ``prefix``
    keeps it) and the gradient runs through the soft span, the bridge and the target only."""
    return _student(actor, sample, memory_of(memnet, actor, sample["memory"], sample["summary"], min_passes, prefix),
                    prefix)


def _student(actor: FrozenActor, sample: StageIISample, mem: torch.Tensor | None, prefix=None) -> torch.Tensor:
    """(R, V) the student's logits with the soft span ``mem`` at its slot (None: the text alone)."""
    parts = [] if mem is None else [mem]  # the soft slot: after the summary part, before the recent turns
    if sample.get("bridge") is not None and sample["bridge"].numel():
        parts.append(actor.embed(sample["bridge"]))
    target = sample["target"]
    r = target.shape[0]
    context = sample["context"]
    if not parts and context.numel():  # the text alone, no bridge: the context's last id predicts the target's first
        parts, context = [actor.embed(context[-1:])], context[:-1]
    suffix = torch.cat(parts + [actor.embed(target)])  # (M + G + R, d)
    if not context.numel():
        return actor(inputs_embeds=suffix[None], last=r + 1)[0, :r]
    if prefix is not None:
        past = prefix.get(prefix.key("context", context), lambda: actor.prefill(context)[0])
        return actor.after_prefix(past, suffix, last=r + 1)[:r]
    return actor.after_prefix(actor.prefill(context)[0], suffix, last=r + 1, keep=False)[:r]  # used once


def stage2_loss(memnet: MemoryNetwork, actor: FrozenActor, sample: StageIISample, decay: float = 0.05,
                min_passes: int = 0, teacher=None, prefix=None) -> torch.Tensor:
    """Reverse KL of the student [context; memory; bridge] against the teacher [whole history]: over the full
    vocabulary from a teacher pass, or, given ``teacher`` (its cached top-k and tail mass, a
    ``training.teachers.Teacher``), over the partition {the teacher's top-k, the rest}. ``prefix``: a
    ``training.step.PrefixCache`` for rows visited again (the context's KV cache, the memory's features).

    With a span gate (``MemoryConfig.span_gate``) the loss adds what serving would cost under the gate's
    decision, g KL(memory) + (1 - g) KL(text alone), both without gradient: the gate's gradient is
    g (1 - g) (KL(memory) - KL(text alone)), so it opens where the memory beats the text alone and closes
    where it does not; the memory itself learns from its own KL whatever the gate says. The value is then
    KL(memory) plus what serving would cost (about twice the KL while the gate is closed)."""
    net = memnet.module if hasattr(memnet, "module") else memnet
    mem = memory_of(memnet, actor, sample["memory"], sample["summary"], min_passes, prefix)
    w = position_weights(sample["target"].shape[0], decay, mem.device)

    p = teacher_logits(actor, sample) if teacher is None else None  # one teacher pass for both students

    def kl_of(q: torch.Tensor) -> torch.Tensor:
        return (w * coarse_kl(q, teacher)).sum() if teacher is not None else reverse_kl(q, p, w)

    kl = kl_of(_student(actor, sample, mem, prefix))
    if not net.cfg.span_gate:
        return kl

    def alone() -> torch.Tensor:
        with torch.no_grad():
            return kl_of(_student(actor, sample, None, prefix)).detach()

    if prefix is not None:  # the text alone's KL never changes (the actor is frozen): once per row
        ids = torch.cat([sample[k] for k in ("teacher", "context", "bridge", "target") if sample.get(k) is not None])
        none = prefix.get(prefix.key("alone", ids), alone)
    else:
        none = alone()
    g = net.openness(mem)
    return kl + g * kl.detach() + (1 - g) * none
