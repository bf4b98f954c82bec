"""Rollouts that decide: what runs by default, dark candidates judged on their control's live turns, and the
stages (dark -> canary -> promoted, or withdrawn) every replica reads from the ledger. No Ray: the router, the
candidate service, the shadow lane and the served turn run over a ledger with stand-in model handles."""

import asyncio
import functools
from collections import Counter

import pytest

from palimpsest.experiments import gate as rollouts
from palimpsest.experiments import stats as ab_stats
from palimpsest.experiments.gate import Judged, subject_of
from palimpsest.platform import Ledger, Runtime
from palimpsest.platform.types import ConfigError
from palimpsest.serving.serve_config import ServeConfig, parse_serve_config
from palimpsest.serving.turn.candidates import CandidateService, judge, judged_candidates
from palimpsest.serving.turn.router import Router
from tests.helpers import STEPS, TASK, step

SESSIONS = [f"session-{i}" for i in range(3000)]
MEMORY_INFO = {"models": {"default": {"enabled": True, "model": "models:/palimpsest-memory/7", "max_slots": 8,
                                     "block_size": 32, "queries": 4,  # and what it reads, as its bundle says:
                                     "read": {"max_history_tokens": 1024, "max_field_chars": 400}}}}


def _config(stage="dark", share=0.5, **ab):
    return parse_serve_config({
        "arms": [{"name": "pace", "policy": {"type": "pace"}},
                 {"name": "window", "policy": {"type": "window"}, "weight": 1.0},
                 {"name": "pace+memory", "policy": {"type": "pace"}, "memory": True, "candidate_of": "pace",
                  "stage": stage, "canary_share": share}],
        "ab": {"refresh_s": 1.0, "gate_min_pairs": 4, **ab}})


class _Routed:
    """The routing part of a replica: its router, which the candidate service hands the stages it reads."""

    def __init__(self, cfg, ledger):
        self.router = Router.of(cfg.arms)
        judged, _ = judged_candidates(cfg, MEMORY_INFO)
        self.service = CandidateService(ledger, cfg, judged, self._stages)

    def _stages(self, stages):
        self.router = self.router.with_stages(stages)


def test_with_no_config_no_memory_arm_serves_a_session():
    """The embedded default: `pace` serves everything; a registered memory is a dark candidate of it, which the
    router never assigns and refuses by name, before any decision and after a refresh that finds none."""
    cfg = ServeConfig()
    memory = next(a for a in cfg.arms if a.memory)
    assert memory.candidate_of == "pace" and memory.stage == "dark"
    assert not [a.name for a in cfg.arms if a.memory and not a.candidate_of]
    router = Router.of(cfg.arms)
    assert set(map(router.assign, SESSIONS)) == {"pace"}
    with pytest.raises(ConfigError, match="dark candidate"):
        router.choose("s", "pace+memory")


def test_with_no_config_a_refresh_that_finds_no_decision_keeps_the_memory_dark(tmp_path):
    cfg = ServeConfig()
    replica = _Routed(cfg, Ledger(str(tmp_path / "l.db")))
    assert replica.service.refresh() == {"pace+memory": "dark"}
    assert set(map(replica.router.assign, SESSIONS)) == {"pace"}


def test_the_router_never_assigns_a_dark_candidate_and_a_canary_gets_its_sticky_share():
    dark = Router.of(_config("dark").arms)
    assert Counter(map(dark.assign, SESSIONS)).keys() == {"pace", "window"}
    canary = dark.with_stages({"pace+memory": "canary"})
    got = [canary.assign(s) for s in SESSIONS]
    assert got == [canary.assign(s) for s in SESSIONS]  # sticky: the same answer on any replica
    share = got.count("pace+memory") / (got.count("pace+memory") + got.count("pace"))
    assert 0.45 < share < 0.55
    # the canary's sessions come out of its control's only, and a dark router sends them to the control
    assert all(dark.assign(s) == ("pace" if a == "pace+memory" else a) for s, a in zip(SESSIONS, got))
    promoted = dark.with_stages({"pace+memory": "promoted"})
    assert set(map(promoted.assign, SESSIONS)) == {"pace+memory", "window"}
    assert canary.choose("s", "pace+memory") == "pace+memory"


