import json

import pyarrow.parquet as pq
import pytest

from palimpsest.evaluation.replay import run_replay, write_outputs
from palimpsest.pipelines.replay_sessions import ReplayError
from palimpsest.platform import Ledger, Runtime
from palimpsest.platform.policies import parse_policy_config
from tests.helpers import per_turn

OBS = {
    0: "settings/loader.py: def parse_config(env): return Config(database_url=env['database_url'])",
    1: "images: cat.png dog.png",
    2: "weather: sunny",
    3: "tests/test_loader.py FAILED KeyError: 'database_url'",
}


def traj(tid, n=6):
    steps = []
    for t in range(n):
        needs = []
        if t == n - 1:  # the last action reuses what step 0 showed
            needs = [{"token": "parse_config", "kind": "identifier", "strength": "strong", "first_obs_step": 0,
                      "last_obs_step": 0, "obs_steps": [0], "agent_steps": []},
                     {"token": "4242", "kind": "number", "strength": "weak", "first_obs_step": 1,
                      "last_obs_step": 1, "obs_steps": [1], "agent_steps": []}]
        steps.append({"t": t, "kind": "bash", "action": f"step {t}", "observation": OBS.get(t, f"noise {t} " * 40)
                      + (" 4242" if t == 1 else ""), "obs_source": "user", "needs": needs})
    return {"id": tid, "task": "Fix the failing test", "system": "sys", "steps": steps}


