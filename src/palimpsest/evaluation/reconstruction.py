"""Does the memory carry its input? Reconstruction of text spans from their memory, with the controls.

One span is scored three ways, teacher-forced, through the frozen actor (``losses.stage1_logits``):

- ``none``: [the "repeat" instruction; span so far]: what the actor guesses of the span with no memory;
- ``own``: [the span's memory; instruction; span so far];
- ``other``: [another span's memory; ...]: what a memory that ignores its input (a learned generic prefix)
  would also give. A memory that reads its span is below ``other`` and ``none`` in NLL.

Each gives the NLL per token and the token accuracy (the actor's argmax is the span's next token); ``own`` also
gives ``exact``: the share of spans whose first ``exact_tokens`` tokens the actor reproduces greedily from
[memory; instruction] alone. ``palimpsest eval-reconstruction`` prints :func:`evaluate`'s document; the ladder
(``benchmarks/memory_ladder.py``) and the tests call the same function.
"""

from __future__ import annotations

import random
from pathlib import Path

import torch
import torch.nn.functional as F

from palimpsest.pipelines.trajectories import read_trajectories
from palimpsest.training.losses import memory_of, stage1_logits
from palimpsest.training.remory_data import REPEAT_INSTRUCTION  # the instruction Stage I trains with


def trajectory_spans(path: Path, tokenizer, span_tokens: int = 64, n: int = 64, seed: int = 0,
                     skip: set[str] | None = None) -> list[dict]:
    """``n`` spans of exactly ``span_tokens`` ids from the actions and observations of the trajectories in
    ``path`` (a seeded sample, at most one span per step field, trajectories in ``skip`` left out). Each is a
    Stage I sample: ``span`` and ``instruction`` ids, and where it came from."""
    instruction = tokenizer.encode("\n" + REPEAT_INSTRUCTION + "\n")
    pool = []
    for traj in read_trajectories(Path(path)).trajectories:
        if skip and traj.id in skip:
            continue
        for s in traj.steps:
            for field, text in (("action", s.action), ("observation", s.observation)):
                ids = tokenizer.encode(text or "")
                if len(ids) >= span_tokens:
                    pool.append({"trajectory": traj.id, "t": s.t, "field": field, "ids": ids})
    rng = random.Random(seed)
    picked = rng.sample(pool, min(n, len(pool)))
    out = []
    for p in picked:
        start = rng.randrange(0, len(p["ids"]) - span_tokens + 1)
        out.append({"trajectory": p["trajectory"], "t": p["t"], "field": p["field"],
                    "span": p["ids"][start: start + span_tokens], "instruction": instruction})
    return out


def as_tensors(samples: list[dict], device="cpu") -> list[dict]:
    """The samples' ids as tensors on ``device``; the trajectory each came from is kept (the ``other`` control
    takes its memory from another one)."""
    return [{"span": torch.tensor(s["span"], dtype=torch.long, device=device),
             "instruction": torch.tensor(s["instruction"], dtype=torch.long, device=device),
             **({"trajectory": s["trajectory"]} if "trajectory" in s else {})} for s in samples]


def other_donors(samples: list[dict], groups: list[str] | None = None) -> list[int]:
    """For each span, the span whose memory is its ``other`` control: the next one, in order, from another
    trajectory (``groups``, else each sample's ``trajectory``; a span with neither is a group of its own). A
    memory of the same trajectory may carry what the span needs, so it would not be a control."""
    n = len(samples)
    groups = groups if groups is not None else [s.get("trajectory") for s in samples]
    if len(groups) != n:
        raise ValueError(f"{len(groups)} groups for {n} spans")
    out = []
    for i, g in enumerate(groups):
        j = next(((i + k) % n for k in range(1, n) if g is None or groups[(i + k) % n] != g), None)
        if j is None:
            raise ValueError("the 'other' control needs spans of at least 2 trajectories")
        out.append(j)
    return out


