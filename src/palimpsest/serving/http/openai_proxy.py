"""The OpenAI-compatible routes' logic and wire format: ``/v1/chat/completions`` (the history recorded in its
session by ``sessions.record_chat``, read by ``openai_protocol``; the reply as a ``chat.completion`` or as
chunks), ``/v1/completions`` (a raw completion from a prompt or from client-supplied ``prompt_embeds``) and
``/v1/models``. Errors are OpenAI's (``serving/http/errors.py``); ``ingress.py`` holds the routes.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse

from palimpsest.serving.http import sessions
from palimpsest.serving.http.errors import openai_error
from palimpsest.serving.http.schemas import RECORDED, ChatIn, CompletionIn
from palimpsest.serving.http.server import SESSION_HEADER, HTTPProblem, Tenant, _retriable_error, stream_turn, unsent
from palimpsest.serving.models.embeds import decode_embeds
from palimpsest.serving.turn.request import TurnRequest

# -- the OpenAI wire format of a served turn  ------------------------------


def extension(ext: str, turn) -> dict:
    """Palimpsest's own fields beside the OpenAI ones (``palimpsest`` in a reply): arm, plan, tokens, latency."""
    return {"session_id": ext, "arm": turn.arm, "t": turn.t, "plan": turn.plan, "tokens": turn.tokens,
            "latency_ms": turn.latency_ms, "glimpses": turn.glimpses}


def finish(turn) -> str:
    return "tool_calls" if turn.tool_calls else (turn.finish_reason or "stop")


def usage(turn) -> dict:
    """Every generation of the turn (a glimpse round is one more), and what the compiled context saved."""
    return {"prompt_tokens": turn.tokens["prompt_total"], "completion_tokens": turn.tokens["completion"],
            "total_tokens": turn.tokens["prompt_total"] + turn.tokens["completion"],
            # as the OpenAI API reports it: prompt tokens the actor's prefix cache served
            "prompt_tokens_details": {"cached_tokens": int(turn.tokens.get("cached_total", turn.tokens["cached"]))},
            "context_tokens_saved": max(turn.tokens["full_history_estimate"] - turn.tokens["context"], 0)}


def completion(turn, head: dict, ext: str) -> dict:
    """A ``chat.completion`` object for a served turn (``head``: id, created, model)."""
    message = {"role": "assistant", "content": turn.content}
    if turn.tool_calls:
        message["tool_calls"] = turn.tool_calls
    return {**head, "object": "chat.completion",
            "choices": [{"index": 0, "message": message, "finish_reason": finish(turn), "logprobs": None}],
            "usage": usage(turn), "palimpsest": extension(ext, turn)}


class ChunkWriter:
    """Server-sent events in OpenAI's chunk format for one streamed turn: the role, content deltas of the final
    answer, tool calls, the finish reason, usage if asked, ``[DONE]`` (``server.stream_turn`` drives it)."""

    def __init__(self, head: dict, ext: str, include_usage: bool):
        self.head, self.ext, self.include_usage = head, ext, include_usage
        self.sent = ""  # the answer's text streamed so far

    def chunk(self, delta: dict, finish_reason: str | None = None, **extra) -> str:
        body = {**self.head, "object": "chat.completion.chunk",
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}], **extra}
        return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

    def opening(self) -> list[str]:
        return [self.chunk({"role": "assistant", "content": ""})]

    def started(self, info: dict) -> list[str]:  # OpenAI's chunks carry no usage until the end
        return []

    def ping(self) -> list[str]:  # the chunk format has no keep-alive event
        return []

    def text(self, text: str) -> list[str]:
        self.sent += text
        return [self.chunk({"content": text})]

    def closing(self, turn) -> list[str]:
        # content the tool parser held back as possible call markup, then gave back (a call that never closed)
        rest = unsent(turn.content, self.sent)
        out = self.text(rest) if rest else []
        if turn.tool_calls:
            out.append(self.chunk({"tool_calls": [{"index": k, **c} for k, c in enumerate(turn.tool_calls)]}))
        out.append(self.chunk({}, finish(turn), palimpsest=extension(self.ext, turn)))
        if self.include_usage:
            body = {**self.head, "object": "chat.completion.chunk", "choices": [], "usage": usage(turn)}
            out.append(f"data: {json.dumps(body, ensure_ascii=False)}\n\n")
        return out

    def error(self, code: int, message: str) -> list[str]:  # the status line is sent: the error is an event
        return [f"data: {json.dumps({'error': openai_error(code, message)}, ensure_ascii=False)}\n\n"]

    def ending(self) -> list[str]:
        return ["data: [DONE]\n\n"]


# -- the routes' logic ------------------------------------------------------------------------------------