def test_candidate_configs_are_checked():
    for bad, match in [({"name": "c", "candidate_of": "nobody"}, "candidate_of"),
                       ({"name": "c", "candidate_of": "c"}, "candidate_of"),
                       ({"name": "c", "stage": "canary"}, "candidate's")]:
        with pytest.raises(ConfigError, match=match):
            parse_serve_config({"arms": [{"name": "pace"}, bad]})
    with pytest.raises(ConfigError, match="positive weight"):
        parse_serve_config({"arms": [{"name": "pace", "weight": 0}, {"name": "c", "candidate_of": "pace"}]})
    # what the app hands each replica (the config dumped) reads back the same
    for cfg in (ServeConfig(), _config("canary")):
        assert parse_serve_config(cfg.model_dump()) == cfg
    with pytest.raises(ConfigError, match="sum above 1"):
        parse_serve_config({"arms": [{"name": "pace"}, {"name": "c", "candidate_of": "pace", "canary_share": 0.6},
                                     {"name": "d", "candidate_of": "pace", "canary_share": 0.6}]})


def test_a_withdrawn_candidate_gets_no_new_session_after_one_refresh(tmp_path):
    cfg = _config("canary")
    ledger = Ledger(str(tmp_path / "l.db"))
    replica = _Routed(cfg, ledger)
    replica.service.refresh(gate=False)
    assert "pace+memory" in set(map(replica.router.assign, SESSIONS))
    c = replica.service.judged[0]
    # another replica withdraws it: this one routes as before until its next refresh
    assert ledger.record_rollout(c.name, c.control, c.subject, "withdrawn", "withdraw", {"by": "hand"}, prev=0)
    assert "pace+memory" in set(map(replica.router.assign, SESSIONS))
    replica.service.refresh(gate=False)
    assert "pace+memory" not in set(map(replica.router.assign, SESSIONS))
    # a session created on it while it was a canary is served by its control from now on
    assert replica.router.serving("pace+memory") == "pace" and replica.router.serving("window") == "window"


def _pairs(ledger, c, n, control_kl, candidate_kl, t0=0, turns=1):
    """``n`` sessions judged on ``turns`` turns each (the gate reads each session's first)."""
    for i in range(t0, t0 + n):
        ledger.create_session(f"judged-{i}", TASK)
        for t in range(turns):
            kl = candidate_kl(i) if callable(candidate_kl) else candidate_kl
            ledger.record_shadow_pair(f"judged-{i}", 4 + t, c.control, c.name, c.subject, "scored", reference="full",
                                      control_kl=control_kl, candidate_kl=kl + t, control_tokens=100,
                                      candidate_tokens=108, tokens=4)


