"""A remote actor: an upstream OpenAI-compatible server (a team's own vLLM fleet, or any endpoint) in place
of the in-process vLLM engine. Palimpsest then is a context-management gateway in front of it.

- Text turns send the compiled messages (with the session's tools) to the upstream's
  ``/v1/chat/completions``. The upstream applies its own chat template; the budget is counted with the
  tokenizer of the local model folder named as ``actor.model`` (the same model's files).
- Soft-memory turns need an upstream vLLM started with ``--enable-prompt-embeds``: the span
  ``E[context] + soft + E[bridge]`` (from the local folder's embedding table) goes to ``/v1/completions``
  as ``prompt_embeds``. The capability is probed at start-up and reported by ``/readyz``.
- Every call has a time-out. Probes are retried (bounded, with backoff); a generation is retried only
  when the connection was never made (nothing reached the upstream). An upstream that stays down is
  :class:`UpstreamUnavailable`, which the ingress answers with a 503.

No Ray here: the ``RemoteActor`` deployment in :mod:`palimpsest.serving.models.deployments` wraps this class.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import os
import time
from typing import Any, AsyncIterator

from palimpsest.platform.prompt.tokens import for_template
from palimpsest.platform.types import ConfigError, PalimpsestError
from palimpsest.serving.models.tools import call_id


class UpstreamUnavailable(PalimpsestError):
    """The upstream actor did not answer (down, unreachable, or timing out)."""


class UpstreamError(PalimpsestError):
    """The upstream answered with an error."""

    def __init__(self, status: int, message: str):
        super().__init__(f"the upstream actor answered {status}: {message[:300]}")
        self.status = status


def encode_embeds_b64(tensor) -> str:
    """vLLM's wire form of ``prompt_embeds``: base64 of ``torch.save``."""
    import torch

    buf = io.BytesIO()
    torch.save(tensor.contiguous(), buf)
    return base64.b64encode(buf.getvalue()).decode()