def window(replica) -> dict:
    """What a client needs to know of the served window: the actor's (``max_model_len``), the per-turn context
    budget a turn is compiled to, the reply's default cap, and the watermarks of the default arm's compaction
    epochs in tokens (a prompt that would pass ``high_tokens`` is compacted to ``low_tokens``). The ledger keeps
    every step, so a client's history may grow past all of them: the gateway compacts, the client need not."""
    cfg = replica.cfg
    arm = max(cfg.arms, key=lambda a: a.weight)  # the arm most sessions get
    budget = arm.budget or cfg.budget
    compaction = arm.policy_config().compaction
    return {"max_model_len": int(replica.actor_info["max_model_len"]), "budget": int(budget),
            "max_output_tokens": int(cfg.actor.max_tokens), "arm": arm.name,
            "compaction": {"mode": compaction.mode, "high_tokens": int(compaction.high * budget),
                           "low_tokens": int(compaction.low * budget)}}


def models(replica) -> dict:
    """OpenAI's model list, with vLLM's ``max_model_len`` and Palimpsest's window beside it (``palimpsest``)."""
    info = window(replica)
    return {"object": "list", "data": [{"id": replica.actor_info["model"], "object": "model", "created": 0,
                                        "owned_by": "palimpsest", "max_model_len": info["max_model_len"],
                                        "palimpsest": info}]}


async def chat_completions(replica, tenant: Tenant, body: ChatIn, request: Request):
    """``POST /v1/chat/completions``: the history recorded, the turn served, the reply whole or streamed."""
    replica.check_model(body.model)
    ext = request.headers.get(SESSION_HEADER) or body.user
    if not ext:
        raise HTTPProblem(400, f"user: name the session (the {SESSION_HEADER!r} header or the 'user' field)")
    sid = await sessions.record_chat(replica, body, tenant, ext, request)
    # bookkeeping fields change nothing the actor does: recorded with the turn, as is a user the header overrode
    noted = {k: json.dumps(v, sort_keys=True, ensure_ascii=False) for k, v in (body.model_extra or {}).items()
             if k in RECORDED and v is not None}
    if body.user and body.user != ext:
        noted["user_named"] = body.user
    stop = [body.stop] if isinstance(body.stop, str) else body.stop
    req = TurnRequest(sid, max_tokens=body.max_completion_tokens or body.max_tokens, seed=body.seed,
                      top_p=body.top_p, stop=stop, temperature=replica.cfg.actor.sampling_temperature(body.temperature),
                      tool_choice=body.tool_choice if body.tools else None,
                      parallel_tool_calls=body.parallel_tool_calls, noted=noted)
    head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": replica.actor_info["model"]}
    if body.stream:  # what can be refused is refused before the 200 status line is sent
        await replica.check_turn(req)
        writer = ChunkWriter(head, ext, bool((body.stream_options or {}).get("include_usage")))

        def run(emit, started):
            return replica.turn(req, emit=emit)

        return StreamingResponse(stream_turn(run, writer, replica.gone), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    turn = await replica.turn(req)
    return completion(turn, head, ext)


async def completions(replica, tenant: Tenant, body: CompletionIn) -> dict:
    """``POST /v1/completions``: a raw completion from ``prompt`` or from ``prompt_embeds`` (base64 of
    ``torch.save``; a tenant must be allowed to send them), checked against the actor's size and window."""
    replica.check_model(body.model)
    if (body.prompt is None) == (body.prompt_embeds is None):
        raise HTTPProblem(400, "prompt: give exactly one of prompt or prompt_embeds")
    if body.prompt_embeds is not None and not tenant.allow_prompt_embeds:
        raise HTTPProblem(403, "prompt_embeds: client-supplied prompt_embeds are not enabled for this caller "
                               "(auth.tenants.<name>.allow_prompt_embeds, or limits.allow_prompt_embeds "
                               "without tenants)")
    info, cfg = replica.actor_info, replica.cfg
    req: dict[str, Any] = {"max_tokens": body.max_tokens or cfg.actor.max_tokens, "temperature": body.temperature,
                           "seed": body.seed}
    if body.prompt_embeds is not None:
        req["embeds"] = decode_embeds(body.prompt_embeds, info["hidden_size"],
                                      min(info["max_embeds_len"], info["max_model_len"] - req["max_tokens"]),
                                      cfg.limits.max_request_bytes)
    else:
        ids = replica.runtime.ledger.tokenizer.encode(body.prompt)
        if not ids:
            raise HTTPProblem(400, "prompt: the prompt is empty")
        if len(ids) + req["max_tokens"] > info["max_model_len"]:
            raise HTTPProblem(422, f"prompt: the prompt has {len(ids)} tokens; with max_tokens={req['max_tokens']} "
                                   f"it exceeds the actor's window of {info['max_model_len']}")
        req["ids"] = ids
    try:
        out = await replica.actor.generate.remote(req)
    except Exception as e:
        if _retriable_error(e):
            raise HTTPProblem(503, f"the actor is unavailable ({type(e).__name__}); retry shortly") from None
        raise
    return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
            "model": info["model"],
            "choices": [{"index": 0, "text": out["text"], "token_ids": out["token_ids"],
                         "finish_reason": out["finish_reason"] or "stop",
                         **({"stop_reason": out["stop_sequence"]} if out.get("stop_sequence") else {})}],
            "usage": {"prompt_tokens": out["prompt_tokens"], "completion_tokens": len(out["token_ids"]),
                      "total_tokens": out["prompt_tokens"] + len(out["token_ids"])}}