def test_two_replicas_route_a_withdrawn_candidate_alike_and_a_restart_keeps_it(tmp_path, monkeypatch):
    seen = []

    def gate(quality_diffs, cost_diffs, alpha, margin, candidates):
        seen.append((list(quality_diffs), list(cost_diffs), alpha, margin, candidates))
        mean = sum(quality_diffs) / len(quality_diffs)
        return {"decision": "withdraw" if mean > margin else "promote", "mean": mean}  # lower is better

    monkeypatch.setattr(ab_stats, "gate_decision", gate, raising=False)
    path = str(tmp_path / "shared.db")
    cfg = _config("canary")
    a, b = _Routed(cfg, Ledger(path)), _Routed(cfg, Ledger(path))
    c = a.service.judged[0]
    assert c == b.service.judged[0]
    assert c.subject == subject_of(cfg.arm("pace+memory").policy_config().config_hash(), "models:/palimpsest-memory/7")
    _pairs(a.service.ledger, c, 3, control_kl=0.2, candidate_kl=0.5)
    a.service.refresh()
    assert seen == [] and a.service.last["pace+memory"]["decision"] == "hold"  # 3 of 4 pairs: the gate waits
    _pairs(a.service.ledger, c, 3, control_kl=0.2, candidate_kl=0.5, t0=3, turns=2)  # the memory measured worse
    assert a.service.refresh() == {"pace+memory": "withdrawn"}
    assert len(seen) == 1 and seen[0][0] == pytest.approx([0.3] * 6) and seen[0][1] == [8.0] * 6
    assert seen[0][2:] == (0.05, 0.0, 1)
    b.service.refresh()
    assert len(seen) == 1  # the stage is decided: b does not gate it again
    routed = [a.router.assign(s) for s in SESSIONS]
    assert routed == [b.router.assign(s) for s in SESSIONS] and "pace+memory" not in routed
    (decision,) = a.service.ledger.rollouts()
    assert decision["stage"] == "withdrawn" and decision["evidence"]["sessions"] == 6
    assert decision["evidence"]["from"] == "canary" and decision["evidence"]["mean"] == pytest.approx(0.3)
    for r in (a, b):
        r.service.ledger.close()
    restarted = _Routed(cfg, Ledger(path))
    assert restarted.router.stage("pace+memory") == "canary"  # the config's stage, until the ledger is read
    restarted.service.refresh()
    assert [restarted.router.assign(s) for s in SESSIONS] == routed
    assert rollouts.status(restarted.service.ledger)["candidates"][0]["stage"] == "withdrawn"


def test_a_dark_candidate_the_gate_promotes_becomes_a_canary_then_is_promoted_on_fresh_evidence(tmp_path, monkeypatch):
    monkeypatch.setattr(ab_stats, "gate_decision", lambda **kw: {"decision": "promote"}, raising=False)
    replica = _Routed(_config("dark"), Ledger(str(tmp_path / "l.db")))
    c = replica.service.judged[0]
    _pairs(replica.service.ledger, c, 4, control_kl=0.5, candidate_kl=0.2)
    assert replica.service.refresh() == {"pace+memory": "canary"}
    assert replica.service.refresh() == {"pace+memory": "canary"}  # the canary's own pairs are still to come
    _pairs(replica.service.ledger, c, 4, control_kl=0.5, candidate_kl=0.1, t0=4)
    assert replica.service.refresh() == {"pace+memory": "promoted"}
    assert [d["stage"] for d in replica.service.ledger.rollouts()] == ["canary", "promoted"]


def test_the_gate_withdraws_a_memory_that_measured_worse(tmp_path):
    """With the statistics' own gate: sessions where the candidate's KL is clearly above the control's end its
    dark stage as withdrawn, with the test's evidence in the ledger."""
    replica = _Routed(_config("dark"), Ledger(str(tmp_path / "l.db")))
    c = replica.service.judged[0]
    _pairs(replica.service.ledger, c, 60, control_kl=0.2, candidate_kl=lambda i: 0.5 + 0.05 * ((i * 7) % 5 - 2))
    assert replica.service.refresh() == {"pace+memory": "withdrawn"}
    (d,) = replica.service.ledger.rollouts()
    assert d["decision"] == "withdraw" and d["evidence"]["sessions"] == 60 and d["evidence"]["n"] == 60


def test_rollout_decisions_are_append_only_and_one_line_per_candidate(ledger):
    first = ledger.record_rollout("c", "pace", "subj", "canary", "promote", {"p": 0.01}, prev=0)
    assert first is not None
    assert ledger.record_rollout("c", "pace", "subj", "withdrawn", "withdraw", {}, prev=0) is None  # a stale view
    _pairs(ledger, Judged("c", "pace", "subj"), 1, control_kl=0.1, candidate_kl=0.2)
    for sql in ("UPDATE rollouts SET stage='promoted'", "DELETE FROM rollouts",
                "UPDATE shadow_pairs SET candidate_kl=0", "DELETE FROM shadow_pairs"):
        with pytest.raises(Exception, match="append-only"):
            with ledger._store.tx() as db:
                db.execute(sql)
    assert [(r["stage"], r["evidence"]) for r in ledger.rollouts()] == [("canary", {"p": 0.01})]
    assert ledger.rollout_latest()[("c", "subj")]["id"] == first


