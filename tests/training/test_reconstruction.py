"""The reconstruction measurement can fail: a memory that ignores its input (a constant, or another span's
source) fails it, and one that carries its span passes. Tiny actors for the document's shape; SmolLM2 (slow
tier) for the verdicts, with a memory that is its span's own token embeddings as the one that carries it."""


import pytest
import torch
from torch import nn

from palimpsest.evaluation.reconstruction import (
    evaluate,
    other_donors,
    paired_difference,
    reads_its_input,
    score,
    span_scores,
)
from tests.models.tiny import tiny_actor


class TextMemory(nn.Module):
    """A memory that carries its span whole: the actor's own embeddings of the ids it reads (no compression; an
    instrument check, not a model). ``permute``: it reads another span's ids instead (ignores its input)."""

    def __init__(self, actor, permute: dict | None = None, constant: torch.Tensor | None = None):
        super().__init__()
        object.__setattr__(self, "actor", actor)
        self.permute, self.constant = permute or {}, constant

    def source(self, ids):
        return self.permute.get(tuple(ids.tolist()), ids)

    def forward(self, source, summary=None, min_passes=0):
        if self.constant is not None:
            return self.actor.embed(self.constant)
        return self.actor.embed(source)

    def slots_for(self, positions):
        return positions


def spans(n, length, seed=0, vocab=256, instruction=(5, 6, 7)):
    g = torch.Generator().manual_seed(seed)
    return [{"span": torch.randint(10, vocab, (length,), generator=g), "instruction": torch.tensor(instruction)}
            for _ in range(n)]


def test_the_other_control_takes_its_memory_from_another_trajectory():
    """A span of the same trajectory may carry what the span needs: the ``other`` memory is the next span's of
    another trajectory, and a sample of one trajectory has no control."""
    actor = tiny_actor()
    samples = [{**s, "trajectory": t} for s, t in zip(spans(4, 12), ("a", "a", "b", "a"))]
    assert other_donors(samples) == [2, 2, 3, 2]
    assert other_donors([{}, {}, {}]) == [1, 2, 0]  # no trajectory recorded: each span its own
    net = TextMemory(actor)
    got = span_scores(actor, net, samples, "other")[0]
    want = [span_scores(actor, net, [{**s, "source": samples[d]["span"]}], "own")[0][0]
            for s, d in zip(samples, (2, 2, 3, 2))]
    assert got == pytest.approx(want)
    with pytest.raises(ValueError, match="2 trajectories"):
        span_scores(actor, net, [{**s, "trajectory": "a"} for s in spans(3, 12)], "other")


def test_the_document_has_every_field_and_a_constant_memory_scores_own_as_other():
    actor = tiny_actor()
    samples = spans(4, 12)
    const = TextMemory(actor, constant=torch.arange(10, 18))
    doc = evaluate(actor, const, samples, exact_tokens=8, groups=["a", "a", "b", "b"])
    assert set(doc) == {"spans", "tokens_per_span", "slots_per_span", "none", "own", "other", "differences"}
    assert doc["spans"] == 4 and doc["tokens_per_span"] == 12 and doc["own"]["exact_tokens"] == 8
    assert set(doc["own"]) == {"nll", "acc", "exact", "exact_tokens"} and set(doc["none"]) == {"nll", "acc"}
    assert doc["own"]["nll"] == pytest.approx(doc["other"]["nll"], abs=1e-6)  # it ignores its input
    assert not reads_its_input(doc, 1e-3)
    with pytest.raises(ValueError, match="at least 2 spans"):
        score(actor, const, samples[:1], "other")
    # the paired differences are the documents' differences; for a memory that ignores its input, own - other
    # is 0 in every span, so its interval is [0, 0]
    d = doc["differences"]
    assert d["own_minus_none"]["value"] == pytest.approx(doc["own"]["nll"] - doc["none"]["nll"], abs=1e-6)
    assert d["own_minus_other"]["value"] == pytest.approx(0, abs=1e-6)
    assert d["own_minus_other"]["ci95"] == pytest.approx([0, 0], abs=1e-6)
    assert set(d["own_minus_none"]["by_trajectory"]) == {"a", "b"}
    lo, hi = d["own_minus_none"]["ci95"]
    assert lo <= d["own_minus_none"]["value"] <= hi


