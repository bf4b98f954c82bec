"""Background enrichment of appended steps, off the request path: rule summaries and key embeddings (the
fast lane), the actor's own summaries of the latest steps (the slow lane), and the query embedding the next
turn will ask for. A turn never waits for any of it: policies fall back to what exists."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import OrderedDict
from typing import Callable

import numpy as np

from palimpsest.platform.embedding import EmbedderUnavailable
from palimpsest.platform.policies.base import EPOCH_QUERY_STEPS, query_texts
from palimpsest.platform.prompt.render import key_text
from palimpsest.platform.types import StepRecord
from palimpsest.serving.models.summarizer import sent_ids, summary_messages

log = logging.getLogger("palimpsest.ingress")


class HandleEmbedder:
    """The Embedder deployment behind the platform's Embedder protocol. Policies call it from a worker
    thread (plans run off the event loop), where blocking on a handle is allowed.

    Query embeddings are primed: right after a step is appended, the enrichment lane embeds the query the
    next turn's policy will ask for (the task and the latest steps). A turn then finds it in the cache, or
    waits for the priming request already in flight instead of queueing a second one. The time a turn spends
    waiting for the embedder is reported separately (``waited_ms``), and so are the texts it looked up
    (``lookups``), those it found still in flight (``joined``) and the requests it had to send itself
    (``requests``): with priming on append, a turn's lookups are all answered from the cache."""

    def __init__(self, handle, name: str, cache_size: int = 4096, timeout_s: float = 10.0):
        self.handle, self.name, self.timeout_s = handle, name, timeout_s
        self._cache: OrderedDict[str, np.ndarray] = OrderedDict()
        self._inflight: dict[str, object] = {}
        self._size = cache_size
        self._lock = threading.Lock()
        self._local = threading.local()
        self.hits = self.misses = 0

    def reset_wait(self) -> None:
        self._local.waited_ms = 0.0
        self._local.requests = self._local.lookups = self._local.joined = 0

    @property
    def waited_ms(self) -> float:
        return getattr(self._local, "waited_ms", 0.0)

    @property
    def requests(self) -> int:
        """Embedder requests this thread sent since ``reset_wait`` (lookups found in the cache or already in
        flight send none)."""
        return getattr(self._local, "requests", 0)

    @property
    def lookups(self) -> int:
        """Texts this thread asked embeddings for since ``reset_wait``, however they were answered."""
        return getattr(self._local, "lookups", 0)

    @property
    def joined(self) -> int:
        """Lookups this thread answered by waiting for a priming request still in flight."""
        return getattr(self._local, "joined", 0)

    def _send(self, texts: list[str]):
        self._local.requests = self.requests + 1
        return self.handle.embed.remote(texts)

    def embed(self, texts):
        texts = list(texts)
        t0 = time.perf_counter()
        self._local.lookups = self.lookups + len(texts)
        try:
            if len(texts) == 1:
                with self._lock:
                    hit = self._cache.get(texts[0])
                    pending = self._inflight.get(texts[0])
                if hit is not None:
                    self.hits += 1
                    return hit[None]
                if pending is not None:  # primed a moment ago and still computing: wait for that one
                    self.hits += 1
                    self._local.joined = self.joined + 1
                    vectors, keys = self._result(pending)
                    return vectors[keys.index(texts[0])][None]
                self.misses += 1
            if len(texts) > 1:  # a batch (keys): the texts primed already come from the cache
                with self._lock:
                    known = {t: self._cache[t] for t in texts if t in self._cache}
                if known:
                    self.hits += len(known)
                    rest = [t for t in dict.fromkeys(texts) if t not in known]
                    if rest:
                        vectors, _ = self._result(self._send(rest), rest)
                        known.update(zip(rest, vectors))
                    return np.stack([known[t] for t in texts])
            out, _ = self._result(self._send(texts), texts)
            if len(texts) == 1:
                self._remember(texts, out)
            return out
        finally:
            self._local.waited_ms = self.waited_ms + (time.perf_counter() - t0) * 1000

    def _result(self, response, texts=None):
        if isinstance(response, tuple):  # an in-flight priming request: (response, texts)
            response, texts = response
        try:
            return np.asarray(response.result(timeout_s=self.timeout_s), dtype=np.float32), texts
        except Exception as e:  # failed, hung or restarting: the caller falls back (no keys this turn)
            raise EmbedderUnavailable(f"the embedder did not answer: {type(e).__name__}") from None

    def prime(self, texts: list[str]) -> None:
        with self._lock:
            fresh = [t for t in texts if t not in self._cache and t not in self._inflight]
            if not fresh:
                return
            pending = (self.handle.embed.remote(fresh), fresh)
            for t in fresh:
                self._inflight[t] = pending
        try:
            vectors, _ = self._result(pending)
            self._remember(fresh, vectors)
        finally:
            with self._lock:
                for t in fresh:
                    self._inflight.pop(t, None)

    def _remember(self, texts, vectors) -> None:
        with self._lock:
            for t, v in zip(texts, vectors):
                self._cache[t] = v
                self._cache.move_to_end(t)
            while len(self._cache) > self._size:
                self._cache.popitem(last=False)


