"""The shadow scorer (models/scorer.py) on a tiny random actor: a student prompt that shares its start with the
reference continues from the reference's prefill, with the scores of full forwards."""

import pytest
import torch

from palimpsest.models.scorer import FidelityScorer, fidelity
from tests.models.tiny import tiny_actor


def _full(actor, student_embeds, reference, reply):
    """The scores from two forwards of whole sequences, no cache: what sharing the prefix must reproduce."""
    n = len(reply)
    student = actor(inputs_embeds=student_embeds[None], last=n + 1)[0, :n]
    teacher = actor(input_ids=torch.tensor(reference + reply)[None], last=n + 1)[0, :n]
    return fidelity(student, teacher)


def test_a_student_sharing_the_references_start_runs_only_its_own_tail_with_the_same_scores():
    actor = tiny_actor()
    shared = list(range(10, 200))  # the system prompt, tools and task every prompt of a session starts with
    reference = shared + [5, 6, 7] * 20
    context, bridge, reply = shared + [9, 8] * 10, [7, 7], [1, 2, 3, 4]
    scorer = FidelityScorer(actor)
    kl, top1, positions = scorer.score(context, None, [], reply, reference)
    want = _full(actor, actor.embed(torch.tensor(context + reply)), reference, reply)
    assert kl == pytest.approx(want[0], abs=1e-5) and top1 == want[1]
    # the student's own positions only (its tail after the shared start, its reply), then the reference's
    assert positions == (len(context) - len(shared)) + len(reply) + len(reply) + len(reference)
    span = 0.1 * torch.randn(3, 64)  # a memory arm's soft span between the context and the bridge
    kl, top1, positions = scorer.score(context, span, bridge, reply, reference)
    embeds = torch.cat([actor.embed(torch.tensor(context)), span, actor.embed(torch.tensor(bridge + reply))])
    want = _full(actor, embeds, reference, reply)
    assert kl == pytest.approx(want[0], abs=1e-5) and top1 == want[1]
    assert positions == (len(context) - len(shared)) + 3 + len(bridge) + len(reply) + len(reply)  # reference reused
    # a student that is all prefix of the reference still runs its last id (the reply's first logits come from it)
    kl, top1, positions = scorer.score(reference[:50], None, [], reply, reference)
    want = _full(actor, actor.embed(torch.tensor(reference[:50] + reply)), reference, reply)
    assert kl == pytest.approx(want[0], abs=1e-5) and positions == 1 + len(reply) + len(reply)


def test_an_empty_span_a_closed_span_gate_sent_is_scored_as_no_span():
    """A memory whose span gate is closed sends a (0, d) span: the student is its ids alone, scored as with no
    span at all (a student that is all prefix of the reference still runs its last id)."""
    actor = tiny_actor()
    reference, reply = list(range(10, 120)), [1, 2, 3]
    scorer = FidelityScorer(actor)
    for context in (reference[:60], list(range(10, 40)) + [9, 8]):
        empty = scorer.score(context, torch.zeros(0, 64), [], reply, reference)
        none = FidelityScorer(actor).score(context, None, [], reply, reference)
        want = _full(actor, actor.embed(torch.tensor(context + reply)), reference, reply)
        assert empty[0] == pytest.approx(none[0], abs=1e-6) == pytest.approx(want[0], abs=1e-5)
        assert empty[1] == none[1] == want[1]