def test_the_paired_interval_excludes_zero_only_where_the_spans_agree():
    tokens = [10] * 40
    base = [30.0 + (i % 7) for i in range(40)]
    lower = [b - 5.0 + (i % 3) for i, b in enumerate(base)]  # 0.3-0.5 nats per token below in every span
    d = paired_difference(lower, base, tokens, groups=["x"] * 20 + ["y"] * 20)
    assert d["value"] == pytest.approx(-0.4, abs=0.01) and d["ci95"][1] < 0
    for g, ix in (("x", range(20)), ("y", range(20, 40))):  # each group's own difference over its own tokens
        assert d["by_trajectory"][g] == pytest.approx(sum(-5.0 + i % 3 for i in ix) / 200)
    assert d["spans_by_trajectory"] == {"x": 20, "y": 20}
    mixed = [b + (5.0 if i % 2 else -5.0) for i, b in enumerate(base)]  # half above, half below: no direction
    m = paired_difference(mixed, base, tokens)
    assert m["ci95"][0] < 0 < m["ci95"][1] and "by_trajectory" not in m
    with pytest.raises(ValueError, match="same, non-empty"):
        paired_difference([1.0], [1.0, 2.0], [1, 1])
    with pytest.raises(ValueError, match="groups"):
        paired_difference([1.0, 2.0], [1.0, 2.0], [1, 1], groups=["a"])
    with pytest.raises(ValueError, match="resamples"):
        paired_difference([1.0, 2.0], [1.0, 2.0], [1, 1], resamples=0)


def test_the_interval_is_as_wide_as_the_spread_of_the_spans_says():
    """With equal-length spans the bootstrap interval of a mean is about the mean +- 1.96 standard errors: an
    interval from the wrong percentiles (the extremes, 25-75%, 5-95% or one-sided) is off that width or centre."""
    import random
    import statistics

    rng = random.Random(1)
    diffs = [rng.gauss(-3.0, 8.0) for _ in range(200)]
    d = paired_difference(diffs, [0.0] * 200, [10] * 200)
    se = statistics.stdev(diffs) / 200 ** 0.5 / 10
    lo, hi = d["ci95"]
    assert hi - lo == pytest.approx(2 * 1.96 * se, rel=0.05)  # a 90% interval is 0.85 of it, 2.5-95% 0.92
    assert lo < d["value"] < hi and (d["value"] - lo) == pytest.approx(hi - d["value"], rel=0.1)


@pytest.mark.slow
def test_on_smollm2_a_memory_that_carries_its_span_passes_and_ones_that_ignore_it_fail():
    from palimpsest.evaluation.reconstruction import REPEAT_INSTRUCTION
    from palimpsest.models.actor import FrozenActor
    from palimpsest.models.assets import smollm2_dir
    from palimpsest.platform.prompt.tokens import get_tokenizer

    actor = FrozenActor.from_pretrained(smollm2_dir())
    tok = get_tokenizer(str(smollm2_dir()))
    texts = ["port=8431 on host db-17; retry after 45 s, then page the on-call engineer about it now.",
             "git checkout -b fix/parser-2391 && pytest tests/test_parse.py -k 'unicode and not slow' -x -q",
             "The migration renamed users.email_addr to users.email and left a view users_legacy behind it.",
             "ERROR 1213 (40001): Deadlock found when trying to get lock; try restarting transaction now."]
    instr = tok.encode("\n" + REPEAT_INSTRUCTION + "\n")
    samples = [{"span": torch.tensor(tok.encode(t)[:16]), "instruction": torch.tensor(instr)} for t in texts]
    carries = evaluate(actor, TextMemory(actor), samples, exact_tokens=16)
    assert reads_its_input(carries, 1.0, 0.5), carries
    swap = {tuple(s["span"].tolist()): samples[(i + 1) % len(samples)]["span"] for i, s in enumerate(samples)}
    for ignores in (TextMemory(actor, constant=samples[0]["span"]), TextMemory(actor, permute=swap)):
        doc = evaluate(actor, ignores, samples, exact_tokens=16)
        assert not reads_its_input(doc, 1.0), doc