@torch.no_grad()
def greedy(actor, net, sample: dict, n: int, source: torch.Tensor | None = None) -> list[int]:
    """The first ``n`` tokens the actor writes greedily after [memory of ``source`` (default: the span);
    instruction]."""
    model = actor.model
    mem = memory_of(net, actor, sample.get("source", sample["span"]) if source is None else source)
    embeds = torch.cat([mem, actor.embed(sample["instruction"])])[None]
    out = model(inputs_embeds=embeds, use_cache=True, logits_to_keep=1)
    tokens = []
    for _ in range(n):
        nxt = int(out.logits[0, -1].argmax())
        tokens.append(nxt)
        out = model(input_ids=torch.tensor([[nxt]], device=actor.device), past_key_values=out.past_key_values,
                    use_cache=True, logits_to_keep=1)
    return tokens


@torch.no_grad()
def score(actor, net, samples: list[dict], mode: str) -> dict:
    """NLL per token and token accuracy of ``samples`` (tensors) under ``mode``: none, own or other (the memory
    of a span of another trajectory, :func:`other_donors`; never the span's own)."""
    nll, hits, tokens = span_scores(actor, net, samples, mode)
    total = sum(tokens)
    return {"nll": sum(nll) / max(total, 1), "acc": sum(hits) / max(total, 1)}


@torch.no_grad()
def span_scores(actor, net, samples: list[dict], mode: str,
                groups: list[str] | None = None) -> tuple[list[float], list[int], list[int]]:
    """Per span of ``samples``: the summed NLL, the hits and the tokens under ``mode`` (see :func:`score`;
    ``other``: the memory of a span of another trajectory, :func:`other_donors`)."""
    if mode not in ("none", "own", "other"):
        raise ValueError(f"mode must be none, own or other, got {mode!r}")
    if mode == "other" and len(samples) < 2:
        raise ValueError("the 'other' control needs at least 2 spans")
    donors = other_donors(samples, groups) if mode == "other" else range(len(samples))
    nll, hits, tokens = [], [], []
    for i, s in enumerate(samples):
        donor = samples[donors[i]]
        source = donor.get("source", donor["span"]) if mode == "other" else None
        logits = stage1_logits(None if mode == "none" else net, actor, s, source=source).float()
        nll.append(float(F.cross_entropy(logits, s["span"], reduction="sum")))
        hits.append(int((logits.argmax(-1) == s["span"]).sum()))
        tokens.append(int(s["span"].numel()))
    return nll, hits, tokens


def paired_difference(a: list[float], b: list[float], tokens: list[int], groups: list[str] | None = None,
                      resamples: int = 2000, seed: int = 0) -> dict:
    """The difference in NLL per token between two scorings of the same spans (``a`` - ``b``, summed NLL per
    span): its value (equal to the difference of the two documents' ``nll``), a 95% percentile bootstrap
    interval with spans resampled (spans of one trajectory are not independent, so it likely understates the
    uncertainty), and, given ``groups`` (each span's trajectory), the difference within each group and how
    many spans each holds."""
    if not (len(a) == len(b) == len(tokens)) or not a:
        raise ValueError("the paired scores need the same, non-empty spans")
    if resamples < 1:
        raise ValueError(f"resamples must be at least 1, got {resamples}")
    n = len(a)
    rng = random.Random(seed)
    stats = []
    for _ in range(resamples):
        idx = [rng.randrange(n) for _ in range(n)]
        stats.append(sum(a[i] - b[i] for i in idx) / max(sum(tokens[i] for i in idx), 1))
    stats.sort()
    lo, hi = round(0.025 * (resamples - 1)), round(0.975 * (resamples - 1))  # as many resamples beyond each end
    doc = {"value": sum(x - y for x, y in zip(a, b)) / max(sum(tokens), 1), "ci95": [stats[lo], stats[hi]],
           "resampled": "spans", "resamples": resamples}
    if groups is not None:
        if len(groups) != n:
            raise ValueError(f"{len(groups)} groups for {n} spans")
        members = {g: [i for i in range(n) if groups[i] == g] for g in dict.fromkeys(groups)}
        doc["by_trajectory"] = {g: sum(a[i] - b[i] for i in ix) / max(sum(tokens[i] for i in ix), 1)
                                for g, ix in members.items()}
        doc["spans_by_trajectory"] = {g: len(ix) for g, ix in members.items()}
    return doc


