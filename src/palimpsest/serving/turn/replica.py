"""One ingress replica's services, composed once its deployments answer: the ledger and runtime, the arms'
policies, the served turn (``turn.py``), background enrichment, the shadow lane, tenants, the router and the
candidates' rollout (``candidates.py``: stages read from the ledger at each refresh).

``build_app`` binds the four child deployments into the ingress, whose routes (``ingress.py``) hold a
:class:`Replica` and call into it and into each protocol's module. The composition is lazy: the first request
(or ``/readyz``) waits for it, and a failure is a 503 that the next request retries.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import hmac
import logging
import threading
import time
from typing import Callable

from fastapi import Request

from palimpsest.models.relevance_head import RelevanceResolver
from palimpsest.platform import Ledger, Runtime
from palimpsest.platform.prompt.abstraction import RuleSummarizer
from palimpsest.platform.prompt.chat import MEMORY_READ_VERSION
from palimpsest.platform.prompt.tokens import get_tokenizer
from palimpsest.platform.types import ConfigError
from palimpsest.serving.http import anthropic_protocol, server
from palimpsest.serving.http.schemas import TurnOut
from palimpsest.serving.http.server import HTTPProblem, Tenant, _retriable_error
from palimpsest.serving.metrics import Metrics
from palimpsest.serving.models.summarizer import sent_ids
from palimpsest.serving.serve_config import parse_serve_config
from palimpsest.serving.turn.candidates import CandidateService, judge, judged_candidates
from palimpsest.serving.turn.enrichment import Enrichment, HandleEmbedder
from palimpsest.serving.turn.request import TurnRequest
from palimpsest.serving.turn.router import Router
from palimpsest.serving.turn.shadow import ShadowLane
from palimpsest.serving.turn.turn import TurnService

log = logging.getLogger("palimpsest.ingress")


def memory_warnings(cfg, memory_info: dict) -> list[str]:
    """Where an arm serves a memory model otherwise than it was trained: another policy config (its hash
    differs from the one recorded with the model's samples), or reading another amount of history."""
    out = []
    models = memory_info.get("models") or {}
    for arm in cfg.arms:
        if not arm.memory:
            continue
        entry = models.get(arm.name if arm.name in models else "default") or {}
        if not entry.get("enabled"):
            continue
        mine = arm.policy_config().config_hash()
        theirs = entry.get("policy_hash")
        if theirs is None:
            out.append(f"arm {arm.name!r}: memory model {entry.get('model')} records no policy config; it may have "
                       "been trained on prompts unlike this arm's")
        elif theirs != mine:
            out.append(f"arm {arm.name!r}: its policy config (hash {mine}) differs from the one memory model "
                       f"{entry.get('model')} was trained with (hash {theirs})")
        trained_read = entry.get("memory_read_version") or 1  # none recorded: trained before it was (version 1)
        if trained_read != MEMORY_READ_VERSION:
            out.append(f"arm {arm.name!r}: memory model {entry.get('model')} was trained on version {trained_read} "
                       f"of what the memory reads, served version {MEMORY_READ_VERSION} "
                       "(platform.prompt.chat.MEMORY_READ_VERSION: retrain it)")
        budget, trained = arm.budget or cfg.budget, entry.get("trained_budget")
        if trained and trained != budget:  # the prompts leave out other steps than the ones it learned from
            out.append(f"arm {arm.name!r}: serves at budget {budget}, its memory was trained on prompts at {trained}")
    return out


class ActorChat:
    """The actor as a policy's language model (the ``ace`` LLM elasticizer): every prompt is sent at once (vLLM
    batches them), each reply waited for until the summarizer's timeout; failures are None. Policies plan in
    a worker thread, where blocking on handles is allowed.

    Every call is counted in the thread that made it until :meth:`drain` (the runtime reads it into the plan,
    and the served turn records it under its arm): calls, input ids (of them cached) and generated ids as the
    actor reported them; a call that never answered in time is ``unanswered`` and counted with the ids it sent
    (``sent(messages, max_tokens)``)."""

    max_tokens = 4  # one word: the decision

    def __init__(self, actor, timeout_s: float, sent: Callable[[list[dict], int], int] | None = None):
        self.actor, self.timeout_s, self.sent = actor, timeout_s, sent
        self._local = threading.local()

    def __call__(self, prompts: list[list[dict]]) -> list[str | None]:
        responses = [self.actor.chat.remote(p, self.max_tokens, "elasticizer", True) for p in prompts]
        deadline = time.monotonic() + self.timeout_s
        used = self._used()
        out: list[str | None] = []
        for p, r in zip(prompts, responses):
            used["calls"] += 1
            try:
                reply = r.result(timeout_s=max(0.1, deadline - time.monotonic()))
            except Exception:
                used["unanswered"] += 1
                used["input"] += self.sent(p, self.max_tokens) if self.sent is not None else 0
                out.append(None)
                continue
            for k, key in (("input", "prompt_tokens"), ("cached", "cached_tokens"), ("generated", "completion_tokens")):
                used[k] += int(reply.get(key) or 0)
            out.append(reply.get("text"))
        return out

    def _used(self) -> dict[str, int]:
        used = getattr(self._local, "used", None)
        if used is None:
            used = self._local.used = dict.fromkeys(("calls", "input", "cached", "generated", "unanswered"), 0)
        return used

    def drain(self) -> dict[str, int]:
        """This thread's calls since the last drain (and none from now)."""
        used, self._local.used = self._used(), None
        return used


class Replica:
    """What every route of one ingress replica works with (built in the deployment's constructor; the parts
    that need the children's answers are composed by :meth:`ready`)."""

    def __init__(self, config: dict, actor, embedder, summarizer, memory):
        self.cfg = parse_serve_config(config)
        self.actor, self.embedder_h, self.summarizer, self.memory = actor, embedder, summarizer, memory
        self.router = Router.of(self.cfg.arms)
        self.metrics = Metrics([a.name for a in self.cfg.arms])
        server.configure(self.cfg.limits.max_request_bytes)
        self.tenants = {t.key_sha256: (name, t.allow_prompt_embeds) for name, t in self.cfg.auth.resolved().items()}
        self._ready: asyncio.Future | None = None
        self.warnings: list[str] = []
        self.actor_info: dict = {}
        self.enrichment: Enrichment | None = None
        self.runtime: Runtime | None = None
        self.shadow: ShadowLane | None = None
        self.turns: TurnService | None = None
        self.rollouts: CandidateService | None = None
        # vLLM's Anthropic protocol takes ~8 s to import on 2 cores: imported while the other deployments start,
        # and waited for before this replica is ready (the Messages routes and the served document need it)
        self._messages_loaded = threading.Thread(target=anthropic_protocol.load, name="messages-import", daemon=True)
        self._messages_loaded.start()

    # -- start-up ---------------------------------------------------------------------------

    async def _start(self) -> None:
        info = await self.actor.info.remote()
        self.actor_info = info
        anthropic_protocol.serve_models([info["model"], self.cfg.actor.model])  # the served document's names
        served_memory = [a.name for a in self.cfg.arms if a.memory and not a.candidate_of]
        if not info.get("prompt_embeds", True) and served_memory:
            raise ConfigError(f"arms {served_memory} need soft memory, and the upstream actor at "
                              f"{info.get('remote')} does not take prompt embeds (vLLM --enable-prompt-embeds)")
        emb = await self.embedder_h.info.remote()
        self.memory_info = await self.memory.info.remote()
        self.warnings = memory_warnings(self.cfg, self.memory_info)
        judged, notes = judged_candidates(self.cfg, self.memory_info, info.get("prompt_embeds", True))
        self.warnings += notes
        for w in self.warnings:
            log.warning(w)
        self.summarizer_info = await self.summarizer.info.remote()
        # the actor's own template (or the one its config names): what the budget counts is what it receives
        tokenizer = get_tokenizer(info["tokenizer"], info.get("chat_template"))
        ledger = await asyncio.to_thread(Ledger, self.cfg.ledger, tokenizer, pool_size=self.cfg.ledger_pool_size)
        self.runtime = Runtime(ledger, embedder=HandleEmbedder(self.embedder_h, emb["name"]),
                               summarizer=RuleSummarizer(),
                               relevance=RelevanceResolver(),  # a policy's relevance predictor (MLflow), if named
                               glimpse_limit=self.cfg.limits.glimpses_per_turn,
                               chat=ActorChat(self.actor, self.cfg.summarizer.timeout_s, lambda messages, n: sent_ids(
                                   tokenizer, messages, info["max_model_len"], n)),
                               snapshot_cache_bytes=self.cfg.turns.snapshot_cache_mib << 20)
        self.policies = {a.name: self.runtime.policy(a.policy_config()) for a in self.cfg.arms}
        self.enrichment = Enrichment(self.runtime, self.policies, self.summarizer, self.summarizer_info, self.metrics,
                                     self.cfg, arm_of=lambda sid: self.arm_of(self.runtime.ledger.session(sid)))
        self.shadow = ShadowLane(self.runtime, self.cfg.ab, info["max_model_len"],
                                 busy=lambda: self.turns.inflight > 0, metrics=self.metrics)
        self.turns = TurnService(self.runtime, self.cfg, self.policies, self.actor, self.memory, info,
                                 self.memory_info, self.metrics, self.shadow, self.enqueue)
        # the candidates' stages in force before the first session is routed, then every ab.refresh_s
        self.rollouts = CandidateService(ledger, self.cfg, judged, self._stages, self.metrics, self.runtime.owner)
        await asyncio.to_thread(self.rollouts.refresh)
        self.shadow.candidates, self.shadow.judge = self.rollouts.active, functools.partial(judge, self.turns)
        self._rollout_task = asyncio.get_running_loop().create_task(self.rollouts.run())
        await asyncio.to_thread(self._messages_loaded.join)
        if anthropic_protocol.load_error() is not None:
            raise anthropic_protocol.load_error()

    async def ready(self) -> None:
        """Compose the replica's services on first use (concurrent callers wait for the one composition); a
        failure is a 503, and the next call tries again."""
        if self._ready is None:
            self._ready = asyncio.ensure_future(self._start())
        try:
            await asyncio.shield(self._ready)
        except Exception as e:
            self._ready = None
            raise HTTPProblem(503, f"not ready: {e}") from None

    def readiness(self) -> dict:
        return {"ready": True, "arms": dict(zip(self.router.names, self.router.weights)),
                "actor": self.actor_info["model"], "remote": self.actor_info.get("remote"),
                "prompt_embeds": self.actor_info.get("prompt_embeds", True), "memory": self.memory_info,
                "summarizer": self.summarizer_info, "embedder": self.runtime.embedder.name, "warnings": self.warnings,
                "shadow": self.shadow.state() if self.shadow is not None else None,
                "rollouts": self.rollouts.state() if self.rollouts is not None else {}}

    def reconfigure(self, user_config: dict) -> None:
        """`serve deploy` with new arm weights shifts traffic live (existing sessions keep their arm)."""
        weights = (user_config or {}).get("weights") or {}
        unknown = set(weights) - set(self.router.names)
        if unknown:
            raise ConfigError(f"weights for unknown arms {sorted(unknown)}")
        self.router = self.router.with_weights(weights)

    def _stages(self, stages: dict[str, str]) -> None:
        """The candidates' stages read from the ledger (``CandidateService.refresh``): routing follows them."""
        self.router = self.router.with_stages(stages)

    # -- callers, sessions and arms ---------------------------------------------------------

    def tenant(self, request: Request) -> Tenant:
        """The caller's tenant from ``Authorization: Bearer <key>`` (or ``X-API-Key``); 401 without a valid key
        when tenants are configured."""
        if not self.tenants:
            return Tenant(None, self.cfg.limits.allow_prompt_embeds)
        auth = request.headers.get("authorization", "")
        key = auth[7:].strip() if auth.lower().startswith("bearer ") else request.headers.get("x-api-key", "")
        digest = hashlib.sha256(key.encode("utf-8", "surrogateescape")).hexdigest() if key else ""
        for known, (name, embeds) in self.tenants.items():
            if digest and hmac.compare_digest(known, digest):
                return Tenant(name, embeds)
        raise HTTPProblem(401, "a valid API key is required (Authorization: Bearer <key>)")

    def check_model(self, model: str | None) -> None:
        """A request naming a model this app does not serve is a 404, as the OpenAI API and vLLM answer it.
        Served: the actor's id (``GET /v1/models``) and its configured name (``actor.model``)."""
        served = {self.actor_info["model"], self.cfg.actor.model}
        if model is not None and model not in served:
            raise HTTPProblem(404, f"model: {model!r} is not served here; the served model is "
                                   f"{self.actor_info['model']!r}")

    def enqueue(self, session_id: str) -> None:
        """The session's summaries and key embeddings, written in the background."""
        if self.enrichment is not None:
            self.enrichment.enqueue(session_id)

    async def primed(self, session_id: str, appended: list) -> None:
        """After an append: the next turn's query embeddings and the new steps' keys, before the caller returns
        (``turns.prime_on_append``), then the rest of the enrichment in the background."""
        if self.cfg.turns.prime_on_append and self.enrichment is not None:
            await self.enrichment.prime_after_append(session_id, appended, self.cfg.turns.prime_timeout_s)
        self.enqueue(session_id)

    def arm_of(self, session) -> str:
        """The arm that serves a session: the one recorded at its creation (its control once that is a withdrawn
        candidate), else the router's."""
        arm = session.meta.get("arm")
        return self.router.serving(arm) if arm in self.router.names else self.router.assign(session.id)

    def gone(self) -> None:
        """A streaming client went away before its turn ended."""
        self.metrics.errors.labels(arm="-", kind="ClientDisconnected").inc()

    # -- the turn -------------------------------------------------------------------------------

    async def turn(self, req: TurnRequest, emit=None, started=None) -> TurnOut:
        """The session's turn on its arm (``TurnService``); a replica that failed is a 503 to retry."""
        session = await asyncio.to_thread(self.runtime.ledger.session, req.session_id)
        try:
            return await self.turns.serve(session, self.arm_of(session), req, emit, started)
        except Exception as e:
            if _retriable_error(e):
                raise HTTPProblem(503, f"a model replica is unavailable ({type(e).__name__}); retry shortly") from None
            raise

    async def check_turn(self, req: TurnRequest) -> None:
        """The checks of a turn's size that need no compile (a streamed turn runs them before its 200)."""
        session = await asyncio.to_thread(self.runtime.ledger.session, req.session_id)
        pin = self.turns.resolve.pin(req.session_id)  # a tenant's pinned budget is the one the turn will run at
        self.turns.size(self.cfg.arm(self.arm_of(session)), self.turns.resolve.budget(pin, req.budget),
                        req.max_tokens)
