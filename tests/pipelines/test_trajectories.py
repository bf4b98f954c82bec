import json

import pytest

from palimpsest.pipelines.trajectories import TrajectoryError, import_file, read_trajectories
from palimpsest.platform import Authority, Ledger


def traj(tid="t/1", n=3, **over):
    d = {
        "id": tid, "split": "dev", "group": "mswea", "task": "Fix parse_config", "system": "sys", "tools": None,
        "steps": [{"t": i, "kind": "bash", "thought": "", "action": f"cat f{i}.py", "observation": f"out {i}",
                   "obs_source": "user", "tool_calls": [], "needs": []} for i in range(n)],
    }
    d.update(over)
    return d


def write(path, lines):
    path.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n")
    return path


def test_malformed_lines_are_named_and_the_rest_imports(tmp_path):
    f = write(tmp_path / "t.jsonl", [traj("good/1"), "{not json", traj("bad/2", steps=[]), [1, 2],
                                     traj("bad/3", task=""), traj("good/4")])
    with Ledger(tmp_path / "l.db") as led:
        report = import_file(led, f)
        assert [sid for sid, _ in report.imported] == ["good/1", "good/4"]
        assert len(report.errors) == 4
        assert report.errors[0].startswith("line 2: not a JSON object")
        assert "line 3 (id 'bad/2')" in report.errors[1] and "no steps" in report.errors[1]
        assert "line 4: expected a JSON object" in report.errors[2]
        assert "line 5 (id 'bad/3')" in report.errors[3] and "task" in report.errors[3]
        assert led.count("good/1") == 3


def test_reimport_is_a_noop_and_a_changed_trajectory_alters_nothing(tmp_path):
    f = write(tmp_path / "t.jsonl", [traj()])
    with Ledger(tmp_path / "l.db") as led:
        import_file(led, f)
        assert not import_file(led, f).errors
        changed = traj()
        changed["steps"][1]["observation"] = "tampered"
        report = import_file(led, write(tmp_path / "c.jsonl", [changed]))
        assert report.errors and "id 't/1'" in report.errors[0] and "different content" in report.errors[0]
        assert led.step_at("t/1", 1).observation == "out 1" and led.count("t/1") == 3


def test_steps_must_be_numbered_in_order(tmp_path):
    bad = traj()
    bad["steps"][1]["t"] = 5
    read = read_trajectories(write(tmp_path / "t.jsonl", [bad]))
    assert not read.trajectories and "numbered 0..n-1" in read.errors[0]


def test_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(TrajectoryError, match="not found"):
        read_trajectories(tmp_path / "nope.jsonl")


def test_authority_and_tool_names_follow_the_source(tmp_path):
    d = traj(n=2)
    d["steps"][1].update(kind="respond", action="Could you give your user id?", obs_source="user_sim",
                         observation="sofia_kim_7287")
    with Ledger(tmp_path / "l.db") as led:
        import_file(led, write(tmp_path / "t.jsonl", [d]))
        s0, s1 = led.step_at("t/1", 0), led.step_at("t/1", 1)
        assert (s0.authority, s0.tool) == (Authority.TOOL, "cat")
        assert (s1.authority, s1.tool) == (Authority.USER, "reply")
