"""One turn: append -> (enrich) -> plan -> compile -> audit, plus ``glimpse``.

The replay harness, the training-data builder and the serving ingress all drive turns through
this class, so what replay measures is what production serves.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import socket
import threading
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from palimpsest.platform.compile.budget import Budget
from palimpsest.platform.compile.compiler import ELIDE_SHARE, compile_plan
from palimpsest.platform.compile.epoch_turn import compile_epoch
from palimpsest.platform.compile.epochs import Boundary, compaction_of, epoch_key, recent_of, turn_cost
from palimpsest.platform.compile.retain import retained
from palimpsest.platform.embedding import Embedder, HashingEmbedder
from palimpsest.platform.ledger import Ledger, SessionSnapshot
from palimpsest.platform.policies import PolicyConfigBase, PolicyDeps, build_policy
from palimpsest.platform.policies.base import ContextPolicy
from palimpsest.platform.prompt.abstraction import RuleSummarizer, Summaries
from palimpsest.platform.prompt.chat import prefix_tokens
from palimpsest.platform.prompt.render import key_text, render_full_body
from palimpsest.platform.snapshot_cache import SnapshotCache
from palimpsest.platform.types import BudgetError, CompiledTurn, GlimpseLimitError, Resolution, Step, StepRecord


def _as_planned(snap: SessionSnapshot, budget: int) -> SessionSnapshot:
    """The snapshot a policy plans on: a latest step too large for the budget counts as what the compiler will
    show of it (head and tail, ``ELIDE_SHARE`` of the room), so the policy still plans the rest of the history."""
    if not snap.t:
        return snap
    room = budget - snap.prefix_tokens
    cap = int(max(room, 0) * ELIDE_SHARE)
    if snap.tokens[-1, Resolution.FULL] <= room:
        return snap
    tokens = snap.tokens.copy()
    tokens[-1, Resolution.FULL] = cap
    return dataclasses.replace(snap, tokens=tokens)


class Summarizer(Protocol):
    name: str
    version: str

    def summarize(self, step: StepRecord) -> Summaries: ...


@dataclass(frozen=True)
class EnrichResult:
    summaries: int
    keys: int


class Runtime:
    """Drives turns of any number of sessions over one ledger.

    Several runtimes (serving replicas, on one machine or many) may share a ledger: appends to one
    session are serialised by the ledger, and with ``leases`` (the default on PostgreSQL) background
    enrichment of a session runs on one of them at a time, so no step is summarised or embedded twice
    and none is left out (see :meth:`enrich`).
    """

    def __init__(self, ledger: Ledger, embedder: Embedder | None = None, summarizer: Summarizer | None = None,
                 glimpse_limit: int = 3, chat=None, leases: bool | None = None, lease_s: float = 60.0,
                 snapshot_cache_bytes: int = 512 << 20, cached_rate: float = 0.1, relevance=None):
        self.ledger = ledger
        if ledger.prefix_cost is None:  # the ledger prices a session's fixed prefix as this prompt renders it
            ledger.prefix_cost = functools.partial(prefix_tokens, ledger.tokenizer)
        # Each session's snapshot, kept current from what changed (0 reads every turn's snapshot whole)
        self.snapshots = SnapshotCache(ledger, snapshot_cache_bytes)
        self.leases = ledger.backend == "postgresql" if leases is None else leases
        self.lease_s = lease_s
        self.owner = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.embedder = embedder or HashingEmbedder()
        self.summarizer = summarizer or RuleSummarizer()
        self.glimpse_limit = glimpse_limit
        # ``relevance``: finds a relevance predictor by reference for the policies that name one (the cosine without)
        self.deps = PolicyDeps(embedder=self.embedder, tokenizer=ledger.tokenizer, chat=chat, relevance=relevance)
        self._lock = threading.Lock()
        self._boundaries: OrderedDict[int, Boundary] = OrderedDict()  # decoded boundaries by ledger row
        # The last audited turn's ids per (session, policy and budget): what a prefix cache holds of the next
        self._last_ids: OrderedDict[tuple[str, str], np.ndarray] = OrderedDict()
        self.cached_rate = cached_rate
        self._previews = threading.local()  # per thread: a preview's model calls, until the turn it precedes

    def policy(self, config: PolicyConfigBase | dict | str) -> ContextPolicy:
        return build_policy(config, self.deps)

    # -- writes -----------------------------------------------------------------------------

    def append(self, session_id: str, record: StepRecord, enrich: bool = True) -> Step:
        """Durable before it returns; enrichment (summaries, key) follows unless ``enrich=False``
        (serving enriches in the background and a turn never waits for it)."""
        step = self.ledger.append(session_id, record)
        if enrich:
            self.enrich(session_id)
        return step

    def enrich(self, session_id: str, batch: int = 64) -> EnrichResult:
        """Write every missing summary and key of a session. Safe to repeat; never touches raw steps.

        With leases, one runtime at a time enriches a session: a caller that finds the lease held
        returns at once (the holder does the work), and the holder looks for pending steps again after
        it lets go, so a step appended while it worked is not left out (its writer saw the lease held).
        """
        if not self.leases:
            return self._enrich(session_id, batch, None)
        name = f"enrich/{session_id}/{self.summarizer.name}:{self.summarizer.version}/{self.embedder.name}"
        done = EnrichResult(0, 0)
        while self.ledger.claim(name, self.owner, self.lease_s):
            try:
                r = self._enrich(session_id, batch, name)
            finally:
                self.ledger.release(name, self.owner)
            done = EnrichResult(done.summaries + r.summaries, done.keys + r.keys)
            if not any(self._pending(session_id)):
                break
        return done

    def _pending(self, session_id: str):
        return self.ledger.pending(session_id, self.embedder.name, (self.summarizer.name, self.summarizer.version))

    def _enrich(self, session_id: str, batch: int, lease: str | None) -> EnrichResult:
        no_sum, no_key = self._pending(session_id)
        for i, step in enumerate(no_sum):
            if lease and i and i % batch == 0:
                self.ledger.claim(lease, self.owner, self.lease_s)  # renew while working
            self.ledger.add_summaries(session_id, step.id, self.summarizer.summarize(step.record()),
                                      self.summarizer.name, self.summarizer.version)
        for i in range(0, len(no_key), batch):
            if lease:
                self.ledger.claim(lease, self.owner, self.lease_s)
            chunk = no_key[i: i + batch]
            vectors = self.embedder.embed([key_text(s) for s in chunk])
            self.ledger.add_keys(session_id, [s.id for s in chunk], self.embedder.name, vectors)
        return EnrichResult(len(no_sum), len(no_key))

    def missing_keys(self, session_id: str) -> int:
        """How many of the session's steps have no key of this runtime's embedder yet."""
        snap = self.snapshot(session_id)
        return int(snap.t - np.count_nonzero(snap.has_key))

    def await_keys(self, session_id: str, timeout_s: float, poll_s: float = 0.05) -> bool:
        """Write the session's missing keys (``enrich``), or wait for the runtime holding its enrichment lease to
        write them, up to ``timeout_s``; returns whether none is missing. An unavailable embedder raises
        (the caller plans without keys)."""
        deadline = time.monotonic() + timeout_s
        while True:
            self.enrich(session_id)
            if not self.missing_keys(session_id):
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(poll_s)

    # -- turns ------------------------------------------------------------------------------

    def snapshot(self, session_id: str, at: int | None = None) -> SessionSnapshot:
        """The session as of now (from the snapshot cache: only what changed since the last turn is read), or
        as it stood before step ``at`` (read from the ledger, with the audit of that time)."""
        if at is None:
            return self.snapshots.get(session_id, self.embedder.name)
        return self.ledger.snapshot(session_id, upto=at, key_model=self.embedder.name)

    def compile(self, snap: SessionSnapshot, policy: ContextPolicy, budget: Budget,
                boundary: Boundary | None = None) -> CompiledTurn:
        """Plan and compile over a snapshot, with no side effect (the pure part of a turn). The prompt's ids
        plus the reserve (the reply's max_tokens and any soft positions) fit the
        :class:`~palimpsest.platform.compile.budget.Budget`.

        A policy in compaction epochs (``compaction.mode: epochs``, platform.compile.epochs) extends ``boundary``, the
        session's last one (None: the session's start), and plans anew only when the extension would pass
        the high watermark; the turn then carries the new boundary (``compacted``)."""
        if not isinstance(budget, Budget):
            raise BudgetError(f"budget: Runtime.compile takes a Budget (total, reply, soft), not {budget!r}")
        limit = budget
        epochs = compaction_of(policy)
        retain = getattr(getattr(policy, "cfg", None), "retain", None)  # a client's context edit (context_edits)

        def plan_at(b: int):
            return retained(policy.plan(_as_planned(snap, b), b), snap, retain)

        if epochs is None:
            plan = plan_at(limit.prompt)
            prompt = compile_plan(snap, plan, limit, self.ledger.tokenizer)
            self._note_calls(plan)
            return CompiledTurn(session_id=snap.session.id, t=snap.t, budget=limit.total, plan=plan, prompt=prompt,
                                snapshot=snap)
        plan, prompt, now, compacted = compile_epoch(
            snap, plan_at, limit, self.ledger.tokenizer, boundary,
            epochs, (policy.name, policy.config_hash), recent_of(policy))
        self._note_calls(plan)
        return CompiledTurn(session_id=snap.session.id, t=snap.t, budget=limit.total, plan=plan, prompt=prompt,
                            snapshot=snap, boundary=now, compacted=compacted,
                            epoch_key=epoch_key(policy.config_hash, limit))

    def _note_calls(self, plan, earlier: dict | None = None) -> None:
        """The model calls planning made in this thread (the served actor as ACE's LLM elasticizer: ``chat``'s
        ``drain``), plus ``earlier`` ones of the same turn, added to ``plan.info["model_calls"]``: calls, input ids
        (of them cached), generated ids, unanswered calls (counted with the ids they sent), and the billed input
        at the cached rate. A plan that called no model has none."""
        drain = getattr(self.deps.chat, "drain", None)
        used = dict(drain()) if drain is not None else {}
        for k, v in [*(plan.info.get("model_calls") or {}).items(), *(earlier or {}).items()]:
            if k != "billed":
                used[k] = used.get(k, 0) + v
        if used.get("calls"):
            cached = used.get("cached", 0)
            plan.info["model_calls"] = {**used, "billed": used.get("input", 0) - cached + self.cached_rate * cached}

    def boundary(self, session_id: str, key: str, at: int | None = None) -> Boundary | None:
        """The session's last compaction boundary under ``key`` (at or before step ``at``), from the ledger;
        decoded once per replica (boundaries are immutable)."""
        row = self.ledger.last_boundary(session_id, key, at)
        if row is None:
            return None
        with self._lock:  # turns run in worker threads
            cached = self._boundaries.get(row)
            if cached is not None:
                self._boundaries.move_to_end(row)
                return cached
        cached = Boundary.decode(self.ledger.boundary_blob(session_id, row), row)
        with self._lock:
            self._boundaries[row] = cached
            while len(self._boundaries) > 1024:
                self._boundaries.popitem(last=False)
        return cached

    def turn(self, session_id: str, policy: ContextPolicy | PolicyConfigBase | dict | str, budget: Budget,
             at: int | None = None, record: bool = True, keys: bool = True) -> CompiledTurn:
        """Compile the context for the next step (or for step ``at``) within ``budget`` (its total, the reply's
        reserve and the soft positions: one ``Budget``, as every caller builds it) and audit it. ``keys=False``
        plans as if no key embedding existed (the fallback when the embedder is unavailable)."""
        if not isinstance(budget, Budget):
            raise BudgetError(f"budget: Runtime.turn takes a Budget (total, reply, soft), not {budget!r}")
        limit = budget
        pol = policy if hasattr(policy, "plan") else self.policy(policy)  # type: ignore[arg-type]
        snap = self.snapshot(session_id, at)
        prev = None
        if compaction_of(pol) is not None:
            prev = self.boundary(session_id, epoch_key(pol.config_hash, limit), snap.t if at is None else at)
        planned = snap if keys else snap.without_keys()
        turn = self.compile(planned, pol, limit, boundary=prev)
        if at is None:  # a preview's model calls were made for this turn: the turn it precedes counts them
            previews = self._previews.__dict__.setdefault("calls", {})
            if record:
                self._note_calls(turn.plan, previews.pop(session_id, None))
            elif turn.plan.info.get("model_calls"):
                previews.clear()  # one session's at a time: a thread previews a turn, then serves it
                previews[session_id] = turn.plan.info["model_calls"]
        # the fold, the boundary and the audit of a turn are stored together or not at all
        with self.ledger.transaction():
            if turn.plan.new_fold and turn.plan.fold is not None and record:  # a preview's fold is worked out again
                self.ledger.add_fold(session_id, turn.plan.config_hash, turn.plan.fold)
            if turn.compacted and turn.epoch_key is not None and at is None and record:  # a preview stores nothing
                row, stored = self.ledger.add_boundary(session_id, turn.epoch_key, turn.boundary)
                if stored:
                    turn = dataclasses.replace(turn, boundary=dataclasses.replace(turn.boundary, id=row))
                    turn.plan.info["compaction"]["id"] = row
                else:  # another replica compacted this turn first: its boundary is in effect, and is served as
                    # stored (a boundary at the turn's own step is that turn's prompt: compile_epoch extends it by
                    # nothing and never compacts again)
                    winner = Boundary.decode(self.ledger.boundary_blob(session_id, row), row)
                    calls = turn.plan.info.get("model_calls")
                    turn = self.compile(planned, pol, limit, boundary=winner)
                    self._note_calls(turn.plan, calls)  # the losing plan's calls were made all the same
            if record:
                self.ledger.record_turn(turn)
        if record and at is None:
            key = (session_id, turn.epoch_key or epoch_key(pol.config_hash, limit))
            ids = np.asarray(turn.prompt.ids, dtype=np.int64)
            with self._lock:
                prev = self._last_ids.pop(key, None)
                self._last_ids[key] = ids
                while len(self._last_ids) > 1024:
                    self._last_ids.popitem(last=False)
            if prev is None and self.ledger.turns_recorded(session_id, turn.plan.config_hash, turn.budget) > 1:
                return turn  # a previous turn this replica did not serve: what the cache holds is unknown
            # a session's first turn: nothing of it is cached, every id is paid in full
            turn = dataclasses.replace(turn, cost=turn_cost(prev, ids, self.cached_rate))
        return turn

    def glimpse(self, session_id: str, step_id: int | str) -> str:
        """The raw text of a step of this session; at most ``glimpse_limit`` per turn."""
        step = self.ledger.step(session_id, step_id)  # unknown or another session's id -> UnknownStepError
        if not self.ledger.record_glimpse(session_id, step.id, self.glimpse_limit):
            raise GlimpseLimitError(f"session {session_id!r}: glimpse limit reached ({self.glimpse_limit} per turn)")
        return render_full_body(step)
