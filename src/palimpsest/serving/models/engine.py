"""The actor engine: vLLM's ``AsyncLLM`` with prompt embeds enabled, plus the actor's own token-embedding
table, so that ``[context ids] + [soft span] + [bridge ids]`` can be sent as one ``prompt_embeds`` tensor.

Without a soft span the engine gets plain token ids (and its prefix cache works on them); with one it
gets ``cat(E[context], soft, E[bridge])``, validated by :func:`palimpsest.serving.models.embeds.validate_embeds`.
No Ray here: the Serve deployment in :mod:`palimpsest.serving.models.deployments` wraps this class, and the
benchmarks use it directly.
"""

from __future__ import annotations

import os
import time
import uuid
from pathlib import Path
from typing import Any

import torch

from palimpsest.models.registry import resolve_actor_path
from palimpsest.platform.types import ConfigError
from palimpsest.serving.models.embeds import validate_embeds
from palimpsest.serving.serve_config import ActorConfig

_EMBED_KEYS = ("embed_tokens.weight", "wte.weight", "word_embeddings.weight", "embed_in.weight")


def load_embedding_table(path: Path) -> torch.Tensor:
    """The input-embedding matrix (V, d) read straight from the checkpoint's safetensors (no full model load)."""
    from safetensors import safe_open

    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            for key in st.keys():
                if key.endswith(_EMBED_KEYS):
                    return st.get_tensor(key).float()
    raise ConfigError(f"{path}: no input-embedding table found in its safetensors files")