class RemoteEngine:
    def __init__(self, cfg, local_path: str, table=None):
        import httpx

        self.cfg, self.remote = cfg, cfg.remote
        self.path = local_path
        self.url = self.remote.url.rstrip("/")
        key = os.environ.get(self.remote.api_key_env) if self.remote.api_key_env else None
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        self.client = httpx.AsyncClient(base_url=self.url, headers=headers,
                                        timeout=httpx.Timeout(self.remote.timeout_s,
                                                              connect=self.remote.connect_timeout_s))
        self.table = table  # the local folder's input embeddings, for soft-memory turns
        self.model: str | None = self.remote.model
        self.max_model_len = cfg.max_model_len
        self.prompt_embeds = False
        self.stats = {"requests": 0, "embeds_requests": 0, "prompt_tokens": 0, "cached_tokens": 0, "retries": 0}

    # -- calls ---------------------------------------------------------------------------------

    async def _call(self, method: str, path: str, idempotent: bool, **kw):
        """One HTTP call with bounded retries: any failure of an idempotent call, a connection never made
        otherwise."""
        import httpx

        attempts = 1 + self.remote.retries
        last: Exception | None = None
        for k in range(attempts):
            try:
                r = await self.client.request(method, path, **kw)
            except (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout) as e:  # nothing was sent
                last = e
            except httpx.HTTPError as e:
                if not idempotent:
                    raise UpstreamUnavailable(f"the upstream actor at {self.url} failed mid-request: "
                                              f"{type(e).__name__}") from None
                last = e
            else:
                if r.status_code >= 500 and idempotent and k + 1 < attempts:
                    last = UpstreamError(r.status_code, r.text)
                else:
                    return r
            if k + 1 < attempts:
                self.stats["retries"] += 1
                await asyncio.sleep(min(0.25 * 2 ** k, 2.0))
        raise UpstreamUnavailable(f"the upstream actor at {self.url} is unavailable after {attempts} attempts "
                                  f"({type(last).__name__}: {last})")

    @staticmethod
    def _check(r) -> dict:
        if r.status_code >= 400:
            raise UpstreamError(r.status_code, r.text)
        return r.json()

    async def start(self, hidden_size: int) -> None:
        """Probe the upstream: its model (and window), and whether it takes prompt embeds."""
        models = self._check(await self._call("GET", "/v1/models", True))
        names = [m.get("id") for m in models.get("data", [])]
        if self.model is None:
            if not names:
                raise ConfigError(f"actor.remote: {self.url} serves no model")
            self.model = names[0]
        elif self.model not in names:
            raise ConfigError(f"actor.remote.model: {self.model!r} is not served by {self.url} (it serves {names})")
        card = next(m for m in models["data"] if m.get("id") == self.model)
        upstream_len = card.get("max_model_len")
        if isinstance(upstream_len, int) and upstream_len < self.max_model_len:
            raise ConfigError(f"actor.max_model_len={self.max_model_len} exceeds the upstream's window of "
                              f"{upstream_len}")
        self.prompt_embeds = await self._probe_embeds(hidden_size)

    async def _probe_embeds(self, hidden_size: int) -> bool:
        import torch

        body = {"model": self.model, "prompt_embeds": encode_embeds_b64(torch.zeros(1, hidden_size)),
                "max_tokens": 1, "temperature": 0.0}
        r = await self._call("POST", "/v1/completions", True, json=body)
        return r.status_code == 200

    # -- generation ----------------------------------------------------------------------------

    def _sampling(self, request: dict) -> dict:
        out = {"max_tokens": request.get("max_tokens") or self.cfg.max_tokens,
               "temperature": request.get("temperature") if request.get("temperature") is not None else 0.0}
        for k in ("seed", "top_p", "stop"):
            if request.get(k) is not None:
                out[k] = request[k]
        return out

    def _chat_body(self, request: dict, stream: bool) -> dict:
        messages = [dict(m) for m in request["messages"]]
        tools = messages[0].pop("tools", None) if messages else None
        body: dict[str, Any] = {"model": self.model, "messages": messages, **self._sampling(request)}
        if tools and request.get("tools"):  # the upstream reads tool calls itself
            body["tools"] = tools
            body["tool_choice"] = request.get("tool_choice") or "auto"
            if request.get("parallel_tool_calls") is not None:
                body["parallel_tool_calls"] = request["parallel_tool_calls"]
        else:  # declarations and earlier calls written into the text: nothing the agent sent is dropped
            if tools:
                messages[0]["tools"] = tools
            body["messages"], _ = for_template(messages, "")
        if stream:
            body["stream"] = True
            body["stream_options"] = {"include_usage": True}
        return body

    def _embeds_body(self, request: dict, memory: dict, stream: bool) -> dict:
        import torch

        if not self.prompt_embeds:
            raise ConfigError("this arm needs soft memory, and the upstream actor does not take prompt embeds "
                              "(start vLLM with --enable-prompt-embeds)")
        ids = lambda xs: self.table[torch.as_tensor(list(xs), dtype=torch.long)]  # noqa: E731
        embeds = torch.cat([ids(request["context"]), memory["soft"].float(), ids(request.get("bridge", []))], 0)
        body = {"model": self.model, "prompt_embeds": encode_embeds_b64(embeds), **self._sampling(request)}
        if stream:
            body["stream"] = True
            body["stream_options"] = {"include_usage": True}
        return body

    async def stream(self, request: dict, memory: dict | None = None, live: bool = True) -> AsyncIterator[dict]:
        """Events as :meth:`palimpsest.serving.models.engine.ActorEngine.stream` gives them (``delta``/``content``,
        then the result with ``done``); ``live=False`` asks the upstream for one whole reply."""
        soft = memory.get("soft") if memory else None
        chat = soft is None or soft.shape[0] == 0  # a closed span gate sends nothing: the text alone
        body = self._chat_body(request, live) if chat else self._embeds_body(request, memory, live)
        path = "/v1/chat/completions" if chat else "/v1/completions"
        t0 = time.perf_counter()
        text, calls, usage, finish, matched = [], {}, {}, None, None
        if not live:
            data = self._check(await self._call("POST", path, False, json=body))
            choice = data["choices"][0]
            msg = choice.get("message") or {}
            text.append(msg.get("content") or choice.get("text") or "")
            for k, c in enumerate(msg.get("tool_calls") or []):
                calls[k] = {**c, "id": c.get("id") or call_id()}
            usage, finish = data.get("usage") or {}, choice.get("finish_reason")
            matched = choice.get("stop_reason")
        else:
            async for data in self._sse(path, body):
                if data.get("error") or data.get("object") == "error":
                    err = data.get("error") if isinstance(data.get("error"), dict) else data
                    raise UpstreamError(int(err.get("code") or 502) if str(err.get("code") or "").isdigit() else 502,
                                        str(err.get("message") or data)[:300])
                if data.get("usage"):
                    usage = data["usage"]
                for choice in data.get("choices") or []:
                    delta = choice.get("delta") or {}
                    piece = delta.get("content") if chat else choice.get("text")
                    for tc in delta.get("tool_calls") or []:
                        cur = calls.setdefault(tc.get("index", 0), {"id": None, "type": "function",
                                                                    "function": {"name": "", "arguments": ""}})
                        cur["id"] = tc.get("id") or cur["id"]
                        fn = tc.get("function") or {}
                        cur["function"]["name"] += fn.get("name") or ""
                        cur["function"]["arguments"] += fn.get("arguments") or ""
                    finish = choice.get("finish_reason") or finish
                    matched = choice.get("stop_reason") or matched  # vLLM's: the stop string matched
                    if piece:
                        text.append(piece)
                        yield {"delta": piece, "content": piece}
        if live and finish is None:
            raise UpstreamUnavailable(f"the upstream actor at {self.url} ended its stream without a finish reason")
        for c in calls.values():
            c["id"] = c.get("id") or call_id()
        ms = (time.perf_counter() - t0) * 1000
        prompt = int(usage.get("prompt_tokens") or 0)
        cached = int(((usage.get("prompt_tokens_details") or {}).get("cached_tokens")) or 0)
        self.stats["requests"] += 1
        self.stats["embeds_requests"] += int(not chat)
        self.stats["prompt_tokens"] += prompt
        self.stats["cached_tokens"] += cached
        tool_calls = [calls[k] for k in sorted(calls)]
        content = "".join(text)
        yield {"done": True, "text": content, "content": content if content or not tool_calls else None,
               "tool_calls": tool_calls, "token_ids": [], "completion_tokens": int(usage.get("completion_tokens") or 0),
               "prompt_tokens": prompt, "cached_tokens": cached, "finish_reason": finish,
               "stop_sequence": matched if isinstance(matched, str) else None, "actor_ms": ms}

    async def _sse(self, path: str, body: dict) -> AsyncIterator[dict]:
        import httpx

        try:
            async with self.client.stream("POST", path, json=body) as r:
                if r.status_code >= 400:
                    raise UpstreamError(r.status_code, (await r.aread()).decode(errors="replace"))
                async for line in r.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    payload = line[5:].strip()
                    if payload == "[DONE]":
                        return
                    try:
                        doc = json.loads(payload)
                    except ValueError:
                        raise UpstreamError(502, f"an event that is not JSON: {payload[:120]!r}") from None
                    yield doc
        except (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout) as e:
            raise UpstreamUnavailable(f"the upstream actor at {self.url} is unavailable ({type(e).__name__})") from None
        except httpx.HTTPError as e:
            raise UpstreamUnavailable(f"the upstream actor at {self.url} failed mid-stream "
                                      f"({type(e).__name__})") from None

    async def generate(self, request: dict, memory: dict | None = None) -> dict:
        final = None
        async for event in self.stream(request, memory, live=False):
            final = event
        return final

    async def check_health(self) -> None:
        self._check(await self._call("GET", "/v1/models", True))

    async def close(self) -> None:
        await self.client.aclose()
