"""The memory encoder deployment: REMORY soft spans for compiled prompts, and the shadow lane's fidelity
scoring on the same frozen actor (``models.encoder``, ``models.scorer``). The ingress awaits its soft span (an
empty one, a shut span gate, is no span: the turn is its policy's own) and hands it to the actor call."""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from collections import OrderedDict
from typing import Any

from ray import serve

from palimpsest.models.registry import read_bundle, resolve_memory_ref
from palimpsest.platform.types import ConfigError


@serve.deployment(name="MemoryEncoder", max_ongoing_requests=16)
class MemoryDeployment:
    """REMORY soft spans for compiled prompts, cached per (model, what the memory reads): a turn whose plan
    leaves out the same steps as an earlier one reuses its span.

    It holds every memory model the arms use (``default`` and per-arm ones) over one frozen actor copy, so an
    A/B test can compare two memory models as well as memory against none."""

    def __init__(self, actor_path: str, models: dict[str, str | None], device: str = "cpu", cache_size: int = 4096):
        self.models: dict[str, dict] = {}
        encoders: dict[str, Any] = {}
        actor = None
        for key, wanted in models.items():
            ref = resolve_memory_ref(wanted)
            entry = {"enabled": False, "model": ref, "note": "no memory model" if ref is None else "", "max_slots": 0}
            if ref is not None and ref not in encoders:
                # deferred: loads torch
                from palimpsest.models.actor import FrozenActor
                from palimpsest.models.encoder import MemoryEncoder as Encoder

                actor = actor or FrozenActor.from_pretrained(actor_path, device=device)
                try:
                    encoders[ref] = Encoder.load(ref, actor)
                except ConfigError as e:
                    if wanted != "auto":
                        raise
                    # `auto` found a model trained for another actor: serve without soft memory, and say so.
                    encoders[ref] = None
                    entry["note"] = f"memory off: {e}"
            if ref is not None and encoders.get(ref) is not None:

                bundle = read_bundle(ref)
                data = bundle.data
                net = encoders[ref].memory.cfg  # how many soft positions a read yields (TurnService.soft_positions)
                read = bundle.read  # what it reads of a turn: its bundle says it, as it was trained
                entry.update(enabled=True, max_slots=encoders[ref].slots_for(read.max_history_tokens),
                             block_size=net.block_size, queries=net.queries, read=read.model_dump(),
                             # what it was trained with: the ingress warns when an arm serves it otherwise
                             policy_hash=bundle.policy_hash, memory_read_version=data.get("memory_read"),
                             trained_budget=data.get("budget"))
            else:
                entry["model"] = None
            self.models[key] = entry
        self.encoders = {k: encoders[e["model"]] for k, e in self.models.items() if e["enabled"]}
        self.cache: OrderedDict[tuple[str, str, str], Any] = OrderedDict()
        self.cache_size = cache_size
        self._lock = asyncio.Lock()
        self._score_lock = asyncio.Lock()
        self.actor_path, self.device, self.scorer = actor_path, device, None
        self.hits = self.misses = 0
        self.busy: dict[str, dict] = {}

    def info(self) -> dict:
        return {"models": self.models, "hits": self.hits, "misses": self.misses, "cached": len(self.cache)}

    async def encode(self, key: str, session_id: str, history: list[int], summary: list[int]) -> dict:
        import torch

        if key not in self.encoders:
            raise RuntimeError(f"no memory model is loaded for {key!r}")
        t0 = time.perf_counter()
        digest = hashlib.sha256(json.dumps([history, summary]).encode()).hexdigest()
        ck = (self.models[key]["model"], session_id, digest)
        if ck in self.cache:
            self.hits += 1
            self.cache.move_to_end(ck)
            return {"soft": self.cache[ck], "ms": (time.perf_counter() - t0) * 1000, "cached": True}
        async with self._lock:
            if ck not in self.cache:
                self.misses += 1
                h = torch.as_tensor(history, dtype=torch.long)
                s = torch.as_tensor(summary, dtype=torch.long)
                t_enc = time.perf_counter()
                soft = await asyncio.to_thread(self.encoders[key].encode, h, s)
                self._busy("memory", time.perf_counter() - t_enc, len(history) + len(summary))
                self.cache[ck] = soft.float().cpu().contiguous()
                while len(self.cache) > self.cache_size:
                    self.cache.popitem(last=False)
        return {"soft": self.cache[ck], "ms": (time.perf_counter() - t0) * 1000, "cached": False}


    async def score(self, key: str | None, session_id: str, history: list[int], summary: list[int],
                    context: list[int], bridge: list[int], reply: list[int], reference: list[int],
                    threads: int | None = None) -> tuple[float, float]:
        """Shadow fidelity of one served turn: the frozen actor's next-token distributions at each reply token,
        after the served prompt (the student: [context; soft span of memory ``key``; bridge], no span when ``key``
        is None) and after ``reference`` (the teacher), give the exact KL(q || p) over the whole vocabulary and
        top-1 agreement, averaged over the reply (``models.scorer``). Only the reply positions' logits are
        computed (vLLM's prompt log-probabilities cover every prompt position and refuse prompt embeds).
        ``threads``: torch threads for this scoring (the lane passes ``ab.shadow_threads`` while no turn is in
        flight); None: the replica's own."""
        # deferred: loads torch
        import torch

        span = (await self.encode(key, session_id, history, summary))["soft"] if key is not None else None
        scorer = self._scorer()

        def run() -> tuple[float, float]:
            t0 = time.perf_counter()
            before = torch.get_num_threads()
            if threads:
                torch.set_num_threads(threads)
            try:
                kl, top1, positions = scorer.score(context, span, bridge, reply, reference)
            finally:
                torch.set_num_threads(before)
            self._busy("shadow", time.perf_counter() - t0, positions)
            return kl, top1

        async with self._score_lock:  # one scoring at a time; never holds the turn path's encode lock
            return await asyncio.to_thread(run)

    def _busy(self, kind: str, seconds: float, tokens: int) -> None:
        b = self.busy.setdefault(kind, {"calls": 0, "seconds": 0.0, "tokens": 0})
        b["calls"] += 1
        b["seconds"] += seconds
        b["tokens"] += tokens

    def stats(self) -> dict:
        """Where this replica's model time went: memory encoding and shadow scoring (calls, seconds, positions)."""
        return {k: dict(v) for k, v in self.busy.items()}

    def _scorer(self):
        """The fidelity scorer over the frozen actor the memories read with, or (no memory model loaded) one
        loaded on first use."""
        if self.scorer is None:
            # deferred: loads torch
            from palimpsest.models.actor import FrozenActor
            from palimpsest.models.scorer import FidelityScorer

            actor = (next(iter(self.encoders.values())).actor if self.encoders
                     else FrozenActor.from_pretrained(self.actor_path, device=self.device))
            self.scorer = FidelityScorer(actor)
        return self.scorer
