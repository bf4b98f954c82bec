"""Programmatic recall sessions: a fact shown at step 0 that the last action needs, around real steps of the
training split only."""

import json

import pyarrow.parquet as pq
import pytest

from palimpsest.pipelines.recall_sessions import recall_sessions
from palimpsest.pipelines.trajectories import Trajectory
from palimpsest.platform.policies import parse_policy_config
from palimpsest.training.remory_data import DataConfig, build_datasets, split_of
from tests.pipelines.test_remory_data import WINDOW, tok_dir, traj  # noqa: F401  (tok_dir is a fixture)


def sources(n=8):
    out = []
    for i in range(n):
        t = traj(f"src/{i}", n=9, obs=20)
        for s in t["steps"]:
            s["kind"] = ("bash", "code", "tool_call")[i % 3]  # whatever the source agent ran
        out.append(Trajectory.model_validate(t))
    return out


def test_the_fact_is_shown_first_and_needed_last_and_fillers_come_from_the_training_split():
    trajs = sources()
    sessions = recall_sessions(trajs, 40, val_fraction=0.4, seed=1)
    assert len({s.id for s in sessions}) == 40 and all(s.id.startswith("recall/") for s in sessions)
    train_ids = {t.id for t in trajs if split_of(t.id, 0.4) == "train"}
    assert train_ids and len(train_ids) < len(trajs)  # both splits exist among the sources
    for s in sessions:
        fact = s.model_extra["meta"]["fact"]
        assert fact in s.steps[0].observation and fact in s.steps[-1].action
        assert all(fact not in (x.observation or "") + x.action for x in s.steps[1:-1])  # nowhere in between
        assert s.model_extra["meta"]["source"] in train_ids  # no validation trajectory's text
        src = next(t for t in trajs if t.id == s.model_extra["meta"]["source"])
        a, b = s.model_extra["meta"]["source_steps"]
        assert [x.action for x in s.steps[1:-1]] == [x.action for x in src.steps[a:b]]  # real steps, in order
        assert [x.kind for x in s.steps[1:-1]] == [x.kind for x in src.steps[a:b]]  # as they were, not relabelled
    again = recall_sessions(trajs, 40, val_fraction=0.4, seed=1)
    assert [s.model_dump() for s in again] == [s.model_dump() for s in sessions]  # seeded
    assert recall_sessions(trajs, 0, 0.4) == []
    short = recall_sessions(trajs, 5, val_fraction=0.4, seed=1, max_observation_chars=30)
    assert max(len(x.observation or "") for s in short for x in s.steps[1:-1]) == 30


def test_the_data_builder_adds_recall_rows_split_by_session(tmp_path, tok_dir, monkeypatch):  # noqa: F811
    data = tmp_path / "d.jsonl"
    data.write_text("\n".join(json.dumps(traj(f"tr/{i}", n=10, obs=30)) for i in range(6)) + "\n")
    cfg = DataConfig(val_fraction=0.34, recall_sessions=30, **WINDOW)
    report = build_datasets(data, tok_dir, tmp_path / "ds", cfg, parse_policy_config("window"))
    rows = pq.read_table(tmp_path / "ds" / "stage2.parquet").to_pylist()
    recall = [r for r in rows if r["trajectory"].startswith("recall/")]
    # fillers are cut where the run cuts what the memory reads (data.max_observation_chars), not at a constant
    from palimpsest.training import remory_data as module  # where the builder reads it from

    made = []
    monkeypatch.setattr(module, "recall_sessions", lambda *a, **k: made.append(k) or recall_sessions(*a, **k))
    cut = DataConfig(val_fraction=0.34, recall_sessions=3, max_observation_chars=64, recall_steps=12, **WINDOW)
    build_datasets(data, tok_dir, tmp_path / "cut", cut, parse_policy_config("window"))
    assert made and made[0]["max_observation_chars"] == 64 and made[0]["max_fill"] == 12  # data.recall_steps
    assert recall and (report["counts"]["stage2_recall"]["train"]
                       + report["counts"]["stage2_recall"]["val"] == len(recall))
    assert all(r["split"] == split_of(r["trajectory"], 0.34) for r in recall)
    spans = pq.read_table(tmp_path / "ds" / "stage1.parquet").to_pylist()
    assert not any(s["trajectory"].startswith("recall/") for s in spans)  # Stage I reads real text only


def test_recall_steps_sets_how_many_real_steps_lie_between_the_fact_and_its_use():
    """Longer sessions outgrow larger budgets (rows at 3,072 and longer teacher windows); the default keeps the
    sessions every earlier build drew."""
    trajs = [Trajectory.model_validate(traj(f"src/{i}", n=40, obs=20)) for i in range(8)]
    default = recall_sessions(trajs, 30, val_fraction=0.4, seed=1)
    assert [s.model_dump() for s in recall_sessions(trajs, 30, 0.4, seed=1, max_fill=10)] == \
        [s.model_dump() for s in default]
    fills = [len(s.steps) - 2 for s in default]
    assert 4 <= min(fills) and max(fills) <= 10
    long = [len(s.steps) - 2 for s in recall_sessions(trajs, 30, val_fraction=0.4, seed=1, max_fill=30)]
    assert 4 <= min(long) and max(long) <= 30 and max(long) > 10
    with pytest.raises(ValueError, match="max_fill"):
        recall_sessions(trajs, 3, 0.4, max_fill=3)
    with pytest.raises(ValueError, match="recall_steps"):
        DataConfig(recall_steps=2)
