"""Shadow fidelity: a quality signal for live A/B that does not wait for task outcomes.

For a sample of served turns (``ab.shadow_rate``, drawn by a hash of session and t, so a replay samples the
same turns, and both arms of a paired trajectory sample the same t), a low-priority lane of the ingress scores
the prompt the arm served against a reference with the action-fidelity measure (docs/metrics.md): the actor's
next-token distributions over the tokens of the reply it served, once after the served prompt (the student q)
and once after the reference prompt (p), give per reply token the exact KL(q || p) over the whole vocabulary
and whether the two top-1 tokens agree (``models.scorer.fidelity``).

- The reference (:func:`reference`) is the whole history, every step raw and nothing compacted (``full``),
  whenever it fits the actor's window beside the reply. Otherwise it is the arm's own policy planned *per
  turn* (whatever the arm's compaction mode) at the largest budget the window allows, labelled
  ``POLICY per turn@BUDGET``. Each record names it, and the report never pools the two kinds. A reference
  smaller than the prompt it judges (possible only in the second kind) is counted: the record's ``reason``
  says so, and the report shows how many.
- A turn whose served ids equal the reference's (and carry no soft span) is recorded as ``identical``: its KL
  is 0 by construction, so it is counted and left out of the fidelity mean, which covers the turns where the
  arm changed something. Nothing is scored for it.
- Both prompts are scored by the memory encoder's frozen copy of the actor (Hugging Face, the same weights),
  computing only the reply positions' logits: vLLM's prompt log-probabilities cover every prompt position
  (a full-vocabulary row each: minutes per sample on CPU) and refuse prompt embeds. Every arm is scored by
  the same engine, and the KL is taken there, over the full rows, at no extra cost.
- It stays off the turn path: a sampled turn is queued after its reply is ready (bounded: ``ab.shadow_queue``),
  and the lane starts scoring a sample only when no turn is in flight on this replica (a turn that arrives
  while a sample is being scored shares the actor with it for that one scoring); with ``ab.shadow_yield`` off
  it scores beside the turns (a small machine whose turns leave cores idle: the demo), with
  ``ab.shadow_threads`` only while no turn is in flight. A sample that finds the queue
  full, waits past ``ab.shadow_max_age_s``, answered a glimpse (several generations) or has no reply token ids
  (a remote upstream) is recorded as skipped with its reason, so the report counts what it left out.
- A control arm's dark or canary **candidates** (``candidate_of``) are judged on its live turns: on a share
  ``ab.candidate_rate`` of them (the same hash), the lane also compiles what each candidate would have served
  for that same turn (its policy over the same snapshot, its soft memory; ``Runtime.compile``, which audits and
  stores nothing) and scores it against the same reference over the same reply. The pair is recorded in
  ``shadow_pairs`` (``serving/turn/candidates.py:judge``); nothing of the candidate is recorded as served.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable

from palimpsest.platform.compile.budget import Budget
from palimpsest.platform.compile.epochs import Compaction
from palimpsest.platform.ledger import SessionSnapshot
from palimpsest.platform.types import CompiledTurn, Resolution

log = logging.getLogger("palimpsest.shadow")


def sampled(session_id: str, t: int, rate: float) -> bool:
    """Deterministic Bernoulli(rate) per (session, t). Paired sessions (``ID@ARM``) are sampled by ``ID``, so both
    arms of a trajectory score the same turns."""
    if rate <= 0:
        return False
    h = int.from_bytes(hashlib.sha256(f"{session_id}\0{t}".encode()).digest()[:8], "big")
    return h / 2**64 < rate


def per_turn(policy_config):
    """The same policy config planning every turn anew (no compaction epochs)."""
    return policy_config.model_copy(update={"compaction": Compaction(mode="per_turn")})


def reference(runtime, snap: SessionSnapshot, policy, window: int, reply: int) -> tuple[str, list[int]]:
    """(label, ids) of the prompt a served turn over ``snap`` is judged against, with ``reply`` ids to follow it in
    an actor ``window``: the whole history uncompacted (``full``) when it fits; else ``policy`` planned per turn
    at the largest budget the window allows (``NAME per turn@BUDGET``)."""
    limit = Budget(window, reply)
    whole = runtime.compile(snap, runtime.policy(per_turn(runtime.policy("full").cfg)), limit)
    if (whole.plan.resolution == Resolution.FULL).all() and "elided" not in whole.plan.info:
        return "full", list(whole.prompt.ids)
    largest = runtime.compile(snap, runtime.policy(per_turn(policy.cfg)), limit)
    return f"{policy.name} per turn@{limit.total}", list(largest.prompt.ids)


def smaller_note(reference_ids: int, served_ids: int) -> str:
    """The note a record carries when its reference holds fewer ids than the prompt it judges (the window forced
    the reference to a policy's plan, and that plan kept less than the served turn): counted in the report."""
    return f"reference smaller than served: {reference_ids} < {served_ids} ids" if reference_ids < served_ids else ""


@dataclass
class Sample:
    session_id: str
    arm: str
    turn: CompiledTurn
    reply: list[int]
    soft: int  # soft positions of the served prompt (with a span it can never equal a token-only reference)
    policy: Any  # the arm's policy (the reference when the whole history does not fit)
    scorer: Any  # async (reference ids, reply, threads) -> (kl, top1): the memory encoder's actor
    queued: float
    budget: Any = None  # the turn's Budget (a candidate is compiled at its total and reply)
    regular: bool = True  # sampled at ab.shadow_rate (else only for its candidates: no `shadow` row of its own)
    candidates: tuple = ()  # the arm's candidates judged on this turn (serving.turn.candidates.Judged)

    @property
    def tokens(self) -> int:
        p = self.turn.prompt
        return len(p.context_ids) + len(p.bridge_ids) + int(self.soft)


class ShadowLane:
    """The ingress's shadow-fidelity worker (one per replica, on its event loop)."""

    def __init__(self, runtime, cfg, window: int, busy: Callable[[], bool], metrics=None):
        self.runtime, self.cfg, self.window, self.busy = runtime, cfg, window, busy
        self.metrics = metrics
        self.queue: asyncio.Queue[Sample] = asyncio.Queue()
        self.counts = {"sampled": 0, "scored": 0, "identical": 0, "skipped": 0, "paired": 0, "pairs_skipped": 0}
        # a control's candidates (arm -> Judged list) and their judge (async (judged, sample, reference ids,
        # threads) -> {kl, top1, tokens}); the replica sets both once its rollouts are known
        self.candidates: Callable[[str], list] = lambda arm: []
        self.judge: Callable | None = None
        lane = cfg.shadow_rate > 0 or cfg.candidate_rate > 0
        self._task = asyncio.get_running_loop().create_task(self._worker()) if lane else None

    def state(self) -> dict:
        return {"rate": self.cfg.shadow_rate, "queued": self.queue.qsize(), **self.counts}

    def offer(self, session_id: str, arm: str, ct: CompiledTurn, reply: list[int], generations: int, soft: int,
              policy, scorer, budget=None) -> None:
        """Called after a turn is served and recorded; returns at once. ``soft``: the soft positions the turn
        carried (a bool says whether it carried any)."""
        key = session_id[: -len(arm) - 1] if session_id.endswith("@" + arm) else session_id
        cands = tuple(self.candidates(arm)) if self._task is not None and self.judge is not None else ()
        rate = max(self.cfg.shadow_rate, self.cfg.candidate_rate if cands else 0.0)
        if self._task is None or not sampled(key, ct.t, rate):
            return
        s = Sample(session_id, arm, ct, list(reply), int(soft), policy, scorer, time.monotonic(), budget,
                   sampled(key, ct.t, self.cfg.shadow_rate), cands)
        self.counts["sampled"] += int(s.regular)
        if generations != 1 or not reply:
            reason = "glimpse (several generations)" if generations != 1 else "no reply token ids (remote upstream)"
            self._skip_later(s, reason)
        elif self.queue.qsize() >= self.cfg.shadow_queue:
            self._skip_later(s, "load: queue full")
        else:
            self.queue.put_nowait(s)

    def _skip_later(self, s: Sample, reason: str) -> None:
        """Count a skip now and record it off the event loop (the turn's reply is not held up by the write)."""
        self._count_skip(s)
        asyncio.get_running_loop().run_in_executor(None, self._record_skip, s, reason)

    def _count_skip(self, s: Sample) -> None:
        if s.regular:
            self.counts["skipped"] += 1
            if self.metrics is not None:
                self.metrics.shadow.labels(arm=s.arm, status="skipped").inc()
        for c in s.candidates:
            self._count_pair(c, "skipped")

    def _count_pair(self, c, status: str) -> None:
        self.counts["paired" if status == "scored" else "pairs_skipped"] += 1
        if self.metrics is not None:
            self.metrics.pairs.labels(candidate=c.name, status=status).inc()

    def _skip(self, s: Sample, reason: str) -> None:
        self._count_skip(s)
        self._record_skip(s, reason)

    def _record_skip(self, s: Sample, reason: str) -> None:
        ledger = self.runtime.ledger
        try:
            if s.regular:
                ledger.record_shadow(s.session_id, s.turn.t, s.arm, "skipped", reason=reason, tokens=len(s.reply))
            for c in s.candidates:
                ledger.record_shadow_pair(s.session_id, s.turn.t, s.arm, c.name, c.subject, "skipped", reason=reason,
                                          tokens=len(s.reply))
        except Exception as e:  # the record is best effort; the counter above still counts it
            log.warning("could not record a skipped shadow sample: %s", e)

    async def drained(self, timeout_s: float) -> bool:
        """Wait until every queued sample is scored or skipped (the demo's report waits for them)."""
        deadline = time.monotonic() + timeout_s
        while self.queue.qsize() or self._working:
            if time.monotonic() > deadline:
                return False
            await asyncio.sleep(0.2)
        return True

    _working = False

    async def _worker(self) -> None:
        while True:
            s = await self.queue.get()
            self._working = True
            try:
                while self.cfg.shadow_yield and self.busy():  # low priority: served turns first
                    if time.monotonic() - s.queued > self.cfg.shadow_max_age_s:
                        break
                    await asyncio.sleep(0.05)
                if time.monotonic() - s.queued > self.cfg.shadow_max_age_s:
                    await asyncio.to_thread(self._skip, s, "load: stale")
                    continue
                await self._score(s)
            except Exception as e:
                log.warning("shadow scoring of %s t=%s failed: %s", s.session_id, s.turn.t, e)
                await asyncio.to_thread(self._skip, s, f"error: {type(e).__name__}")
            finally:
                self._working = False

    async def _score(self, s: Sample) -> None:
        reference_label, ref_ids = await asyncio.to_thread(reference, self.runtime, s.turn.snapshot, s.policy,
                                                           self.window, len(s.reply))
        p = s.turn.prompt
        served = list(p.context_ids) + list(p.bridge_ids)
        note = smaller_note(len(ref_ids), len(served))
        if not s.soft and served == ref_ids:
            # the arm served the reference itself: KL 0 by construction, counted apart and never averaged in
            kl, top1 = 0.0, 1.0
            if s.regular:
                self.counts["identical"] += 1
                if self.metrics is not None:
                    self.metrics.shadow.labels(arm=s.arm, status="identical").inc()
                await asyncio.to_thread(self.runtime.ledger.record_shadow, s.session_id, s.turn.t, s.arm,
                                        "identical", reference=reference_label, tokens=len(s.reply))
        else:
            # the memory encoder scores both prompts, the span (where the turn sent one) from its own cache;
            # ab.shadow_threads only while no turn is in flight (a lane that does not yield scores beside the turns)
            kl, top1 = await s.scorer(ref_ids, s.reply, None if self.busy() else self.cfg.shadow_threads)
            if s.regular:
                self.counts["scored"] += 1
                if self.metrics is not None:
                    self.metrics.shadow.labels(arm=s.arm, status="scored").inc()
                await asyncio.to_thread(self.runtime.ledger.record_shadow, s.session_id, s.turn.t, s.arm, "scored",
                                        reference=reference_label, kl=kl, top1=top1, tokens=len(s.reply), reason=note)
        for c in s.candidates:  # each candidate on the same turn, against the same reference and reply
            await self._pair(s, c, reference_label, ref_ids, kl, top1)

    async def _pair(self, s: Sample, c, reference_label: str, ref_ids: list[int], kl: float, top1: float) -> None:
        ledger = self.runtime.ledger
        try:
            got = await self.judge(c, s, ref_ids, None if self.busy() else self.cfg.shadow_threads)
        except Exception as e:
            log.warning("judging candidate %s on %s t=%s failed: %s", c.name, s.session_id, s.turn.t, e)
            self._count_pair(c, "skipped")
            await asyncio.to_thread(ledger.record_shadow_pair, s.session_id, s.turn.t, s.arm, c.name, c.subject,
                                    "skipped", reason=f"error: {type(e).__name__}", reference=reference_label,
                                    control_kl=kl, control_top1=top1, control_tokens=s.tokens, tokens=len(s.reply))
            return
        self._count_pair(c, "scored")
        await asyncio.to_thread(ledger.record_shadow_pair, s.session_id, s.turn.t, s.arm, c.name, c.subject, "scored",
                                reference=reference_label, control_kl=kl, control_top1=top1,
                                candidate_kl=got["kl"], candidate_top1=got["top1"], control_tokens=s.tokens,
                                candidate_tokens=got["tokens"], tokens=len(s.reply),
                                reason=smaller_note(len(ref_ids), got["ids"]))


__all__ = ["ShadowLane", "reference", "sampled", "smaller_note"]