class _Embedder:
    """The hashing embedder with the clock a served turn reads (the replica's HandleEmbedder has one)."""

    def __init__(self):
        from palimpsest.platform.embedding import HashingEmbedder

        self.inner = HashingEmbedder()
        self.name, self.dim = self.inner.name, self.inner.dim
        self.waited_ms = self.requests = self.lookups = self.joined = 0

    def embed(self, texts):
        return self.inner.embed(texts)

    def reset_wait(self):
        pass


class _Actor:
    async def _generate(self, request, memory=None):
        ids = list(request["context"]) + list(request["bridge"])
        return {"text": "ls", "token_ids": [5, 6, 7], "actor_ms": 1.0, "prompt_tokens": len(ids), "soft_tokens": 0,
                "cached_tokens": 0, "finish_reason": "stop"}

    def __init__(self):
        self.generate = type("H", (), {"remote": staticmethod(self._generate)})()


class _Memory:
    """The memory encoder's scorer: records what each prompt it scores holds."""

    def __init__(self):
        self.calls = []

        async def score(key, sid, history, summary, context, bridge, reply, reference, threads=None):
            self.calls.append({"key": key, "sid": sid, "history": len(history), "ids": len(context) + len(bridge),
                               "reply": list(reply), "reference": len(reference)})
            return (0.75, 0.5) if key else (0.25, 0.75)

        async def encode(key, sid, history, summary):
            return {"soft": [[0.0]] * 4, "ms": 0.0, "cached": False}  # an open gate: a span of 4 positions

        self.score = type("H", (), {"remote": staticmethod(score)})()
        self.encode = type("H", (), {"remote": staticmethod(encode)})()


def test_a_candidate_is_judged_on_the_same_turn_and_nothing_of_it_is_recorded_as_served(tmp_path):
    """A served `pace` turn sampled for its dark memory candidate: the lane compiles what the candidate would have
    served for that turn (pace at the same total, less the soft positions, plus its span), scores both prompts
    against the same reference over the same reply, and records the pair under the turn's (session, t). The
    candidate has no served row, no audited turn, no boundary and no shadow row of its own."""
    from palimpsest.serving.metrics import Metrics
    from palimpsest.serving.turn.request import TurnRequest
    from palimpsest.serving.turn.shadow import ShadowLane
    from palimpsest.serving.turn.turn import TurnService

    cfg = _config("dark", candidate_rate=1.0)
    rt = Runtime(Ledger(str(tmp_path / "l.db")), embedder=_Embedder())
    sid = "s1"
    rt.ledger.create_session(sid, TASK, meta={"arm": "pace"})
    for t in range(24):
        action, obs = STEPS[t % len(STEPS)]
        rt.append(sid, step(t, f"{action} # {t}", f"{obs}\n" + f"value={t * 7} " * 30))
    policies = {a.name: rt.policy(a.policy_config()) for a in cfg.arms}
    memory, metrics = _Memory(), Metrics([a.name for a in cfg.arms])

    def count(table):
        return rt.ledger._read(f"SELECT COUNT(*) FROM {table}")[0][0]

    async def run():
        lane = ShadowLane(rt, cfg.ab, window=8192, busy=lambda: False, metrics=metrics)
        turns = TurnService(rt, cfg, policies, _Actor(), memory, {"max_model_len": 8192}, MEMORY_INFO, metrics, lane)
        service = CandidateService(rt.ledger, cfg, judged_candidates(cfg, MEMORY_INFO)[0], lambda stages: None)
        service.refresh()
        lane.candidates, lane.judge = service.active, functools.partial(judge, turns)
        req = TurnRequest(sid, budget=1200, max_tokens=8, tool_choice="auto", noted={"metadata": '{"run": 1}'})
        out = await turns.serve(rt.ledger.session(sid), "pace", req)
        before = {table: count(table) for table in ("audit", "boundaries", "served", "folds")}
        assert await lane.drained(60)
        return out, before, lane.state()

    out, before, state = asyncio.run(run())
    assert {table: count(table) for table in before} == before  # judging wrote none of them
    (pair,) = rt.ledger.shadow_pairs()
    assert (pair["session_id"], pair["t"], pair["control"], pair["candidate"]) == (sid, out.t, "pace", "pace+memory")
    assert pair["status"] == "scored" and pair["control_kl"] == 0.25 and pair["candidate_kl"] == 0.75
    assert pair["subject"] == subject_of(policies["pace+memory"].config_hash, "models:/palimpsest-memory/7")
    control, candidate = memory.calls
    assert control["key"] is None and candidate["key"] == "default" and candidate["history"] > 0
    assert control["reply"] == candidate["reply"] == [5, 6, 7] and control["reference"] == candidate["reference"]
    assert pair["control_tokens"] == control["ids"] and pair["candidate_tokens"] > candidate["ids"]  # + soft
    (served,) = rt.ledger.served()
    assert served["arm"] == "pace" and served["budget"] == 1200
    # what the request carried and the actor cannot honour is recorded with the turn it asked for
    assert served["requested_metadata"] == '{"run": 1}' and served["tool_choice"] == '"auto"'
    assert rt.ledger.shadows() == []  # sampled for its candidate only (ab.shadow_rate 0): no `shadow` row
    assert state["paired"] == 1 and state["sampled"] == 0
    assert 'palimpsest_shadow_pairs_total{candidate="pace+memory",status="scored"} 1.0' in metrics.render()


