"""A replica's candidate arms (``candidate_of``): which are judged and as what, their stages read from the ledger
at each refresh (the router follows them), the rollout gate run there, and the judge the shadow lane calls.

- **Judged**: a candidate whose memory model is loaded (or that has no memory), as its policy config and memory
  model (``experiments.gate.subject_of``); one whose memory is off is not judged and keeps its configured stage.
- **Refresh** (every ``ab.refresh_s``, and once at start-up): the gate runs on each dark or canary candidate with
  new pairs (under a ledger lease, so one replica decides at a time; the ledger refuses a decision on a stale
  view), then the latest decision per candidate is read and handed to the router: every replica reads the same
  rows, and a restarted one reads them again.
- **Judge** (:func:`judge`): what the candidate would have served on a sampled turn of its control, compiled over
  the same snapshot with ``Runtime.compile`` (no audit, no boundary, no fold, no served row), its soft span, and
  its score against the control's reference over the control's reply.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Callable

from palimpsest.experiments.gate import (
    GATED,
    Judged,
    decide,
    log_decision,
    stages,
    subject_of,
    tracking_configured,
)
from palimpsest.pipelines import tracking
from palimpsest.platform.compile.epochs import compaction_of, epoch_key
from palimpsest.serving.turn.turn import turn_memory

log = logging.getLogger("palimpsest.rollouts")


def judged_candidates(cfg, memory_info: dict, prompt_embeds: bool = True) -> tuple[list[Judged], list[str]]:
    """The serve config's candidates as judged here, and a note for each one that is not (its memory is off)."""
    out, notes = [], []
    models = memory_info.get("models") or {}
    for a in cfg.arms:
        if not a.candidate_of:
            continue
        memory = None
        if a.memory:
            entry = models.get(a.name if a.name in models else "default") or {}
            if not entry.get("enabled") or not prompt_embeds:
                why = "the actor takes no prompt embeds" if entry.get("enabled") else "no memory model is loaded"
                notes.append(f"candidate {a.name!r}: {why}; it is not judged and stays {a.stage or 'dark'}")
                continue
            memory = entry.get("model")
        pc = a.policy_config()
        out.append(Judged(a.name, a.candidate_of, subject_of(pc.config_hash(), memory), a.stage or "dark",
                          pc.model_dump(mode="json"), memory))
    return out, notes


