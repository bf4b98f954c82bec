"""The reconstruction measurement can fail: a memory that ignores its input (a constant, or another span's
source) fails it, and one that carries its span passes. Tiny actors for the document's shape; SmolLM2 (slow
tier) for the verdicts, with a memory that is its span's own token embeddings as the one that carries it."""

import json
import subprocess
import sys

import pytest
import torch
from torch import nn

from palimpsest.training.reconstruction import evaluate, reads_its_input, score
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


def test_the_document_has_every_field_and_a_constant_memory_scores_own_as_other():
    actor = tiny_actor()
    samples = spans(4, 12)
    const = TextMemory(actor, constant=torch.arange(10, 18))
    doc = evaluate(actor, const, samples, exact_tokens=8)
    assert set(doc) == {"spans", "tokens_per_span", "slots_per_span", "none", "own", "other"}
    assert doc["spans"] == 4 and doc["tokens_per_span"] == 12 and doc["own"]["exact_tokens"] == 8
    assert set(doc["own"]) == {"nll", "acc", "exact", "exact_tokens"} and set(doc["none"]) == {"nll", "acc"}
    assert doc["own"]["nll"] == pytest.approx(doc["other"]["nll"], abs=1e-6)  # it ignores its input
    assert not reads_its_input(doc, 1e-3)
    with pytest.raises(ValueError, match="at least 2 spans"):
        score(actor, const, samples[:1], "other")


@pytest.mark.slow
def test_on_smollm2_a_memory_that_carries_its_span_passes_and_ones_that_ignore_it_fail():
    from palimpsest.models.actor import FrozenActor
    from palimpsest.models.assets import smollm2_dir
    from palimpsest.platform.tokens import get_tokenizer
    from palimpsest.training.reconstruction import REPEAT_INSTRUCTION

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