def test_ab_status_prints_the_stage_and_decisions_as_json(tmp_path):
    import json
    import subprocess
    import sys

    path = str(tmp_path / "l.db")
    led = Ledger(path)
    c = Judged("pace+memory", "pace", "policy=x memory=y")
    _pairs(led, c, 2, control_kl=0.2, candidate_kl=0.1)
    led.record_rollout(c.name, c.control, c.subject, "withdrawn", "withdraw", {"p": 0.001}, prev=0)
    led.close()
    out = subprocess.run([sys.executable, "-m", "palimpsest.cli", "ab", "status", "--ledger", path, "--json"],
                         capture_output=True, text=True, check=True).stdout
    (row,) = json.loads(out)["candidates"]
    assert row["stage"] == "withdrawn" and row["decisions"][0]["evidence"] == {"p": 0.001}
    assert row["pairs"]["scored"] == 0  # none since the decision


@pytest.mark.slow
def test_each_decision_is_an_mlflow_run_beside_its_policy_config_and_memory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)  # restored afterwards (the service exports the config's)
    monkeypatch.setattr(ab_stats, "gate_decision", lambda **kw: {"decision": "promote", "p": 0.01}, raising=False)
    cfg = parse_serve_config({**_config("dark").model_dump(), "tracking": {"uri": uri, "experiment": "rollouts"}})
    replica = _Routed(cfg, Ledger(str(tmp_path / "l.db")))
    c = replica.service.judged[0]
    _pairs(replica.service.ledger, c, 4, control_kl=0.5, candidate_kl=0.2)
    assert replica.service.refresh() == {"pace+memory": "canary"}

    import mlflow

    client = mlflow.MlflowClient(tracking_uri=uri)
    (run,) = client.search_runs([client.get_experiment_by_name("rollouts").experiment_id])
    assert run.data.params["candidate"] == "pace+memory" and run.data.params["stage"] == "canary"
    assert run.data.params["memory.model"] == "models:/palimpsest-memory/7" and run.data.metrics["p"] == 0.01
    assert {"policy.json", "rollout_decision.json"} <= {a.path for a in client.list_artifacts(run.info.run_id)}
    assert "memory_bundle.error" in run.data.tags  # no such registered model in this store: the run still stands
    assert run.info.status == "FINISHED"