class Enrichment:
    """The two background lanes of one ingress replica (started on its event loop)."""

    def __init__(self, runtime, policies: dict, summarizer, summarizer_info: dict, metrics, cfg,
                 arm_of: Callable[[str], str] | None = None):
        self.runtime, self.policies, self.summarizer = runtime, policies, summarizer
        self.summarizer_info, self.metrics, self.cfg = summarizer_info, metrics, cfg
        self.arm_of = arm_of  # a session's arm: its summary calls are recorded under it
        self._queue: asyncio.Queue = asyncio.Queue()
        self._llm_queue: asyncio.Queue = asyncio.Queue()
        self._queued: set[str] = set()
        self._llm_queued: set[str] = set()
        self._tried: set[int] = set()
        loop = asyncio.get_running_loop()
        self._workers = [loop.create_task(self._enrich_worker()), loop.create_task(self._llm_worker())]

    def enqueue(self, session_id: str) -> None:
        if session_id not in self._queued:
            self._queued.add(session_id)
            self._queue.put_nowait(session_id)

    async def _enrich_worker(self) -> None:
        """Fast lane: rule summaries and key embeddings, so every step soon has all four resolutions and a key."""
        while True:
            sid = await self._queue.get()
            self._queued.discard(sid)
            try:
                await asyncio.to_thread(self._prime_queries, sid)  # what the next turn waits for comes first
                await asyncio.to_thread(self.runtime.enrich, sid)
            except Exception as e:  # a failing enrichment never takes the server down; policies fall back
                self.metrics.errors.labels(arm="-", kind="enrich").inc()
                log.warning("enrichment of %s failed: %s", sid, e)
                self._retry_later(sid)
                continue
            if self.summarizer_info["mode"] == "llm" and sid not in self._llm_queued:
                self._llm_queued.add(sid)
                self._llm_queue.put_nowait(sid)

    def _prime_queries(self, sid: str, keys: list[str] | None = None) -> None:
        """Embed the query each arm's policy will use on the next turn (the policy's own query builder), and
        ``keys`` (key texts of new steps) in the same request: the enrichment then finds them in the cache."""
        wanted = {(p.cfg.recent, p.cfg.query) for p in self.policies.values() if p.name in ("pace", "pace_plus")}
        texts = list(keys or [])
        if wanted:
            ledger = self.runtime.ledger
            session, n = ledger.session(sid), ledger.count(sid)
            reads = {(r, layout): max(r, EPOCH_QUERY_STEPS) if layout == "epoch" else r for r, layout in wanted}
            recent = max(reads.values())
            steps = ledger.steps(sid, max(0, n - recent), recent)
            for (r, layout), k in sorted(reads.items()):
                texts += query_texts(session.task, steps[len(steps) - min(k, len(steps)):], layout)
        if texts:
            self.runtime.embedder.prime(texts)

    async def prime_after_append(self, sid: str, steps, timeout_s: float = 2.0) -> bool:
        """What the next turn's plan needs, computed before the append returns: the query embeddings of every
        arm and the new steps' keys, in one embedder request. Never fails the append (the steps are already
        durable): on an error the turn falls back as before. Returns whether it finished."""
        keys = [key_text(s) for s in steps]
        try:
            await asyncio.wait_for(asyncio.shield(asyncio.to_thread(self._prime_queries, sid, keys)),
                                   timeout_s)  # past it the priming goes on in the background
            return True
        except Exception as e:
            self.metrics.errors.labels(arm="-", kind="prime").inc()
            log.warning("priming the next turn of %s failed: %s", sid, e)
            return False

    def _retry_later(self, sid: str, delay_s: float = 5.0) -> None:
        asyncio.get_running_loop().call_later(delay_s, self.enqueue, sid)

    async def _llm_worker(self) -> None:
        """Slow lane: summaries written by the actor for the most recent steps (they replace the rule ones)."""
        # deferred: loads ray
        from palimpsest.serving.models.deployments import summaries_from_wire

        producer = (self.summarizer_info["name"], self.summarizer_info["version"])
        ledger, rt = self.runtime.ledger, self.runtime
        lease_s = 3 * self.cfg.summarizer.timeout_s + 30
        while True:
            sid = await self._llm_queue.get()
            self._llm_queued.discard(sid)
            # With several replicas one of them writes a session's LLM summaries at a time; a replica that
            # finds the lease held leaves the work to the holder, which looks again after letting go.
            lease = f"llm-summaries/{sid}/{producer[0]}:{producer[1]}"
            try:
                if rt.leases and not await asyncio.to_thread(ledger.claim, lease, rt.owner, lease_s):
                    continue
                try:
                    todo, _ = await asyncio.to_thread(ledger.pending, sid, None, producer)
                    todo = [s for s in todo if s.id not in self._tried][-8:]  # the most recent matter most
                    replies = await asyncio.gather(
                        *(self.summarizer.summarize.remote(_record_dict(s.record())) for s in todo),
                        return_exceptions=True)
                    for s, r in zip(todo, replies):
                        self._tried.add(s.id)
                        if isinstance(r, dict) and r["producer"] == producer[0]:
                            await asyncio.to_thread(ledger.add_summaries, sid, s.id, summaries_from_wire(r),
                                                    r["producer"], r["version"])
                    used = [self._usage(s, r) for s, r in zip(todo, replies) if isinstance(r, dict) and r.get("usage")]
                    if used:
                        await asyncio.to_thread(self._record_calls, sid, used)
                finally:
                    if rt.leases:
                        await asyncio.to_thread(ledger.release, lease, rt.owner)
                if rt.leases:
                    left, _ = await asyncio.to_thread(ledger.pending, sid, None, producer)
                    if any(s.id not in self._tried for s in left[-8:]) and sid not in self._llm_queued:
                        self._llm_queued.add(sid)
                        self._llm_queue.put_nowait(sid)
            except Exception as e:
                self.metrics.errors.labels(arm="-", kind="summarize").inc()
                log.warning("LLM summaries of %s failed: %s", sid, e)


    def _usage(self, step, reply: dict) -> dict:
        """What one summary call cost: as the actor reported it, or, for a call that timed out or failed
        (``unanswered``), the ids it sent (the summarizer's messages for the step in the actor's template), all
        uncached: the actor may have read them whether or not a reply came back in time."""
        usage = dict(reply["usage"])
        if usage.get("unanswered"):
            messages = summary_messages(step.record(), self.cfg.summarizer.max_input_chars)
            usage["input"] = sent_ids(self.runtime.ledger.tokenizer, messages, self.cfg.actor.max_model_len,
                                      self.cfg.summarizer.max_tokens)
        return usage

    def _record_calls(self, sid: str, used: list[dict]) -> None:
        """The actor calls of one batch of a session's LLM summaries, recorded under the session's arm (a served
        row of ``kind: summary``): calls, input ids (of them cached), generated ids, the calls that timed out
        (counted with what they sent), and the billed input at the runtime's cached rate. ``experiments/ab_report.py``
        adds them to the arm's cost."""
        calls = sum(int(u.get("calls", 0)) for u in used)
        if not calls or self.arm_of is None:
            return
        inp = sum(int(u.get("input", 0)) for u in used)
        cached = sum(int(u.get("cached", 0)) for u in used)
        try:
            self.runtime.ledger.record_served(sid, self.runtime.ledger.count(sid), self.arm_of(sid), {
                "kind": "summary", "summary_calls": calls, "summary_input": inp, "summary_cached": cached,
                "summary_generated": sum(int(u.get("generated", 0)) for u in used),
                "summary_unanswered": sum(int(u.get("unanswered", 0)) for u in used),
                "summary_billed": inp - cached + self.runtime.cached_rate * cached})
        except Exception as e:  # the record is best effort: the summaries themselves are stored
            log.warning("could not record the summary calls of %s: %s", sid, e)


def _record_dict(r: StepRecord) -> dict:
    return {"t": r.t, "kind": r.kind, "action": r.action, "thought": r.thought, "observation": r.observation,
            "authority": r.authority, "tool": r.tool}
