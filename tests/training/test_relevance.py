"""The relevance predictor: rows from need labels, a small trained head, its bundle, a boundary that ranks old steps
as the head does (and the cosine where none is registered), and the Ray Train job that registers it."""

import json

import numpy as np
import pytest

from palimpsest.models.relevance_head import RelevanceResolver, load_head, read_head, write_head
from palimpsest.pipelines.trajectories import read_trajectories
from palimpsest.platform import Ledger, Runtime
from palimpsest.platform.compile.budget import Budget
from palimpsest.platform.policies.base import query_text, relative_softmax
from palimpsest.platform.policies.relevance import SCALARS, features, recurrence
from palimpsest.platform.types import ConfigError
from palimpsest.training.relevance_data import build_rows, half_of, labels, ranking
from palimpsest.training.relevance_trainer import RelevanceTrainConfig, fit_head
from tests.helpers import per_turn


def traj(tid: str, n: int = 24) -> dict:
    """Step k shows `name_k_<tid>`; every third step's action goes back to the name shown four steps earlier, and
    its needs say so (the shared schema's fields)."""
    tag = tid.replace("/", "_")
    steps = []
    for k in range(n):
        back = k - 4 if k % 3 == 0 and k >= 4 else None
        action = f"cat src/name_{back}_{tag}.py" if back is not None else f"ls dir_{k}"
        needs = [] if back is None else [{"token": f"src/name_{back}_{tag}.py", "kind": "path", "strength": "strong",
                                          "first_obs_step": back, "last_obs_step": back, "obs_steps": [back],
                                          "agent_steps": []}]
        steps.append({"t": k, "kind": "bash", "thought": "", "action": action,
                      "observation": f"src/name_{k}_{tag}.py\nfiller words {k} " + "x " * 30, "needs": needs})
    return {"id": tid, "task": "Find the file.", "system": "be careful", "steps": steps}


