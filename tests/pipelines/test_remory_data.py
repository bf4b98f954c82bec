import json

import pyarrow.parquet as pq
import pytest

from palimpsest.pipelines.remory_data import DataConfig, build_datasets, split_of
from palimpsest.platform.types import PalimpsestError
from tests.models.tiny_tokenizer import tiny_tokenizer


def traj(tid, n=8, obs=60):
    return {"id": tid, "task": "Fix the failing test in settings", "system": "be careful",
            "steps": [{"t": t, "kind": "bash", "thought": f"look at {t}", "action": f"grep -n parse_config_{t} f.py",
                       "observation": f"{t}: def parse_config_{t}(env): return env['database_url']" + " x" * obs}
                      for t in range(n)]}


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


def test_stage2_boundaries_fit_the_window_and_target_the_next_action(tmp_path, tok):
    data = tmp_path / "d.jsonl"
    data.write_text("\n".join(json.dumps(traj(f"tr/{i}")) for i in range(6)) + "\n")
    cfg = DataConfig(max_history_tokens=2000, val_fraction=0.34)
    report = build_datasets(data, tok, tmp_path / "ds", cfg)
    rows = pq.read_table(tmp_path / "ds" / "stage2.parquet").to_pylist()
    assert rows and all(r["history_len"] == len(r["history"]) <= 2000 for r in rows)
    assert [r["history_len"] for r in rows] == sorted(r["history_len"] for r in rows)  # curriculum order
    r = next(r for r in rows if r["t"] == 3)
    assert tok.decode(r["target"]) == "look at 3\ngrep -n parse_config_3 f.py"
    assert tok.decode(r["history"]).endswith("<|im_start|>assistant\n")  # the teacher predicts what comes next
    assert "parse_config_2(env)" in tok.decode(r["history"]) and "parse_config_2(env)" not in tok.decode(r["summary"])
    assert "brief summary; glimpse(#2)" in tok.decode(r["summary"]) and len(r["summary"]) < len(r["history"])
    # split by trajectory: no trajectory on both sides
    train, val = set(report["trajectories"]["train"]), set(report["trajectories"]["val"])
    assert train and not train & val and all(split_of(t, 0.34) == "val" for t in val)
    spans = pq.read_table(tmp_path / "ds" / "stage1.parquet").to_pylist()
    assert spans and all(8 <= len(s["span"]) <= cfg.span_tokens for s in spans)


def test_long_histories_stop_at_the_window(tmp_path, tok):
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps(traj("long/1", n=30, obs=100)) + "\n")
    build_datasets(data, tok, tmp_path / "ds", DataConfig(max_history_tokens=1500))
    rows = pq.read_table(tmp_path / "ds" / "stage2.parquet").to_pylist()
    assert 0 < len(rows) < 28 and max(r["history_len"] for r in rows) <= 1500


def test_no_boundary_that_fits_is_a_clear_error(tmp_path, tok):
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps(traj("x/1", n=4, obs=2000)) + "\n")
    with pytest.raises(PalimpsestError, match="no Stage II boundary fits max_history_tokens=50"):
        build_datasets(data, tok, tmp_path / "ds", DataConfig(max_history_tokens=50))


def test_training_histories_are_the_served_chat(tmp_path, tok):
    """Train like you serve: a Stage II history is exactly the chat the serving path builds from the ledger
    for the memory (same module, same roles, same ids). Its summary is the same chat at brief rendering (its
    placeholders name steps by t: ledger ids are global to a ledger and differ between deployments)."""
    from palimpsest.pipelines.remory_data import stage2_samples
    from palimpsest.pipelines.trajectories import import_trajectory, read_trajectories
    from palimpsest.platform import Ledger, Runtime
    from palimpsest.platform.chat import chat_ids, raw_history_messages
    from palimpsest.platform.tokens import as_chat_tokenizer

    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps(traj("tr/serve", n=5, obs=5)) + "\n")
    (tr,) = read_trajectories(data).trajectories
    rows = list(stage2_samples(tr, tok, DataConfig(max_history_tokens=5000)))
    rt = Runtime(Ledger(tmp_path / "l.db"))
    import_trajectory(rt.ledger, tr)
    rt.enrich(tr.id)
    chat = as_chat_tokenizer(tok)
    for row in rows:
        snap = rt.snapshot(tr.id, at=row["t"])
        served = chat_ids(chat, raw_history_messages(snap.session, snap.steps)).all  # what serving encodes
        assert row["history"] == served
        # the summary side is the same chat at brief rendering: every step's assistant line, then its brief
        text = tok.decode(row["summary"])
        assert text.count("brief summary; glimpse(#") == snap.t and text.endswith("<|im_end|>\n")
