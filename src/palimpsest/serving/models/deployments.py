"""The child deployments of the composed app: Embedder, Summarizer and Actor (the MemoryEncoder is
``memory_encoder.py``'s).

Each wraps one model-side class (no HTTP here; the ingress is the only place that knows HTTP). Tensors
travel between them through DeploymentHandles: the ingress awaits the memory encoder's soft span (whether the
memory sends one decides the turn's prompt: ``serving.turn.turn._with_memory``) and hands it to the actor call.
"""

from __future__ import annotations

import asyncio
import os

from ray import serve

from palimpsest.platform.embedding import HashingEmbedder
from palimpsest.platform.prompt.abstraction import Abstraction, RuleSummarizer, Summaries
from palimpsest.platform.prompt.chat import chat_ids
from palimpsest.platform.prompt.tokens import get_tokenizer
from palimpsest.platform.types import StepRecord
from palimpsest.serving.models.remote import RemoteEngine
from palimpsest.serving.models.summarizer import LLMSummarizer
from palimpsest.serving.models.tools import ToolCalling
from palimpsest.serving.serve_config import ActorConfig, SummarizerConfig


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
        from palimpsest.serving.models.engine import ActorEngine

        self.cfg = ActorConfig.model_validate(cfg)
        self.engine = ActorEngine(self.cfg, replica_rank=_replica_rank())
        self.template = self.cfg.template_source()
        # the chat template and ids of palimpsest.platform.prompt.chat
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
        if soft is not None and soft.shape[0] == 0:  # a closed span gate sends nothing: the text alone, by ids
            soft = None
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

    async def chat(self, messages: list[dict], max_tokens: int = 96, kind: str = "summary",
                   usage: bool = False) -> str | dict:
        """A helper generation (a step's summary, the ``ace`` LLM elasticizer), accounted under ``kind``; with
        ``usage``, ``{"text", "prompt_tokens", "cached_tokens", "completion_tokens"}``."""
        ids = chat_ids(self.tokenizer, messages).all[-(self.cfg.max_model_len - max_tokens - 1):]
        out = await self.engine.generate(ids=ids, max_tokens=max_tokens, kind=kind)
        return chat_usage(out, len(out.get("token_ids") or [])) if usage else out["text"]

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
        from palimpsest.serving.models.engine import load_embedding_table

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

    async def chat(self, messages: list[dict], max_tokens: int = 96, kind: str = "summary",
                   usage: bool = False) -> str | dict:
        await self._ready()
        out = await self.engine.generate({"messages": messages, "max_tokens": max_tokens})
        return chat_usage(out, int(out.get("completion_tokens") or 0)) if usage else out["text"]

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
class EmbedderDeployment:
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
class SummarizerDeployment:
    """Detailed, brief and structured summaries by the actor model (the rule writer as the floor)."""

    def __init__(self, cfg: dict, actor, model_name: str = "actor"):
        self.cfg = SummarizerConfig.model_validate(cfg)
        self.actor = actor
        self.rule = RuleSummarizer()

        async def generate(messages: list[dict]) -> dict:
            return await self.actor.chat.remote(messages, self.cfg.max_tokens, "summary", True)

        self.llm = LLMSummarizer(generate, model_name, self.cfg.timeout_s, self.cfg.max_input_chars)

    def info(self) -> dict:
        return {"mode": self.cfg.mode, "name": self.llm.name if self.cfg.mode == "llm" else self.rule.name,
                "version": self.llm.version if self.cfg.mode == "llm" else self.rule.version}

    async def summarize(self, record: dict) -> dict:
        step = StepRecord(**record)
        usage = {"calls": 0, "input": 0, "cached": 0, "generated": 0}  # the rule writer calls no model
        if self.cfg.mode == "llm":
            s, producer, version, usage = await self.llm.summarize_counted(step)
        else:
            s, producer, version = self.rule.summarize(step), self.rule.name, self.rule.version
        return {"abstraction": s.abstraction.to_json(), "detailed": s.detailed, "brief": s.brief,
                "producer": producer, "version": version, "usage": usage}


def chat_usage(out: dict, generated: int) -> dict:
    """A helper generation's text and what it cost, from the engine's result."""
    return {"text": out["text"], "prompt_tokens": int(out.get("prompt_tokens") or 0),
            "cached_tokens": int(out.get("cached_tokens") or 0), "completion_tokens": int(generated)}


def summaries_from_wire(d: dict) -> Summaries:
    return Summaries(Abstraction.from_json(d["abstraction"]), d["detailed"], d["brief"])


def deployment_env() -> dict[str, str]:
    """Variables every replica needs (Ray passes them through runtime_env)."""
    keys = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "PALIMPSEST_CACHE", "MLFLOW_TRACKING_URI", "VLLM_CACHE_ROOT",
            "HF_HOME", "VLLM_CPU_KVCACHE_SPACE", "VLLM_ENABLE_V1_MULTIPROCESSING", "PALIMPSEST_MLFLOW_ARTIFACTS",
            "MLFLOW_DISABLE_TELEMETRY", "DO_NOT_TRACK", "TORCH_EXTENSIONS_DIR")
    env = {k: os.environ[k] for k in keys if k in os.environ}
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TRANSFORMERS_OFFLINE", "1")
    return env