@pytest.fixture
def data(tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_text("\n".join(json.dumps(traj(f"tr/{i}")) for i in range(6)) + "\n")
    return f


def _runtime(tmp_path) -> Runtime:
    return Runtime(Ledger(str(tmp_path / "l.db")))


def test_labels_name_the_old_steps_the_epoch_ahead_reuses(data):
    tr = read_trajectories(data).trajectories[0]
    old = np.arange(0, 8)  # the boundary at t=10 (recent 2): steps 0..7 are old
    y = labels(tr, 10, old, horizon=6, recent=2)
    # steps 12 and 15 go back to 8 and 11, which are not old
    assert y.tolist() == [0] * 8
    y = labels(tr, 9, np.arange(0, 7), horizon=4, recent=2)  # step 9 -> 5, step 12 -> 8 (not old)
    assert y.tolist() == [0, 0, 0, 0, 0, 1, 0]


def test_recurrence_counts_what_later_steps_name_again(tmp_path, data):
    rt = _runtime(tmp_path)
    build_rows(rt, data, "all", horizon=4)
    snap = rt.snapshot("tr/0")
    intro, rec = recurrence(snap.salient_index())
    assert intro[5] >= 1 and rec[5] >= 1  # step 9's action names step 5's file again
    assert intro[4] == 0 and rec[4] == 0  # nothing goes back to step 4


def test_a_boundary_with_a_predictor_ranks_old_steps_as_its_trained_head_does(tmp_path, data, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    rt = _runtime(tmp_path)
    rows = build_rows(rt, data, "all", horizon=6)
    assert rows.x.shape[1] == len(SCALARS) + rt.embedder.dim and 0 < rows.y.sum() < rows.y.size
    # the shipped kind of head: a logistic regression over the scalar features
    head = fit_head(rows.x[:, : len(SCALARS)], rows.y, hidden=0, epochs=60, lr=0.05, weight_decay=0.0, seed=0)
    head = read_head(write_head(tmp_path / "bundle", type(head)(**{**head.__dict__, "meta": {"recent": 2}})))
    # the head learnt the labels' rule better than the cosine does
    assert ranking(head.logits(head.read(rows.x)), rows.y, rows.group)["average_precision"] > \
        ranking(rows.x[:, 0].astype(np.float64), rows.y, rows.group)["average_precision"]
    rt.deps.relevance = RelevanceResolver()
    cfg = {"type": "pace", "relevance": {"model": str(tmp_path / "bundle")}}
    rt.ledger.create_session("live", "Find the file.", system="be careful")
    from palimpsest.pipelines.trajectories import to_record

    tr = read_trajectories(data).trajectories[0]
    boundaries = 0
    for s in tr.steps:
        rt.append("live", to_record(s))
        turn = rt.turn("live", cfg, Budget(900, 32))
        if not turn.compacted or turn.t < 6:
            continue
        boundaries += 1
        assert turn.plan.info["relevance"] == str(tmp_path / "bundle")
        snap = rt.snapshot("live", at=turn.t)
        old = np.flatnonzero(snap.has_key[: snap.t - 2])
        text = query_text(snap, 2, "recent_first")
        p = head.probability(head.read(features(snap, old, rt.embedder.embed([text])[0], text)))
        np.testing.assert_allclose(turn.plan.score[old], relative_softmax(p, 0.3), rtol=1e-9)
        # nothing registered under a name: the cosine, and the plan says so
        nothing = per_turn("pace", relevance={"model": "models:/nothing-here/latest"})
        none = rt.compile(snap, rt.policy(nothing), Budget(900))
        cos = rt.compile(snap, rt.policy(per_turn("pace")), Budget(900))
        assert none.plan.info["relevance"] == "cosine" and np.array_equal(none.plan.score, cos.plan.score)
    assert boundaries >= 1


def test_the_shipped_config_trains_on_the_fit_half():
    from pathlib import Path

    from palimpsest.training.relevance_trainer import load_config

    cfg = load_config(Path(__file__).resolve().parents[2] / "configs" / "relevance" / "train.yaml")
    assert cfg.half == "fit" and cfg.tracking.register_as == "palimpsest-relevance" and cfg.num_workers == 1


def test_the_report_half_is_refused_and_a_foreign_bundle_is_named(tmp_path):
    with pytest.raises(Exception, match="half"):
        RelevanceTrainConfig(name="x", data="d.jsonl", half="report")
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "relevance.json").write_text(json.dumps({"architecture": "other", "features_version": "0"}))
    np.savez(tmp_path / "b" / "relevance.npz", mean=np.zeros(1))
    with pytest.raises(ConfigError, match="architecture 'other'"):
        load_head(str(tmp_path / "b"))
    assert {half_of(f"tr/{i}") for i in range(40)} == {"fit", "report"}


@pytest.mark.slow
@pytest.mark.ray
def test_train_relevance_runs_on_ray_train_and_registers_the_head(tmp_path, data, monkeypatch):
    from palimpsest.training.relevance_trainer import launch

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    cfg = RelevanceTrainConfig(name="tiny-relevance", data=str(data), half="fit", horizon=6, hidden=4, epochs=20,
                               ledger=str(tmp_path / "l.db"), embedder="hashing", tokenizer="approx",
                               storage=str(tmp_path / "runs"),
                               tracking={"uri": uri, "artifact_location": (tmp_path / "art").as_uri()})
    summary = launch(cfg)
    assert summary["registered"] == "models:/palimpsest-relevance/1"
    # tr/5 is the fit half's watched trajectory: the head and the cosine are both scored on it
    assert {"watch_head_average_precision", "watch_cosine_average_precision"} <= set(summary["metrics"])
    head = load_head("models:/palimpsest-relevance/latest")
    assert head is not None and head.meta["data"]["half"] == "fit"
    assert head.meta["data"]["trajectories"] == ["tr/0", "tr/2", "tr/4", "tr/5"]  # the fit half only


@pytest.mark.parametrize("body,message", [
    ("name: r\ndata: d.jsonl\nhalf: report\n", "half: String should match pattern"),
    ("name: r\ndata: d.jsonl\nsurprise: 1\n", "surprise: Extra inputs are not permitted"),
    ("name: r\ndata: missing.jsonl\n", "data: no trajectories at missing.jsonl"),
])
def test_train_relevance_refuses_bad_configs_in_one_line(tmp_path, body, message):
    import subprocess
    import sys

    (tmp_path / "c.yaml").write_text(body)
    r = subprocess.run([sys.executable, "-m", "palimpsest.cli", "train-relevance", "--config", "c.yaml", "--no-mlflow"],
                       capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr, r.stderr