def cpu_env(cfg: ActorConfig, replica_rank: int = 0) -> None:
    """vLLM-CPU settings that must exist before the engine starts (GPUs ignore them)."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", f"{max(1, int(round(cfg.kv_cache_gib)))}")
    os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    if not torch.cuda.is_available():
        # Two replicas on one node would both pin their threads to core 0: one core each, by rank, unless the
        # config gives the one replica every core.
        n = os.cpu_count() or 1
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{n - 1}" if cfg.cpu_cores == "all" and n > 1
                              else str(replica_rank % n))


class ActorEngine:
    def __init__(self, cfg: ActorConfig, replica_rank: int = 0):
        self.cfg = cfg
        self.path = resolve_actor_path(cfg.model)
        cpu_env(cfg, replica_rank)
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        on_gpu = torch.cuda.is_available()
        args = AsyncEngineArgs(
            model=str(self.path), enable_prompt_embeds=True, dtype=cfg.dtype, max_model_len=cfg.max_model_len,
            enforce_eager=not on_gpu, enable_prefix_caching=cfg.enable_prefix_caching, disable_log_stats=True,
            tensor_parallel_size=cfg.tensor_parallel_size,
            **({"gpu_memory_utilization": cfg.gpu_memory_utilization} if on_gpu else {}),
        )
        self.engine = AsyncLLM.from_engine_args(args)
        self.dtype = getattr(torch, cfg.dtype)
        self.table = load_embedding_table(self.path)  # (V, d) fp32 on the CPU: gathers are cheap
        self.hidden_size = int(self.table.shape[1])
        self.vocab_size = int(self.table.shape[0])
        self.model_name = self.path.name
        self.stats = {"requests": 0, "embeds_requests": 0, "prompt_tokens": 0, "cached_tokens": 0}
        # where the engine's time goes, by the caller's kind (turn, summary, elasticizer): see :meth:`busy`
        self.by_kind: dict[str, dict] = {}

    def embed(self, ids: list[int]) -> torch.Tensor:
        t = torch.as_tensor(ids, dtype=torch.long)
        if t.numel() and (int(t.min()) < 0 or int(t.max()) >= self.vocab_size):
            raise ConfigError(f"token ids must be within [0, {self.vocab_size})")
        return self.table[t]

    def compose(self, context: list[int], soft: torch.Tensor | None, bridge: list[int]) -> torch.Tensor:
        """(T, d) input embeddings for context + soft span + bridge, validated."""
        parts = [self.embed(context)]
        if soft is not None:
            parts.append(validate_embeds(soft, self.hidden_size, self.cfg.max_embeds_len).float())
        parts.append(self.embed(bridge))
        return validate_embeds(torch.cat(parts, 0), self.hidden_size, self.cfg.max_embeds_len, dtype=self.dtype)

    async def generate(self, **kwargs) -> dict[str, Any]:
        """Exactly one of ``ids`` or ``embeds``; returns the text, token ids, prompt/cached token counts, ms
        (the last event of :meth:`stream`)."""
        final = None
        async for event in self.stream(**kwargs):
            final = event
        return final

    async def stream(self, *, ids: list[int] | None = None, embeds: torch.Tensor | None = None,
                     max_tokens: int | None = None, temperature: float = 0.0, seed: int | None = None,
                     logprobs: int | None = None, top_p: float | None = None, stop: list[str] | None = None,
                     structured_outputs: Any = None, skip_special_tokens: bool = True, kind: str = "turn"):
        """One generation, as it happens: ``{"delta", "delta_ids"}`` events, then the whole result (``done``).
        A consumer that stops iterating (a client gone) aborts the request in the engine. ``kind`` names what
        the generation is for, in the engine's account of its time (:meth:`busy`)."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        if (ids is None) == (embeds is None):
            raise ValueError("give exactly one of ids or embeds")
        if ids is not None:
            if not ids:
                raise ConfigError("an empty prompt")
            if min(ids) < 0 or max(ids) >= self.vocab_size:
                # An out-of-range id would crash the engine for every request, not just this one.
                raise ConfigError(f"token ids must be within [0, {self.vocab_size}) (the actor's vocabulary)")
            if len(ids) + 1 > self.cfg.max_model_len:
                raise ConfigError(f"the prompt has {len(ids)} tokens; the actor's window is {self.cfg.max_model_len}")
            prompt: dict = {"prompt_token_ids": list(ids)}
        else:
            embeds = validate_embeds(embeds, self.hidden_size, self.cfg.max_embeds_len, dtype=self.dtype)
            if embeds.shape[0] + 1 > self.cfg.max_model_len:
                raise ConfigError(f"the prompt has {embeds.shape[0]} positions; "
                                  f"the actor's window is {self.cfg.max_model_len}")
            prompt = {"prompt_embeds": embeds}
        n_prompt = len(ids) if ids is not None else int(embeds.shape[0])
        limit = min(max_tokens or self.cfg.max_tokens, self.cfg.max_model_len - n_prompt)
        if limit < 1:
            raise ConfigError(f"the prompt has {n_prompt} positions: no room left to generate in "
                              f"{self.cfg.max_model_len}")
        params = SamplingParams(max_tokens=limit, temperature=temperature, seed=seed, logprobs=logprobs,
                                top_p=1.0 if top_p is None else top_p, stop=stop or None,
                                structured_outputs=structured_outputs, skip_special_tokens=skip_special_tokens,
                                output_kind=RequestOutputKind.DELTA)
        t0 = time.perf_counter()
        (p,) = await self.engine.renderer.render_cmpl_async([prompt])
        text: list[str] = []
        token_ids: list[int] = []
        steps: list = []
        cached, finish, first, matched = 0, None, None, None
        async for out in self.engine.generate(p, params, request_id=uuid.uuid4().hex):
            if first is None:
                first = time.perf_counter()
            o = out.outputs[0]
            cached = max(cached, int(out.num_cached_tokens or 0))
            text.append(o.text)
            token_ids.extend(o.token_ids)
            steps.extend(o.logprobs or [])
            finish = o.finish_reason or finish
            if isinstance(o.stop_reason, str):  # the stop string that ended it (an int is a stop token id)
                matched = o.stop_reason
            if o.text or o.token_ids:
                yield {"delta": o.text, "delta_ids": list(o.token_ids), "finished": bool(out.finished)}
        end = time.perf_counter()
        ms = (end - t0) * 1000
        first = first or end
        k = self.by_kind.setdefault(kind, {"requests": 0, "prompt_tokens": 0, "cached_tokens": 0,
                                           "completion_tokens": 0, "prefill_s": 0.0, "decode_s": 0.0})
        k["requests"] += 1
        k["prompt_tokens"] += n_prompt
        k["cached_tokens"] += cached
        k["completion_tokens"] += len(token_ids)
        k["prefill_s"] += first - t0  # to the first token: queueing + prefill of what the cache did not hold
        k["decode_s"] += end - first
        self.stats["requests"] += 1
        self.stats["embeds_requests"] += int(embeds is not None)
        self.stats["prompt_tokens"] += n_prompt
        self.stats["cached_tokens"] += cached
        result = {"done": True, "text": "".join(text), "token_ids": token_ids, "prompt_tokens": n_prompt,
                  "cached_tokens": cached, "finish_reason": finish, "stop_sequence": matched, "actor_ms": ms,
                  "prefill_ms": (first - t0) * 1000, "decode_ms": (end - first) * 1000}
        if logprobs:
            result["logprobs"] = [{int(k): float(v.logprob) for k, v in step.items()} for step in steps]
        yield result

    def busy(self) -> dict[str, dict]:
        """Per kind of generation: requests, prompt / cached / completion tokens, and request-seconds to the first
        token (queueing + prefill) and after it (decode). Requests run batched, so request-seconds of
        concurrent requests overlap: they say where the engine's work went, not wall time."""
        return {k: dict(v) for k, v in self.by_kind.items()}

    async def check_health(self) -> None:
        """Raises when the engine is dead (Serve then replaces the replica)."""
        await self.engine.check_health()

    async def reset_prefix_cache(self) -> None:
        await self.engine.reset_prefix_cache()

    def shutdown(self) -> None:
        self.engine.shutdown()
