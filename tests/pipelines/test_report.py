import json

import pytest

from palimpsest.evaluation.replay import run_replay, write_outputs
from palimpsest.evaluation.replay_report import write_report
from palimpsest.pipelines.replay_sessions import ReplayError
from palimpsest.platform import Ledger, Runtime
from palimpsest.platform.policies import parse_policy_config
from tests.pipelines.test_replay import traj


def test_report_writes_markdown_and_three_plots_across_budgets(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps(traj("tr/0")) + "\n")
    rt = Runtime(Ledger(tmp_path / "cache.db"))
    dirs = []
    for budget in (300, 600):
        res = run_replay(rt, data, {p: parse_policy_config(p) for p in ("full", "pace")}, budget)
        write_outputs(res, tmp_path / f"b{budget}")
        dirs.append(tmp_path / f"b{budget}")
    path = write_report(dirs, tmp_path / "report")
    text = path.read_text()
    assert "budget 300" in text and "budget 600" in text and "| pace |" in text
    for png in ("tokens_per_step.png", "recall_vs_ratio.png", "recall_vs_billed.png", "recall_by_distance.png"):
        blob = (tmp_path / "report" / png).read_bytes()
        assert blob[:8] == b"\x89PNG\r\n\x1a\n" and len(blob) > 5_000


def test_report_of_a_folder_that_is_not_a_replay_is_an_error(tmp_path):
    with pytest.raises(ReplayError, match="not a replay output"):
        write_report([tmp_path], tmp_path)