class CandidateService:
    """The candidates of one replica: their stages in force, the gate, and what the shadow lane judges."""

    def __init__(self, ledger, cfg, judged: list[Judged], on_stages: Callable[[dict[str, str]], None],
                 metrics=None, owner: str = "replica", lease_s: float = 60.0):
        self.ledger, self.cfg, self.judged, self.on_stages = ledger, cfg, judged, on_stages
        self.metrics, self.owner, self.lease_s = metrics, owner, lease_s
        self.current: dict[str, dict] = {}
        self.last: dict[str, dict] = {}  # the gate's latest answer per candidate
        self._cursor: dict[str, int] = {}  # the last pair the gate saw per candidate
        self.tracked = tracking_configured(cfg.tracking.uri)
        if cfg.tracking.uri:
            tracking.configure(cfg.tracking.uri, cfg.tracking.artifact_location)

    def active(self, control: str) -> list[Judged]:
        """The dark and canary candidates of ``control``: judged on its sampled turns."""
        return [c for c in self.judged if c.control == control
                and self.current.get(c.name, {}).get("stage", c.stage) in GATED]

    def refresh(self, gate: bool = True) -> dict[str, str]:
        """Run the gate where new pairs arrived, then read every candidate's stage and hand it to the router."""
        if gate:
            now = stages(self.ledger, self.judged)
            gated = [c for c in self.judged if now[c.name]["stage"] in GATED]
            for c in gated:
                self._gate(c, len(gated))
        self.current = stages(self.ledger, self.judged)
        found = {n: s["stage"] for n, s in self.current.items()}
        self.on_stages(found)
        if self.metrics is not None:
            self.metrics.observe_stages({n: (s["control"], s["stage"]) for n, s in self.current.items()})
        return found

    def _gate(self, c: Judged, candidates: int) -> None:
        fresh = self.ledger.shadow_pairs(c.name, c.subject, after=self._cursor.get(c.name, 0))
        if not fresh:
            return
        lease = f"rollout/{c.name}/{c.subject}"
        if not self.ledger.claim(lease, self.owner, self.lease_s):
            return  # another replica is deciding on it
        try:
            ab = self.cfg.ab
            result = decide(self.ledger, c, ab.gate_alpha, ab.gate_margin, ab.gate_min_pairs, candidates)
        except Exception as e:  # the gate unavailable or failing: the stage stands, and the next refresh retries
            log.warning("the rollout gate on %s failed: %s", c.name, e)
            self.last[c.name] = {"decision": "hold", "reason": f"error: {e}"}
            return
        finally:
            self.ledger.release(lease, self.owner)
        self._cursor[c.name] = fresh[-1]["id"]
        self.last[c.name] = {k: result.get(k) for k in ("decision", "reason", "stage", "pairs", "recorded")}
        if result.get("recorded") is None:
            return
        log.info("rollout: %s %s -> %s on %s pairs", c.name, result["decision"], result["stage"], result.get("pairs"))
        if self.metrics is not None:
            self.metrics.decisions.labels(candidate=c.name, stage=result["stage"]).inc()
        if self.tracked:
            log_decision(result, c, self.cfg.tracking.experiment)

    async def run(self) -> None:
        """Refresh every ``ab.refresh_s`` for the replica's life."""
        while True:
            await asyncio.sleep(self.cfg.ab.refresh_s)
            try:
                await asyncio.to_thread(self.refresh)
            except Exception as e:  # the ledger unreachable for a while: the stages in force stand
                log.warning("rollout refresh failed: %s", e)

    def state(self) -> dict:
        return {c.name: {"control": c.control, "subject": c.subject, "memory": c.memory,
                         "stage": self.current.get(c.name, {}).get("stage", c.stage), "gate": self.last.get(c.name)}
                for c in self.judged}


async def judge(turns, c: Judged, s, reference: list[int], threads: int | None) -> dict[str, Any]:
    """Candidate ``c`` on the control's sampled turn ``s`` (a ``shadow.Sample``): its prompt compiled over the same
    snapshot at its budget (its own, else the turn's total; the turn's reply), its soft span when it has memory,
    and the exact KL against ``reference`` over the control's reply. Stores nothing."""
    rt, armcfg = turns.runtime, turns.cfg.arm(c.name)
    total = s.budget.total if s.budget is not None else s.turn.budget
    reply = s.budget.reply if s.budget is not None else max(len(s.reply), 1)
    budget, mem = turns.size(armcfg, armcfg.budget or total, reply)
    policy = turns.policies[c.name]

    def compiled(at):
        prev = None
        if compaction_of(policy) is not None:  # the epoch it would extend: its own key's last boundary, if any
            prev = rt.boundary(s.session_id, epoch_key(policy.config_hash, at), s.turn.t)
        ct = rt.compile(s.turn.snapshot, policy, at, boundary=prev)
        return ct, (turn_memory(rt, ct, turns.read_spec(mem)) if mem and at.soft else None)

    ct, read = await asyncio.to_thread(compiled, budget)
    if read is not None and not len((await turns.memory.encode.remote(mem, s.session_id, *read))["soft"]):
        read = None  # its span gate is shut
    if mem and read is None and budget.soft:  # it sends nothing: served as its policy alone (run_turn's rule)
        ct, read = await asyncio.to_thread(compiled, budget.without_soft())
    p = ct.prompt
    ids = list(p.context_ids) + list(p.bridge_ids)
    soft = turns.soft_positions(mem, len(read[0])) if read else 0
    if not soft and ids == reference:
        kl, top1 = 0.0, 1.0  # it would serve the reference itself
    else:
        kl, top1 = await turns.memory.score.remote(mem if read else None, s.session_id, *(read or ([], [])),
                                                   list(p.context_ids), list(p.bridge_ids), s.reply, reference, threads)
    return {"kl": float(kl), "top1": float(top1), "tokens": len(ids) + soft, "ids": len(ids)}
