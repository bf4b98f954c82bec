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


def test_hash_halves_split_by_a_hash_of_the_id_the_same_on_every_run(tmp_path):
    from palimpsest.pipelines.trajectories import hash_halves, split_of

    ids = [f"group/task-{i}" for i in range(40)]
    f = write(tmp_path / "extra.jsonl", [traj(i) for i in ids] + ["{not json"])
    halves = hash_halves(f, tmp_path / "out")
    assert set(halves) == {"fit", "report"} and halves["report"].name == "extra-report.jsonl"
    got = {k: [json.loads(x)["id"] for x in p.read_text().splitlines()] for k, p in halves.items()}
    assert sorted(got["fit"] + got["report"]) == sorted(ids) and not set(got["fit"]) & set(got["report"])
    assert got["fit"] == [i for i in ids if split_of(i, 0.5) == "val"] and 10 < len(got["fit"]) < 30
    again = hash_halves(f, tmp_path / "again")
    assert {k: p.read_text() for k, p in again.items()} == {k: p.read_text() for k, p in halves.items()}
    assert read_trajectories(halves["report"]).trajectories[0].id == got["report"][0]
