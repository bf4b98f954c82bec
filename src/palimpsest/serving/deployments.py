"""The child deployments of the composed app: Embedder, Summarizer, MemoryEncoder and Actor.

Each wraps one model-side class (no HTTP here; the ingress is the only place that knows HTTP). Tensors
travel between them through DeploymentHandles: the memory encoder's soft span goes straight into the
actor call (the ingress passes the response along without awaiting it), so it never crosses the ingress.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import time
from collections import OrderedDict
from typing import Any

from ray import serve

from palimpsest.models.registry import memory_meta, resolve_memory_ref
from palimpsest.platform.abstraction import Abstraction, RuleSummarizer, Summaries
from palimpsest.platform.chat import chat_ids
from palimpsest.platform.embedding import HashingEmbedder
from palimpsest.platform.tokens import get_tokenizer
from palimpsest.platform.types import ConfigError, StepRecord
from palimpsest.serving.config import ActorConfig, SummarizerConfig
from palimpsest.serving.remote import RemoteEngine
from palimpsest.serving.shadow import fidelity
from palimpsest.serving.summarizer import LLMSummarizer
from palimpsest.serving.tools import ToolCalling


def _replica_rank() -> int:
    try:
        return int(serve.get_replica_context().rank)
    except Exception:
        return 0


@serve.deployment(name="Actor", max_ongoing_requests=32, health_check_period_s=10, graceful_shutdown_timeout_s=20)
class Actor:
    """vLLM with prompt embeds; ``generate`` takes token ids, or context ids + a soft span + bridge ids."""

    def __init__(self, cfg: dict):
        # deferred: loads torch
        from palimpsest.serving.engine import ActorEngine

        self.cfg = ActorConfig.model_validate(cfg)
        self.engine = ActorEngine(self.cfg, replica_rank=_replica_rank())
        self.template = self.cfg.template_source()
        # the chat template and ids of palimpsest.platform.chat
        self.tokenizer = get_tokenizer(str(self.engine.path), self.template)
        self.tools = None
        if self.cfg.tool_parser:

            self.tools = ToolCalling(self.cfg.tool_parser, str(self.engine.path), self.engine.model_name)

    def info(self) -> dict:
        return {"model": self.engine.model_name, "path": str(self.engine.path), "hidden_size": self.engine.hidden_size,
                "vocab_size": self.engine.vocab_size, "max_model_len": self.cfg.max_model_len,
                "max_embeds_len": self.cfg.max_embeds_len, "dtype": self.cfg.dtype, "chat_template": self.template,
                "tool_parser": self.cfg.tool_parser, "prompt_embeds": True, "remote": None,
                "tokenizer": str(self.engine.path)}

    async def generate(self, request: dict, memory: dict | None = None) -> dict:
        """``request``: {"ids": [...]} or {"context": [...], "bridge": [...]} (+ max_tokens, temperature, seed,
        logprobs, top_p, stop, and ``tools`` / ``tool_choice`` / ``parallel_tool_calls``), or {"embeds": tensor}.
        ``memory`` (the encoder's reply) adds its soft span between context and bridge; the reply carries the
        memory's own timing so the ingress can break latency down, and with tools the parsed ``content`` and
        ``tool_calls``."""
        final = None
        async for event in self._events(request, memory, stream=False):
            final = event
        return final

    async def generate_stream(self, request: dict, memory: dict | None = None):
        """As :meth:`generate`, event by event: ``{"delta", "content"}`` while generating, then the result
        (``done``). ``content`` is the part of the delta that is not tool-call markup."""
        async for event in self._events(request, memory, stream=True):
            yield event

    async def _events(self, request: dict, memory: dict | None, stream: bool):
        params = {k: request[k] for k in ("max_tokens", "temperature", "seed", "logprobs", "top_p", "stop", "kind")
                  if request.get(k) is not None}
        turn = None
        if request.get("tools") and request.get("tool_choice") != "none":
            if self.tools is None:
                raise ValueError("tools: this actor has no tool parser (actor.tool_parser)")
            turn = self.tools.turn(request["tools"], request.get("tool_choice"), request.get("parallel_tool_calls"))
            params.update(turn.sampling())
        soft = memory["soft"] if memory else None
        if "embeds" in request:
            source = self.engine.stream(embeds=request["embeds"], **params)
        elif soft is not None:
            embeds = self.engine.compose(request["context"], soft, request.get("bridge", []))
            source = self.engine.stream(embeds=embeds, **params)
        else:
            ids = request["ids"] if "ids" in request else request["context"] + request.get("bridge", [])
            source = self.engine.stream(ids=ids, **params)
        async for event in source:
            if not event.get("done"):
                if stream:
                    content = (turn.content_delta(event["delta"], event["delta_ids"], event["finished"])
                               if turn is not None else event["delta"])
                    yield {"delta": event["delta"], "content": content}
                continue
            out = event
            out["content"], out["tool_calls"] = (turn.parse(out["text"], out["token_ids"]) if turn is not None
                                                 else (out["text"], []))
            out["soft_tokens"] = int(soft.shape[0]) if soft is not None else 0
            if memory:
                out["memory_ms"] = memory["ms"]
                out["memory_cached"] = memory["cached"]
            yield out

    async def chat(self, messages: list[dict], max_tokens: int = 96, kind: str = "summary") -> str:
        """A helper generation (a step's summary, the ``ace`` LLM elasticizer), accounted under ``kind``."""
        ids = chat_ids(self.tokenizer, messages).all[-(self.cfg.max_model_len - max_tokens - 1):]
        return (await self.engine.generate(ids=ids, max_tokens=max_tokens, kind=kind))["text"]

    def embed_ids(self, ids: list[int]):
        """The actor's own input embeddings of ``ids`` (what a soft span is concatenated with)."""
        return self.engine.embed(ids)

    def stats(self) -> dict:
        return dict(self.engine.stats)

    def busy(self) -> dict:
        """Where the engine's time went, by kind of generation (``ActorEngine.busy``)."""
        return self.engine.busy()

    async def check_health(self) -> None:
        await self.engine.check_health()

    async def reset_prefix_cache(self) -> None:
        await self.engine.reset_prefix_cache()

    def __del__(self):
        engine = getattr(self, "engine", None)
        if engine is not None:
            try:
                engine.shutdown()
            except Exception:
                pass


@serve.deployment(name="Actor", max_ongoing_requests=64, health_check_period_s=10, graceful_shutdown_timeout_s=20)
class RemoteActor:
    """The actor as an upstream OpenAI-compatible server (``actor.remote``), with :class:`Actor`'s interface.
    Deployed under the same name, so the ingress, the summarizer and the metrics do not change."""

    def __init__(self, cfg: dict):
        from pathlib import Path

        # deferred: loads torch
        from palimpsest.serving.engine import load_embedding_table

        self.cfg = ActorConfig.model_validate(cfg)
        path = Path(self.cfg.model)
        self.table = load_embedding_table(path)
        self.template = self.cfg.template_source()
        self.tokenizer = get_tokenizer(str(path), self.template)  # what the budget counts with
        self.engine = RemoteEngine(self.cfg, str(path), self.table)
        self._started: asyncio.Future | None = None

    async def _ready(self) -> None:
        if self._started is None:
            self._started = asyncio.ensure_future(self.engine.start(int(self.table.shape[1])))
        try:
            await asyncio.shield(self._started)
        except Exception:
            self._started = None
            raise

    async def info(self) -> dict:
        await self._ready()
        return {"model": self.engine.model, "path": self.cfg.model, "hidden_size": int(self.table.shape[1]),
                "vocab_size": int(self.table.shape[0]), "max_model_len": self.cfg.max_model_len,
                "max_embeds_len": self.cfg.max_embeds_len, "dtype": self.cfg.dtype, "chat_template": self.template,
                "tool_parser": "upstream" if self.cfg.remote.tool_calls else None,
                "prompt_embeds": self.engine.prompt_embeds, "remote": self.engine.url, "tokenizer": self.cfg.model}

    async def generate(self, request: dict, memory: dict | None = None) -> dict:
        await self._ready()
        out = await self.engine.generate(self._request(request), memory)
        return self._finish(out, memory)

    async def generate_stream(self, request: dict, memory: dict | None = None):
        await self._ready()
        async for event in self.engine.stream(self._request(request), memory, live=True):
            yield self._finish(event, memory) if event.get("done") else event

    def _request(self, request: dict) -> dict:
        if "messages" not in request and "context" in request:  # a helper call by ids: its text as one prompt
            request = {**request, "messages": [{"role": "user", "content": self.tokenizer.decode(request["context"])}]}
        return request

    @staticmethod
    def _finish(out: dict, memory: dict | None) -> dict:
        out["soft_tokens"] = int(memory["soft"].shape[0]) if memory and memory.get("soft") is not None else 0
        if memory:
            out["memory_ms"] = memory["ms"]
            out["memory_cached"] = memory["cached"]
        return out

    async def chat(self, messages: list[dict], max_tokens: int = 96, kind: str = "summary") -> str:
        await self._ready()
        out = await self.engine.generate({"messages": messages, "max_tokens": max_tokens})
        return out["text"]

    def embed_ids(self, ids: list[int]):
        import torch

        return self.table[torch.as_tensor(ids, dtype=torch.long)]

    def stats(self) -> dict:
        return dict(self.engine.stats)

    def busy(self) -> dict:  # the upstream's time is its own: nothing measured here
        return {}

    async def check_health(self) -> None:
        await self.engine.check_health()

    async def reset_prefix_cache(self) -> None:  # the upstream's cache is its own
        return None


@serve.deployment(name="Embedder", max_ongoing_requests=64)
class Embedder:
    """Key embeddings of step texts (all-MiniLM-L6-v2, or the hashing embedder for tiny setups)."""

    def __init__(self, kind: str = "minilm", device: str = "cpu"):
        if kind == "minilm":
            # deferred: loads torch
            from palimpsest.models.embedder import MiniLMEmbedder

            self.model = MiniLMEmbedder(device=device)
        else:

            self.model = HashingEmbedder()
        self._lock = asyncio.Lock()

    def info(self) -> dict:
        return {"name": self.model.name}

    async def embed(self, texts: list[str]):
        async with self._lock:  # one batch at a time: the model is not re-entrant and batches are faster
            return await asyncio.to_thread(self.model.embed, list(texts))


@serve.deployment(name="Summarizer", max_ongoing_requests=16)
class Summarizer:
    """Detailed, brief and structured summaries by the actor model (the rule writer as the floor)."""

    def __init__(self, cfg: dict, actor, model_name: str = "actor"):
        self.cfg = SummarizerConfig.model_validate(cfg)
        self.actor = actor
        self.rule = RuleSummarizer()

        async def generate(messages: list[dict]) -> str:
            return await self.actor.chat.remote(messages, self.cfg.max_tokens)

        self.llm = LLMSummarizer(generate, model_name, self.cfg.timeout_s, self.cfg.max_input_chars)

    def info(self) -> dict:
        return {"mode": self.cfg.mode, "name": self.llm.name if self.cfg.mode == "llm" else self.rule.name,
                "version": self.llm.version if self.cfg.mode == "llm" else self.rule.version}

    async def summarize(self, record: dict) -> dict:
        step = StepRecord(**record)
        if self.cfg.mode == "llm":
            s, producer, version = await self.llm.summarize(step)
        else:
            s, producer, version = self.rule.summarize(step), self.rule.name, self.rule.version
        return {"abstraction": s.abstraction.to_json(), "detailed": s.detailed, "brief": s.brief,
                "producer": producer, "version": version}


def summaries_from_wire(d: dict) -> Summaries:
    return Summaries(Abstraction.from_json(d["abstraction"]), d["detailed"], d["brief"])


@serve.deployment(name="MemoryEncoder", max_ongoing_requests=16)
class MemoryEncoder:
    """REMORY soft spans for compiled prompts, cached per (model, what the memory reads): a turn whose plan
    leaves out the same steps as an earlier one reuses its span.

    It holds every memory model the arms use (``default`` and per-arm ones) over one frozen actor copy, so an
    A/B test can compare two memory models as well as memory against none."""

    def __init__(self, actor_path: str, models: dict[str, str | None], device: str = "cpu",
                 max_history_tokens: int = 1024, cache_size: int = 4096):

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

                meta = memory_meta(ref)
                data = meta.get("data") or {}
                net = encoders[ref].memory.cfg  # how many soft positions a read yields (TurnService.soft_positions)
                entry.update(enabled=True, max_slots=encoders[ref].slots_for(max_history_tokens),
                             block_size=net.block_size, queries=net.queries,
                             # what it was trained with: the ingress warns when an arm serves it otherwise
                             policy_hash=(meta.get("policy") or {}).get("hash"),
                             trained_reads={k: data.get(k) for k in ("memory_tokens", "max_observation_chars",
                                                                     "memory_read")},
                             trained_budget=data.get("budget"))
            else:
                entry["model"] = None
            self.models[key] = entry
        self.encoders = {k: encoders[e["model"]] for k, e in self.models.items() if e["enabled"]}
        self.cache: OrderedDict[tuple[str, str, str], Any] = OrderedDict()
        self.cache_size = cache_size
        self._lock = asyncio.Lock()
        self._score_lock = asyncio.Lock()
        self.actor_path, self.device, self._actor = actor_path, device, None
        self.hits = self.misses = 0
        self.busy: dict[str, dict] = {}
        self._prefixes: OrderedDict[str, tuple] = OrderedDict()  # reference prefills the shadow lane shares
        self.prefix_cache_size = 3

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
        top-1 agreement, averaged over the reply (``serving.shadow.fidelity``). Only the reply positions' logits
        are computed (vLLM's prompt log-probabilities cover every prompt position and refuse prompt embeds).
        ``threads``: torch threads for this scoring (the lane passes ``ab.shadow_threads`` while no turn is in
        flight); None: the replica's own."""
        import torch


        span = (await self.encode(key, session_id, history, summary))["soft"] if key is not None else None
        actor = self._scorer()
        n = len(reply)

        def run() -> tuple[float, float]:
            t0 = time.perf_counter()
            before = torch.get_num_threads()
            if threads:
                torch.set_num_threads(threads)
            try:
                return scored(t0)
            finally:
                torch.set_num_threads(before)

        def scored(t0: float) -> tuple[float, float]:
            with torch.no_grad():
                dev = next(actor.model.parameters()).device
                ids = lambda xs: torch.as_tensor(xs, dtype=torch.long, device=dev)  # noqa: E731
                if span is None:
                    student = actor(input_ids=ids(context + bridge + reply)[None], last=n + 1)[0, :n]
                else:
                    head = actor.embed(ids(context))
                    embeds = torch.cat([head, span.to(dev, head.dtype), actor.embed(ids(bridge + reply))])[None]
                    student = actor(inputs_embeds=embeds, last=n + 1)[0, :n]
                teacher, reused = self._teacher(actor, reference, reply, ids)
                result = fidelity(student, teacher)
            # positions run through the actor: the student's prompt and reply, the reply after the reference, and
            # the reference itself unless another arm's sample prefilled it
            self._busy("shadow", time.perf_counter() - t0, len(context) + len(bridge) + n
                       + (int(span.shape[0]) if span is not None else 0) + n + (0 if reused else len(reference)))
            return result

        async with self._score_lock:  # one scoring at a time; never holds the turn path's encode lock
            return await asyncio.to_thread(run)

    def _teacher(self, actor, reference: list[int], reply: list[int], ids):
        """The reference's logits at each reply token, and whether its prefill was reused. The reference's prefill is kept (a few, least recently used
        dropped): every arm of a paired trajectory is scored against the same reference at the same turn, so it
        is computed once and each arm's reply continues from it."""
        import torch

        key = hashlib.sha256(json.dumps(reference).encode()).hexdigest()
        reused = key in self._prefixes
        if reused:
            self._prefixes.move_to_end(key)
            past, last = self._prefixes[key]
        else:
            past, last = actor.prefill(ids(reference))
            self._prefixes[key] = (past, last)
            while len(self._prefixes) > self.prefix_cache_size:
                self._prefixes.popitem(last=False)
        if len(reply) == 1:
            return last[None], reused
        return torch.cat([last[None], actor.continue_from(past, len(reference), ids(reply[:-1]))]), reused

    def _busy(self, kind: str, seconds: float, tokens: int) -> None:
        b = self.busy.setdefault(kind, {"calls": 0, "seconds": 0.0, "tokens": 0})
        b["calls"] += 1
        b["seconds"] += seconds
        b["tokens"] += tokens

    def stats(self) -> dict:
        """Where this replica's model time went: memory encoding and shadow scoring (calls, seconds, positions)."""
        return {k: dict(v) for k, v in self.busy.items()}

    def _scorer(self):
        """The frozen actor the memories read with, or (no memory model loaded) one loaded on first use."""
        if self.encoders:
            return next(iter(self.encoders.values())).actor
        if self._actor is None:
            # deferred: loads torch
            from palimpsest.models.actor import FrozenActor

            self._actor = FrozenActor.from_pretrained(self.actor_path, device=self.device)
        return self._actor


def deployment_env() -> dict[str, str]:
    """Variables every replica needs (Ray passes them through runtime_env)."""
    keys = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "PALIMPSEST_CACHE", "MLFLOW_TRACKING_URI", "VLLM_CACHE_ROOT",
            "HF_HOME", "VLLM_CPU_KVCACHE_SPACE", "VLLM_ENABLE_V1_MULTIPROCESSING", "PALIMPSEST_MLFLOW_ARTIFACTS",
            "MLFLOW_DISABLE_TELEMETRY", "DO_NOT_TRACK", "TORCH_EXTENSIONS_DIR")
    env = {k: os.environ[k] for k in keys if k in os.environ}
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TRANSFORMERS_OFFLINE", "1")
    return env
