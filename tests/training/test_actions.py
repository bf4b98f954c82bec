"""eval-actions: the behavioural measure of every policy, on a tiny random actor (the arithmetic and the
plumbing are under test; the figures on real trajectories are in BENCHMARKS.md)."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from palimpsest.evaluation.actions import (
    Arm,
    TeacherCache,
    bootstrap_ci,
    evaluate_actions,
    score,
    summarize_actions,
    teacher_of,
)
from palimpsest.models.actor import FrozenActor
from palimpsest.pipelines.environment import open_runtime
from palimpsest.pipelines.replay_sessions import prepare_sessions
from palimpsest.pipelines.trajectories import file_sha256, read_trajectories
from palimpsest.platform.policies import parse_policy_config
from tests.models.tiny import tiny_actor
from tests.models.tiny_tokenizer import tiny_tokenizer
from tests.pipelines.test_remory_data import traj


@pytest.fixture(scope="module")
def actor_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("actor")
    tiny_actor(seed=1, hidden=64, vocab=320, heads=2).model.save_pretrained(d)
    tiny_tokenizer().save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    f = tmp_path_factory.mktemp("data") / "d.jsonl"
    f.write_text("\n".join(json.dumps(traj(f"tr/{i}", n=7, obs=20)) for i in range(3)) + "\n")
    return f


def test_the_score_is_zero_against_itself_and_a_lower_bound_of_the_full_kl():
    torch.manual_seed(0)
    p, q = torch.randn(5, 300), torch.randn(5, 300)
    target = torch.randint(0, 300, (5,))
    same = score(p, target, teacher_of(p, k=8))
    assert same["kl"] < 1e-6 and same["top1"] == 1.0
    full = (F.softmax(q, -1) * (F.log_softmax(q, -1) - F.log_softmax(p, -1))).sum(-1).mean()
    coarse = score(q, target, teacher_of(p, k=8))["kl"]
    assert 0 < coarse <= float(full) + 1e-6  # the partition {top-k, rest} loses information, never adds it
    assert score(q, target, teacher_of(p, k=300))["kl"] == pytest.approx(float(full), rel=1e-4)
    assert score(q, target, teacher_of(p))["nll"] == pytest.approx(float(F.cross_entropy(q, target)), rel=1e-5)


def test_bootstrap_intervals_resample_trajectories():
    lo, hi = bootstrap_ci({"a": [1.0, 1.0], "b": [3.0], "c": [2.0, 2.0, 2.0]})
    assert 1.0 <= lo < hi <= 3.0
    assert bootstrap_ci({"a": [2.0], "b": [2.0]}) == (2.0, 2.0)


def test_the_whole_history_is_the_teacher_and_a_shorter_window_moves_away_from_it(tmp_path, actor_dir, data):
    rt = open_runtime(tmp_path / "l.db", "hashing", str(actor_dir))
    sessions = prepare_sessions(rt, read_trajectories(data).trajectories, False, file_sha256(data), [])
    actor = FrozenActor.from_pretrained(actor_dir)
    arms = [Arm("full", parse_policy_config("full")), Arm("last1", parse_policy_config({"type": "window", "k": 1})),
            Arm("pace", parse_policy_config("pace"))]
    cache = TeacherCache(tmp_path / "teachers.parquet")
    kw = dict(data_sha=file_sha256(data), actor_key=str(actor_dir), window=2048, max_boundaries=6,
              max_target_tokens=12, reference="last1")
    res = evaluate_actions(rt, sessions, arms, 1000, actor, cache=cache, **kw)
    full, last1 = res.policies["full"], res.policies["last1"]
    assert full["boundaries"] == last1["boundaries"] == 6
    assert full["kl"] < 1e-5 and full["top1"] == 1.0  # the student given the whole history is the teacher
    assert last1["kl"] > max(100 * full["kl"], 1e-6) and last1["positions"] < full["positions"]
    assert res.gap_closed["last1"] == 0.0 and res.gap_closed["full"] == pytest.approx(1.0, abs=1e-4)
    assert last1["kl_ci"][0] <= last1["kl"] <= last1["kl_ci"][1]
    assert cache.misses == 6 and (tmp_path / "teachers.parquet").is_file()
    again = TeacherCache(tmp_path / "teachers.parquet")  # the teacher passes are computed once
    res2 = evaluate_actions(rt, sessions, arms, 1000, actor, cache=again, **kw)
    assert again.hits == 6 and again.misses == 0
    assert res2.policies["last1"]["kl"] == pytest.approx(last1["kl"], rel=1e-5)
    only = evaluate_actions(rt, sessions, arms[:2], 1000, actor, allowed=lambda t: t == "tr/0", **kw)
    assert {r["trajectory"] for r in only.boundaries} == {"tr/0"}


def test_the_cli_prints_only_json_on_stdout(tmp_path, actor_dir, data):
    """Library notices printed while the work runs (DeepSpeed's accelerator line on stdout) go to stderr."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "DS_ACCELERATOR"}
    r = subprocess.run([sys.executable, "-m", "palimpsest.cli", "eval-actions", "--data", str(data),
                        "--policy", "window,pace", "--budget", "1000", "--max-boundaries", "2", "--window", "2048",
                        "--max-target-tokens", "8", "--tokenizer", str(actor_dir), "--embedder", "hashing",
                        "--ledger", str(tmp_path / "l.db"), "--cache", str(tmp_path / "t.parquet"),
                        "--no-mlflow", "--json"], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    doc = json.loads(r.stdout)  # the whole of stdout is one JSON object
    assert set(doc["policies"]) == {"window", "pace"} and doc["reference"] == "pace"
    assert doc["policies"]["window"]["boundaries"] == 2 and len(doc["policies"]["pace"]["kl_ci"]) == 2
    assert doc["device"] == "cpu"  # where the figures were computed, in the record


@pytest.mark.parametrize("device,message", [("nope", "is not a device"), ("meta", "only cpu and cuda"),
                                            ("cuda", "no CUDA device")])
def test_a_device_the_machine_lacks_is_refused_by_name_before_any_model_loads(tmp_path, data, device, message):
    import subprocess
    import sys

    import torch

    if device == "cuda" and torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    for cmd in (["eval-actions", "--policy", "pace", "--budget", "1000"], ["eval-memory", "--model", "x"]):
        r = subprocess.run([sys.executable, "-m", "palimpsest.cli", *cmd, "--data", str(data), "--device", device],
                           capture_output=True, text=True, timeout=300)
        assert r.returncode != 0 and "--device" in r.stderr and message in r.stderr, r.stderr[-1000:]


def test_a_fitted_policy_is_never_scored_on_the_trajectories_it_was_fitted_on(tmp_path, actor_dir, data, monkeypatch):
    """pace_plus's constants were fitted on half of dev: its row is scored on the other trajectories only, and
    the boundaries left out for that reason are counted (a policy without a fit set is scored everywhere)."""
    from palimpsest.platform.policies.pace_plus import FITTED_ON, PacePlusConfig

    assert FITTED_ON and PacePlusConfig.fitted_on == FITTED_ON
    monkeypatch.setattr(PacePlusConfig, "fitted_on", frozenset({"tr/1"}))
    rt = open_runtime(tmp_path / "l.db", "hashing", str(actor_dir))
    sessions = prepare_sessions(rt, read_trajectories(data).trajectories, False, file_sha256(data), [])
    arms = [Arm("pace", parse_policy_config("pace")), Arm("pace_plus", parse_policy_config("pace_plus"))]
    res = evaluate_actions(rt, sessions, arms, 1000, FrozenActor.from_pretrained(actor_dir), data_sha=file_sha256(data),
                           actor_key=str(actor_dir), window=2048, max_target_tokens=8, reference="pace")
    plus = [r for r in res.boundaries if r["policy"] == "pace_plus"]
    assert {r["trajectory"] for r in plus if r.get("kl") is not None} == {"tr/0", "tr/2"}
    fitted = [r for r in plus if r["trajectory"] == "tr/1"]
    assert fitted and all(r["in_sample"] and r.get("kl") is None for r in fitted)
    assert res.policies["pace_plus"]["in_sample"] == len(fitted) and res.policies["pace"]["in_sample"] == 0
    assert res.policies["pace_plus"]["boundaries"] == res.policies["pace"]["boundaries"] - len(fitted)
    assert res.policies["pace_plus"]["trajectories"] == 2
    # its gap is taken against the reference on the boundaries it was scored on
    kept = [r for r in res.boundaries
            if r["policy"] == "pace" and r["trajectory"] != "tr/1" and r.get("kl") is not None]
    base = sum(r["kl"] for r in kept) / len(kept)
    assert res.gap_closed["pace_plus"] == pytest.approx(1 - res.policies["pace_plus"]["kl"] / base, rel=1e-6)
    # and the other way round: a fitted reference compares each row on the reference's boundaries only
    flipped = summarize_actions(res.boundaries, ["pace", "pace_plus"], "pace_plus")
    own = [r["kl"] for r in res.boundaries if r["policy"] == "pace" and r["trajectory"] != "tr/1"]
    assert flipped.gap_closed["pace"] == pytest.approx(1 - (sum(own) / len(own)) / res.policies["pace_plus"]["kl"],
                                                       rel=1e-6)


def test_an_epoch_policy_is_scored_on_its_chain_as_served_with_boundary_and_append_turns_apart(tmp_path, actor_dir):
    """The student at a scored step is the turn serving sends there: the epoch's prompt extended since its last
    boundary (an append turn), not a fresh compaction at that step; the summary gives the two kinds apart."""
    from palimpsest.pipelines.replay_sessions import walk_turns
    from palimpsest.platform.compile.budget import Budget

    f = tmp_path / "long.jsonl"
    f.write_text(json.dumps(traj("tr/long", n=40, obs=8)) + "\n")
    rt = open_runtime(tmp_path / "l.db", "hashing", str(actor_dir))
    sessions = prepare_sessions(rt, read_trajectories(f).trajectories, False, file_sha256(f), [])
    actor = FrozenActor.from_pretrained(actor_dir)
    cfg = parse_policy_config({"type": "pace", "compaction": {"high": 0.9, "low": 0.5}})
    res = evaluate_actions(rt, sessions, [Arm("full", parse_policy_config("full")), Arm("pace", cfg)], 700, actor,
                           data_sha=file_sha256(f), actor_key=str(actor_dir), window=4096, max_target_tokens=8,
                           reference="full")
    rows = [r for r in res.boundaries if r["policy"] == "pace" and r.get("skipped") is None]
    kinds = {r["turn"] for r in rows}
    assert {"boundary", "append"} <= kinds, kinds
    served = {rs.t: turn for rs, _s, turn, _e in walk_turns(rt, sessions[0], cfg, Budget(700, 8))}
    fresh_differs = 0
    for r in rows:
        turn = served[r["t"]]
        assert r["positions"] == len(turn.prompt.ids)  # the chain's turn, as served
        assert r["turn"] == ("boundary" if turn.compacted else "append")
        if r["turn"] == "append":  # a fresh compaction at that step would have sent another prompt
            fresh = rt.compile(turn.snapshot, rt.policy(cfg), Budget(700, 8))
            fresh_differs += list(fresh.prompt.ids) != list(turn.prompt.ids)
    assert fresh_differs > 0
    by_turn = res.policies["pace"]["by_turn"]
    assert by_turn["boundary"]["boundaries"] + by_turn["append"]["boundaries"] == len(rows)
    assert res.policies["full"]["by_turn"]["append"]["boundaries"] == res.policies["full"]["boundaries"]


def test_a_memory_that_carries_nothing_does_no_harm(tmp_path, actor_dir, data):
    """The network as it starts (its span gate closed) sends no soft span: at every boundary its row is the
    policy's own, the same prompt and the same KL (tolerance 0) as ``NAME``, as serving gives the span's room back
    to the text. ``NAME+empty`` keeps the room unused and differs where the room matters. The same network with
    the gate open (its only difference) sends its span and moves the actor: the check can fail."""
    from palimpsest.evaluation.actions import MemoryArm
    from palimpsest.models.encoder import MemoryEncoder
    from palimpsest.models.memory import MemoryConfig, MemoryRead
    from palimpsest.models.memory_network import MemoryNetwork

    rt = open_runtime(tmp_path / "l.db", "hashing", str(actor_dir))
    sessions = prepare_sessions(rt, read_trajectories(data).trajectories, False, file_sha256(data), [])
    actor = FrozenActor.from_pretrained(actor_dir)

    def arm(gate_bias: float) -> MemoryArm:
        torch.manual_seed(0)
        cfg = MemoryConfig(block_size=16, queries=4, max_slots=64, lora_rank=4, summary_layers=1,
                           gate_bias=gate_bias)  # 64 soft positions: room that changes the prompt at 1,000
        return MemoryArm(MemoryEncoder(MemoryNetwork(cfg, actor), actor), MemoryRead(max_history_tokens=256))

    pace = parse_policy_config("pace")
    closed, opened = arm(-4.0), arm(4.0)  # the default starting logit, and an open gate
    arms = [Arm("pace", pace), Arm("pace+empty", pace, closed, inject=False), Arm("pace+memory", pace, closed),
            Arm("pace+open", pace, opened)]
    res = evaluate_actions(rt, sessions, arms, 1000, actor, data_sha=file_sha256(data), actor_key=str(actor_dir),
                           window=2048, max_boundaries=6, max_target_tokens=12)
    rows = {(r["policy"], r["trajectory"], r["t"]): r for r in res.boundaries if r.get("skipped") is None}
    keys = [(s, t) for p, s, t in rows if p == "pace+empty"]
    assert len(keys) == 6
    moved = roomier = 0
    for s, t in keys:
        own, empty, mem, open_ = (rows[(p, s, t)] for p in ("pace", "pace+empty", "pace+memory", "pace+open"))
        assert mem["soft"] == 0 and mem["positions"] == own["positions"] and mem["text"] == own["text"]
        assert mem["kl"] == own["kl"] and mem["nll"] == own["nll"]  # no harm: exactly the policy alone
        roomier += own["positions"] > empty["positions"]
        moved += open_["soft"] > 0 and open_["kl"] != empty["kl"]
    assert roomier > 0  # the room a shut gate gives back is text the actor sees
    assert moved > 0  # an open gate sends the span, and the actor reads it


def _row(policy, traj, t, kl, soft=0, positions=100, text="reserved"):
    return {"policy": policy, "trajectory": traj, "t": t, "kl": kl, "soft": soft, "positions": positions,
            "text": text, "skipped": None}


def test_the_memory_is_tested_against_each_control_per_trajectory_and_identical_inputs_are_left_out():
    """eval-memory's paired test: one difference per trajectory, the controls sharing alpha (Bonferroni); a
    boundary where neither row sent a soft span is the same input by construction, left out and counted; too few
    trajectories is no verdict."""
    from palimpsest.evaluation.actions import paired_against

    rows = []
    for i in range(8):
        traj = f"tr{i}"
        for t in (3, 4):
            rows += [_row("pace", traj, t, 0.30, positions=120, text="whole budget"), _row("pace+empty", traj, t, 0.35),
                     _row("pace+memory", traj, t, 0.20 + 0.01 * i, soft=16, positions=116),
                     _row("pace+other", traj, t, 0.34, soft=16, positions=116)]
        # a closed gate: the memory row sends nothing, as +empty does (and as +other's closed gate does)
        rows += [_row("pace+memory", traj, 9, 0.5), _row("pace+empty", traj, 9, 0.5), _row("pace+other", traj, 9, 0.5),
                 _row("pace", traj, 9, 0.45, positions=100, text="whole budget")]  # same length, other ids
    out = paired_against(rows, "pace+memory", ["pace", "pace+empty", "pace+other"])
    assert {c: v["verdict"] for c, v in out.items()} == {"pace": "lower", "pace+empty": "lower", "pace+other": "lower"}
    assert out["pace+empty"]["identical"] == 8 and out["pace+empty"]["boundaries"] == 16
    assert out["pace"]["identical"] == 0 and out["pace"]["boundaries"] == 24  # other ids: not identical
    assert out["pace+empty"]["n"] == 8 and abs(out["pace+empty"]["mean"] - (0.235 - 0.35)) < 1e-9
    assert all(abs(v["alpha"] - 0.05 / 3) < 1e-12 for v in out.values())
    # the difference against pace includes the closed boundary (+0.05 each): what the closed gate's reserve costs
    assert abs(out["pace"]["mean"] - ((0.235 - 0.30) * 2 + 0.05) / 3) < 1e-9
    few = paired_against([r for r in rows if r["trajectory"] in ("tr0", "tr1", "tr2")], "pace+memory", ["pace+empty"])
    assert few["pace+empty"]["verdict"] == "no verdict" and few["pace+empty"]["n"] == 3
    same = [dict(r, kl=r["kl"] + 0.02 * ((-1) ** int(r["trajectory"][2:]))) if r["policy"] == "pace+memory" else r
            for r in rows if r["policy"] in ("pace+memory", "pace+other") and r["t"] != 9]
    for r in same:
        if r["policy"] == "pace+other":
            r["kl"] = next(x["kl"] for x in rows if x["policy"] == "pace+memory" and x["trajectory"] == r["trajectory"]
                           and x["t"] == r["t"])
    assert paired_against(same, "pace+memory", ["pace+other"])["pace+other"]["verdict"] == "no difference"