@pytest.fixture
def data(tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_text("\n".join(json.dumps(traj(f"tr/{i}")) for i in range(2)) + "\n{bad line\n")
    return f


def replay(tmp_path, data, budget=250, concat=False, policies=("full", "window", "pace")):
    rt = Runtime(Ledger(tmp_path / "cache.db"))
    return run_replay(rt, data, {p: parse_policy_config(p) for p in policies}, budget, concat=concat)


def test_replay_measures_recall_tokens_and_budget(tmp_path, data):
    res = replay(tmp_path, data, policies=("full", "window", "pace"))
    s = res.summary
    assert s["data"]["trajectories"] == 2 and s["data"]["steps"] == 12 and s["budget"] == 250
    full, window = s["policies"]["full"], s["policies"]["window"]
    assert full["need_recall_strong"] == 1.0 and full["need_recall_weak"] == 1.0 and full["token_ratio"] == 1.0
    assert full["over_budget_steps"] > 0  # the unbudgeted reference
    assert window["over_budget_steps"] == 0 and s["policies"]["pace"]["over_budget_steps"] == 0
    assert window["need_recall_strong"] == 0.0  # step 0 fell out of the window
    assert window["recall_by_distance"]["5-19"] == 0.0 and window["recall_by_distance"]["1-4"] is None
    assert window["token_ratio"] < 1.0 and window["mean_tokens"] < full["mean_tokens"]
    assert s["skipped"] and "line 3" in s["skipped"][0]["reason"]
    rows = [r for r in res.rows if r["policy"] == "pace"]
    assert [r["t"] for r in rows] == list(range(6)) * 2 and all(r["ms"] >= 0 for r in rows)


def test_recoverable_counts_needs_whose_source_is_a_placeholder(tmp_path, data):
    res = replay(tmp_path, data, policies=("pace",), budget=10_000)
    # everything old -> placeholder, planned every turn (in epochs nothing is degraded below the watermark)
    cfg = per_turn("pace", alpha=900.0, beta=950.0, gamma=999.0)
    rt = Runtime(Ledger(tmp_path / "cache.db"))
    s = run_replay(rt, data, {"ph": parse_policy_config(cfg)}, 10_000).summary["policies"]["ph"]
    # the need (parse_config, in step 0's result) is met by the placeholder itself: it names the identifiers its
    # result introduced; nothing is left to recover by glimpse
    assert s["need_recall_strong"] == 1.0 and s["recoverable"] == 0
    assert res.summary["policies"]["pace"]["recoverable"] == 0
    # a result that is mostly about other identifiers: the placeholder's cap keeps those, the need is lost, and
    # it is counted recoverable (the placeholder names the step's id for glimpse)
    crowded = tmp_path / "crowded.jsonl"
    rows = [traj(f"tr/{i}") for i in range(2)]
    for r in rows:
        r["steps"][0]["observation"] += " " + " ".join(f"other_handler_{i} other_handler_{i}" for i in range(6))
    crowded.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    s = run_replay(Runtime(Ledger(tmp_path / "crowded.db")), crowded, {"ph": parse_policy_config(cfg)},
                   10_000).summary["policies"]["ph"]
    assert s["need_recall_strong"] == 0.0 and s["recoverable"] == 2


def test_outputs_are_parquet_json_and_markdown(tmp_path, data):
    res = replay(tmp_path, data)
    write_outputs(res, tmp_path / "out")
    table = pq.read_table(tmp_path / "out" / "steps.parquet")
    assert table.num_rows == 36 and {"policy", "t", "tokens", "strong_hits", "recoverable"} <= set(table.column_names)
    assert json.loads((tmp_path / "out" / "summary.json").read_text())["policies"].keys() == {"full", "window", "pace"}
    assert "| pace |" in (tmp_path / "out" / "summary.md").read_text()


def test_concat_replays_one_session_and_measures_longevity(tmp_path, data):
    s = replay(tmp_path, data, concat=True).summary
    assert s["data"]["steps"] == 14  # 2 x (task message + 6 steps)
    assert s["policies"]["full"]["longevity_steps"] == 14  # recall 1-4 steps back never falls
    for name, m in s["policies"].items():
        first = m["recall_by_window"][0]
        assert first["steps"] == "0-249"
        # longevity fails at the first window whose recall 1-4 steps back is below 0.95
        falls = first["recall_1-4"] is not None and first["recall_1-4"] < 0.95
        assert m["longevity_steps"] == (0 if falls else 14), name


def test_budget_below_a_prefix_skips_that_trajectory_by_name(tmp_path):
    f = tmp_path / "d.jsonl"
    big = traj("big/1")
    big["system"] = "rules " * 400
    f.write_text(json.dumps(traj("ok/1")) + "\n" + json.dumps(big) + "\n")
    s = replay(tmp_path, f, budget=300).summary
    assert any(x["trajectory"] == "big/1" and "smaller than its fixed prefix" in x["reason"] for x in s["skipped"])
    assert s["data"]["steps"] == 6


def test_a_file_with_nothing_valid_is_a_clear_error(tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_text('{"id": "x", "task": "t", "steps": []}\nnot json\n')
    with pytest.raises(ReplayError, match="no valid trajectory"):
        replay(tmp_path, f)


def test_second_replay_reuses_cached_enrichment(tmp_path, data):
    replay(tmp_path, data)
    led = Ledger(tmp_path / "cache.db")
    rt = Runtime(led)
    assert all(rt.enrich(sid) == rt.enrich(sid) for sid in ("tr/0", "tr/1"))
    assert rt.enrich("tr/0").summaries == 0 and rt.enrich("tr/0").keys == 0


def test_needs_are_matched_on_identifier_boundaries_in_the_text_the_actor_receives():
    from palimpsest.pipelines.replay_sessions import appears

    assert appears("id_42", "use id_42 now") and appears("id_42", "(id_42)") and appears("a/b.py", "x a/b.py:3")
    assert not appears("id_42", "use id_423 now") and not appears("config", "parse_config_x")
    assert not appears("", "anything")


def test_far_needs_and_the_last2_floor(tmp_path, data):
    """parse_config is needed at t=5 from step 0 and is in neither step 3 nor 4 nor the prefix: a far need.
    Only-the-last-two-steps misses it; full keeps it."""
    rt = Runtime(Ledger(tmp_path / "cache.db"))
    pols = {"full": parse_policy_config("full"), "last2": parse_policy_config(per_turn("window", k=2))}
    s = run_replay(rt, data, pols, 100_000).summary["policies"]
    assert s["full"]["far_needs"] == 2 and s["full"]["need_recall_far"] == 1.0
    assert s["last2"]["far_needs"] == 2 and s["last2"]["need_recall_far"] == 0.0


def test_action_identifiers_are_a_label_free_check(tmp_path):
    from palimpsest.pipelines.replay_sessions import action_targets

    f = tmp_path / "d.jsonl"
    t = traj("a/1")
    t["steps"][4]["action"] = "python -c 'import settings.loader; settings.loader.parse_config({})'"
    for s in t["steps"]:
        s["needs"] = []  # no annotations at all
    f.write_text(json.dumps(t) + "\n")
    rt = Runtime(Ledger(tmp_path / "cache.db"))
    res = run_replay(rt, f, {"full": parse_policy_config("full"),
                             "last2": parse_policy_config(per_turn("window", k=2))}, 100_000)
    targets = action_targets(rt.snapshot("a/1"))
    # settings.loader.parse_config was never shown as such; parse_config was (step 0), on a word boundary
    assert targets == [(), (), (), (), ("parse_config",), ()]
    assert res.summary["policies"]["full"]["action_id_recall"] == 1.0
    assert res.summary["policies"]["last2"]["action_id_recall"] == 0.0
