"""Shadow fidelity on the frozen actor: how far the served prompt moves the actor's next-token distributions
over its reply from a reference prompt's (the exact KL over the whole vocabulary, and top-1 agreement).

The serving layer's memory encoder deployment holds one :class:`FidelityScorer` beside its memory models
(``serving/models/deployments.py``); the shadow lane decides what to score (``serving/turn/shadow.py``). No Ray here.
"""

from __future__ import annotations

import copy
import hashlib
import json
from collections import OrderedDict

import torch

from palimpsest.models.actor import FrozenActor


def fidelity(student_logits: torch.Tensor, teacher_logits: torch.Tensor) -> tuple[float, float]:
    """Mean over positions of the exact KL(q || p) over the whole vocabulary (q: the student's next-token
    distribution, p: the teacher's, both from (n, V) logits) and of top-1 agreement."""
    if student_logits.ndim != 2 or student_logits.shape != teacher_logits.shape or not student_logits.shape[0]:
        raise ValueError(f"expected two (n, V) logit tensors of one shape, got {tuple(student_logits.shape)} and "
                         f"{tuple(teacher_logits.shape)}")
    logq = torch.log_softmax(student_logits.double(), -1)
    logp = torch.log_softmax(teacher_logits.double(), -1)
    kl = (logq.exp() * (logq - logp)).sum(-1)  # exact: every token of the vocabulary, in float64
    top1 = (student_logits.argmax(-1) == teacher_logits.argmax(-1)).double()
    return float(kl.mean()), float(top1.mean())


class FidelityScorer:
    """Scores a reply after the served prompt (the student) against the same reply after a reference prompt (the
    teacher). Only the reply positions' logits are computed. A reference's prefill is kept (a few, least
    recently used dropped): every prompt judged at one turn (each arm of a paired trajectory, a control and its
    candidates) is scored against the same reference, so it is computed once and each reply continues from it.
    A student starts as the reference does (the session's system prompt, tools and task; on dev most of a prompt
    at the demo's budget), so it continues from a copy of the reference's prefill cut to their common start, and
    only its own tail runs through the actor."""

    def __init__(self, actor: FrozenActor, prefix_cache_size: int = 3):
        self.actor = actor
        self.prefix_cache_size = prefix_cache_size
        self._prefixes: OrderedDict[str, tuple] = OrderedDict()

    def _ids(self, xs: list[int]) -> torch.Tensor:
        return torch.as_tensor(xs, dtype=torch.long, device=next(self.actor.model.parameters()).device)

    @torch.no_grad()
    def score(self, context: list[int], span: torch.Tensor | None, bridge: list[int], reply: list[int],
              reference: list[int]) -> tuple[float, float, int]:
        """(KL, top-1, positions run through the actor): the student is [context; ``span``; bridge] (no span:
        ids only), the teacher ``reference``; both followed by ``reply``."""
        actor, n = self.actor, len(reply)
        if span is not None and span.shape[0] == 0:  # a closed span gate sent nothing: the ids alone
            span = None
        teacher, reused = self._teacher(reference, reply)
        # the student's start that the reference shares, less one position when nothing else would follow it
        # (the logits before the reply's first id come from the student's last position)
        shared = _common_start(context, reference)
        if span is None and not bridge:
            shared = max(min(shared, len(context) - 1), 0)
        tail = actor.embed(self._ids(context[shared:]))
        if span is not None:
            tail = torch.cat([tail, span.to(tail.device, tail.dtype)])
        tail = torch.cat([tail, actor.embed(self._ids(bridge + reply))])
        if shared > 0:
            past = copy.deepcopy(self._prefixes[_key(reference)][0])
            past.crop(shared)
            student = actor.after_prefix(past, tail, last=n + 1, keep=False)[:n]
        else:
            student = actor(inputs_embeds=tail[None], last=n + 1)[0, :n]
        kl, top1 = fidelity(student, teacher)
        # the student's own tail and reply, the reply after the reference, and the reference unless it was reused
        positions = int(tail.shape[0]) + n + (0 if reused else len(reference))
        return kl, top1, positions

    def _teacher(self, reference: list[int], reply: list[int]) -> tuple[torch.Tensor, bool]:
        """The reference's logits at each reply token, and whether its prefill was reused."""
        key = _key(reference)
        reused = key in self._prefixes
        if reused:
            self._prefixes.move_to_end(key)
            past, last = self._prefixes[key]
        else:
            past, last = self.actor.prefill(self._ids(reference))
            self._prefixes[key] = (past, last)
            while len(self._prefixes) > self.prefix_cache_size:
                self._prefixes.popitem(last=False)
        if len(reply) == 1:
            return last[None], reused
        return torch.cat([last[None], self.actor.continue_from(past, len(reference), self._ids(reply[:-1]))]), reused


def _key(reference: list[int]) -> str:
    return hashlib.sha256(json.dumps(reference).encode()).hexdigest()


def _common_start(a: list[int], b: list[int]) -> int:
    """How many leading ids ``a`` and ``b`` share."""
    n = min(len(a), len(b))
    if not n:
        return 0
    diff = (torch.as_tensor(a[:n]) != torch.as_tensor(b[:n])).nonzero()
    return int(diff[0, 0]) if len(diff) else n
