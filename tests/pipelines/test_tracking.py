"""A replay is an MLflow run in a local tracking store: params, metrics per policy, artifacts."""

import json

import pytest

from palimpsest.evaluation.replay import run_replay, write_outputs
from palimpsest.pipelines.tracking import log_replay
from palimpsest.platform import Ledger, Runtime
from palimpsest.platform.policies import parse_policy_config
from tests.pipelines.test_replay import traj

pytestmark = pytest.mark.slow


def test_replay_is_logged_as_a_run_with_a_child_per_policy(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps(traj("tr/0")) + "\n")
    res = run_replay(Runtime(Ledger(tmp_path / "c.db")), data,
                     {p: parse_policy_config(p) for p in ("full", "pace")}, 300)
    write_outputs(res, tmp_path / "out")
    run_id = log_replay(res.summary, tmp_path / "out")

    import mlflow

    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{tmp_path / '.palimpsest' / 'mlflow.db'}")
    run = client.get_run(run_id)
    assert run.data.params["budget"] == "300" and run.data.params["data.sha256"] == res.summary["data"]["sha256"]
    children = client.search_runs([run.info.experiment_id], f"tags.mlflow.parentRunId = '{run_id}'")
    by_policy = {c.data.params["policy"]: c for c in children}
    assert set(by_policy) == {"full", "pace"}
    assert by_policy["pace"].data.metrics["need_recall_strong"] == res.summary["policies"]["pace"]["need_recall_strong"]
    assert by_policy["pace"].data.params["config.tau"] == "0.3"
    names = {a.path for a in client.list_artifacts(run_id)}
    assert {"summary.json", "steps.parquet", "summary.md"} <= names


def test_an_ab_report_is_logged_with_its_fidelity_against_cost_plot(tmp_path, monkeypatch):
    """The run holds the summary, the report and a figure of each arm's fidelity against its billed cost."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    from palimpsest.experiments.ab_report import ab_summary, log_ab, summary_markdown
    from palimpsest.experiments.plot import fidelity_cost_points

    served, shadows = [], []
    for i in range(4):
        for arm, billed, kl in (("pace", 900.0 + i, 0.1 + 0.01 * i), ("window", 600.0 + i, 0.3 + 0.01 * i)):
            sid = f"t{i}@{arm}"
            served.append({"session_id": sid, "t": 4, "arm": arm, "tokens_context": 1000, "billed": billed})
            shadows.append({"session_id": sid, "t": 4, "arm": arm, "status": "scored", "reason": "",
                            "reference": "full", "kl": kl, "top1": 0.9, "tokens": 8})
    s = ab_summary(served, [], ["pace", "window"], shadows)
    points = {p["arm"]: p for p in fidelity_cost_points(s)}
    assert points["pace"]["billed"] == pytest.approx(901.5) and points["window"]["kl"] == pytest.approx(0.315)
    run_id, uri = log_ab(s, "ab-test", {"prefix": "t"}, summary_markdown(s))

    import mlflow

    names = {a.path for a in mlflow.MlflowClient(tracking_uri=uri).list_artifacts(run_id)}
    assert {"ab_summary.json", "ab_report.md", "fidelity_vs_cost.png"} <= names


def test_eval_memory_logs_its_paired_verdicts_with_the_run(tmp_path, monkeypatch):
    """The primary result of eval-memory (the memory against each control, per trajectory) is part of its tracked
    run: each control's mean and p-value as metrics, its verdict as a tag, all of it in the run's JSON."""
    from palimpsest.pipelines.tracking import log_actions

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    control = {"n": 8, "mean": -0.05, "p": 0.004, "lo": -0.08, "hi": float("inf"), "significant": True,
               "verdict": "lower", "alpha": 0.05 / 3, "boundaries": 16, "identical": 2}
    result = {"policies": {"pace": {"kl": 0.3}, "pace+memory": {"kl": 0.25}}, "gap_closed": {"pace+memory": 0.17},
              "reference": "pace", "budget": 2048, "held_out_only": True,
              "data": {"file": "a.jsonl, b.jsonl", "sha256": "abc"},
              "paired": {"arm": "pace+memory", "metric": "kl", "controls": {"pace+empty": control}}}
    run_id = log_actions(result, {})

    import mlflow

    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{tmp_path / '.palimpsest' / 'mlflow.db'}")
    run = client.get_run(run_id)
    assert run.data.metrics["paired.paceplusempty.p"] == 0.004
    assert run.data.metrics["paired.paceplusempty.mean"] == -0.05
    assert "paired.paceplusempty.hi" not in run.data.metrics  # an infinite bound is no metric
    assert run.data.tags["paired.paceplusempty"] == "lower"
    assert run.info.run_name == "eval-actions-a+b-2048"