@torch.no_grad()
def slot_stats(actor, net, samples: list[dict]) -> dict:
    """The ladder's rung 0, at any point of training: how alike the soft tokens of one memory are (mean pairwise
    cosine; near copies read ~1), how much reversing the source moves the memory (cosine of each soft token to
    its counterpart; a memory that ignores its input reads 1.0), and how alike the memories of two spans are."""
    pair, rev, other = [], [], []
    mems = [memory_of(net, actor, s["span"]) for s in samples]
    for i, (s, m) in enumerate(zip(samples, mems)):
        u = F.normalize(m.float(), dim=-1)
        c = u @ u.T
        n = c.shape[0]
        pair.append(float((c.sum() - n) / max(n * n - n, 1)))
        r = memory_of(net, actor, s["span"].flip(0))
        rev.append(float(F.cosine_similarity(m.float(), r.float()).mean()))
        other.append(float(F.cosine_similarity(m.float(), mems[(i + 1) % len(mems)].float()).mean()))
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    return {"pairwise_cosine": mean(pair), "pairwise_cosine_max": max(pair), "reversed_cosine": mean(rev),
            "other_span_cosine": mean(other), "spans": len(samples)}


def rung0_passes(stats: dict) -> bool:
    """Rung 0: the slots of one memory differ (mean pairwise cosine < 0.9) and reversing the source changes the
    memory (cosine < 0.95)."""
    return stats["pairwise_cosine"] < 0.9 and stats["reversed_cosine"] < 0.95


def reads_its_input(doc: dict, below_other: float, below_none: float = 0.0) -> bool:
    """Whether a reconstruction document shows a memory that carries its span: own NLL at least ``below_other``
    nats per token under another span's memory and ``below_none`` under no memory (rung 3: 1.0; rung 4: 0.3 and
    0.5)."""
    if doc["other"]["nll"] is None:  # spans of one trajectory: the control that says it reads was not run
        return False
    return (doc["own"]["nll"] <= doc["other"]["nll"] - below_other
            and doc["own"]["nll"] <= doc["none"]["nll"] - below_none)


def evaluate(actor, net, samples: list[dict], exact_tokens: int = 32, groups: list[str] | None = None) -> dict:
    """The reconstruction document of ``samples`` (tensors): spans, tokens and soft tokens per span, the
    none / own / other scores, and ``differences``: own - other and own - none per token with their bootstrap
    intervals (:func:`paired_difference`; ``groups``: each span's trajectory, for the difference within each).
    ``own.exact`` is the share of spans whose first ``exact_tokens`` tokens come back greedily."""
    if not samples:
        raise ValueError("no spans to score")
    was = net.training
    net.eval()
    try:
        kinds = {s.get("trajectory") for s in samples} if groups is None else set(groups)
        # spans of one trajectory have no memory of another to compare with: the other control is left out, said
        modes = ("none", "own", "other") if len(kinds) > 1 or None in kinds else ("none", "own")
        per = {mode: span_scores(actor, net, samples, mode, groups) for mode in modes}
        tokens = per["own"][2]
        total = max(sum(tokens), 1)
        scored = {mode: {"nll": sum(nll) / total, "acc": sum(hits) / total} for mode, (nll, hits, _) in per.items()}
        scored.setdefault("other", {"nll": None, "acc": None,
                                    "skipped": "every span is of one trajectory: no other trajectory's memory"})
        k = min(exact_tokens, min(int(s["span"].numel()) for s in samples))
        exact = sum(greedy(actor, net, s, k) == s["span"][:k].tolist() for s in samples) / len(samples)
        doc = {"spans": len(samples),
               "tokens_per_span": sum(int(s["span"].numel()) for s in samples) / len(samples),
               "slots_per_span": sum(net.slots_for(int(s["span"].numel())) for s in samples) / len(samples),
               "none": scored["none"],
               "own": {**scored["own"], "exact": exact, "exact_tokens": k},
               "other": scored["other"],
               "differences": {f"own_minus_{c}": paired_difference(per["own"][0], per[c][0], tokens, groups)
                               for c in ("other", "none") if c in per}}
    finally:
        net.train(was)
    return doc
