import asyncio
import json

import pyarrow.parquet as pq
import pytest

from palimpsest.platform.compile.budget import Budget
from palimpsest.platform.policies import parse_policy_config
from palimpsest.platform.types import PalimpsestError
from palimpsest.training.remory_data import DataConfig, build_datasets, split_of
from tests.models.tiny_tokenizer import tiny_tokenizer


def traj(tid, n=8, obs=60):
    return {"id": tid, "task": "Fix the failing test in settings", "system": "be careful",
            "steps": [{"t": t, "kind": "bash", "thought": f"look at {t}", "action": f"grep -n parse_config_{t} f.py",
                       "observation": f"{t}: def parse_config_{t}(env): return env['database_url']" + " x" * obs}
                      for t in range(n)]}


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    tiny_tokenizer().save_pretrained(d)
    return str(d)


WINDOW = dict(embedder="hashing", max_history_tokens=2400, budget=1000, memory_tokens=300, soft_slots=16,
              max_target_tokens=40)


def test_stage2_rows_are_compiled_prompts_with_the_memory_reading_what_they_left_out(tmp_path, tok_dir):
    from palimpsest.platform.prompt.tokens import get_tokenizer

    tok = get_tokenizer(tok_dir)
    data = tmp_path / "d.jsonl"
    data.write_text("\n".join(json.dumps(traj(f"tr/{i}", n=10, obs=30)) for i in range(6)) + "\n")
    cfg = DataConfig(val_fraction=0.34, **WINDOW)
    report = build_datasets(data, tok_dir, tmp_path / "ds", cfg, parse_policy_config("window"))
    rows = pq.read_table(tmp_path / "ds" / "stage2.parquet").to_pylist()
    assert rows and all(r["history_len"] == len(r["teacher"]) and len(r["teacher"]) + len(r["target"]) <= 2400
                        for r in rows)
    assert [r["history_len"] for r in rows] == sorted(r["history_len"] for r in rows)  # curriculum order
    # the budget binds: the student's ids, its soft positions and the reply fit the budget, the teacher's do not
    assert all(len(r["context"]) + len(r["bridge"]) + 16 + 40 <= 1000 < len(r["teacher"]) + 16 + 40 for r in rows)
    r = max(rows, key=lambda r: r["t"])
    t = r["t"]
    assert tok.decode(r["target"]) == f"look at {t}\ngrep -n parse_config_{t} f.py"
    assert tok.decode(r["teacher"]).endswith("<|im_start|>assistant\n")  # the teacher predicts what comes next
    # the window policy shows the recent steps raw and hides the rest: the memory reads the hidden ones, raw,
    # oldest first, and not the recent ones the text already shows
    memory, student = tok.decode(r["memory"]), tok.decode(r["context"] + r["bridge"])
    assert f"parse_config_{t - 1}(env)" in student and f"parse_config_{t - 1}(env)" not in memory
    hidden = [j for j in range(t) if f"parse_config_{j}(env)" not in student]
    assert hidden == list(range(len(hidden))) and len(hidden) >= 2  # the oldest steps are hidden
    read = [j for j in hidden if f"parse_config_{j}(env)" in memory]
    # at this tiny tokenizer (256 ids, near a byte an id) not even MIN_SHARE_CHARS a field fits memory_tokens:
    # the newest are kept whole, the front cut (test_chat covers the equal shares)
    assert read and read == hidden[-len(read):] and read != hidden and "\n…\n" not in memory
    assert [memory.index(f"parse_config_{j}(env)") for j in read] == sorted(memory.index(f"parse_config_{j}(env)")
                                                                           for j in read)  # oldest first
    # the soft slot is the compaction boundary (platform.compile.epochs): the compacted history before it (with the
    # hidden steps' range lines), only the steps appended since, raw, after it
    context, bridge = tok.decode(r["context"]), tok.decode(r["bridge"])
    assert "glimpse" in context and "glimpse" not in bridge and bridge.startswith("<|im_start|>assistant")
    assert f"parse_config_{t - 1}(env)" in context + bridge
    assert any(len(x["bridge"]) > 3 for x in rows)  # some rows have steps appended after their boundary
    assert r["summary"] == r["context"][-300:] and len(r["memory"]) <= 300
    # split by trajectory: no trajectory on both sides; the report names the policy the rows were compiled with
    train, val = set(report["trajectories"]["train"]), set(report["trajectories"]["val"])
    assert train and not train & val and all(split_of(t, 0.34) == "val" for t in val)
    assert report["policy"]["hash"] == parse_policy_config("window").config_hash()
    assert json.loads((tmp_path / "ds" / "report.json").read_text())["policy"] == report["policy"]
    spans = pq.read_table(tmp_path / "ds" / "stage1.parquet").to_pylist()
    assert spans and all(8 <= len(s["span"]) <= cfg.span_tokens for s in spans)


def test_no_boundary_that_fits_is_a_clear_error(tmp_path, tok_dir):
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps(traj("x/1", n=4, obs=2000)) + "\n")
    with pytest.raises(PalimpsestError, match="no Stage II boundary"):
        build_datasets(data, tok_dir, tmp_path / "ds", DataConfig(max_history_tokens=50, embedder="hashing"),
                       parse_policy_config("pace"))


def test_the_data_builder_and_the_served_turn_hand_the_memory_identical_ids(tmp_path, tok_dir):
    """Train like you serve: for one boundary, the row the data builder writes and the turn serving compiles
    (``serving.turn.turn.run_turn`` over a ledger filled by appends, with serving's memory read) give the memory
    network the same ids, and the actor the same ids around the soft span."""
    from palimpsest.models.memory import MemoryRead
    from palimpsest.pipelines.trajectories import read_trajectories, to_record
    from palimpsest.platform import HashingEmbedder, Ledger, Runtime
    from palimpsest.serving.turn.request import TurnRequest
    from palimpsest.serving.turn.turn import Sized, run_turn, turn_memory

    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps(traj("tr/serve", n=10, obs=30)) + "\n")
    cfg = DataConfig(**WINDOW)
    policy = parse_policy_config("pace")
    build_datasets(data, tok_dir, tmp_path / "ds", cfg, policy)
    rows = pq.read_table(tmp_path / "ds" / "stage2.parquet").to_pylist()
    assert rows
    row = max(rows, key=lambda r: r["t"])

    (tr,) = read_trajectories(data).trajectories
    rt = Runtime(Ledger(tmp_path / "served.db", tokenizer=tok_dir), embedder=HashingEmbedder())
    rt.ledger.create_session(tr.id, tr.task, tr.system, tr.tools)
    for s in tr.steps[: row["t"]]:  # the agent's steps so far, appended one by one as the ingress appends them
        rt.append(tr.id, to_record(s))
    rt.enrich(tr.id)
    mem_cfg = MemoryRead(max_history_tokens=cfg.memory_tokens, max_field_chars=cfg.max_observation_chars)
    seen: dict = {}

    async def memory_for(ct):  # an open gate: the turn is served with the span's room, as the row was built
        seen["memory"] = turn_memory(rt, ct, mem_cfg)
        return {"soft": [[0.0]] * cfg.soft_slots}

    async def generate(request, memory):
        seen["context"], seen["bridge"] = request["context"], request["bridge"]
        return {"text": "ok", "token_ids": [1], "prompt_tokens": 1, "actor_ms": 0.0, "soft_tokens": 0,
                "cached_tokens": 0}

    sized = Sized(rt.policy(policy), Budget(cfg.budget, cfg.max_target_tokens, cfg.soft_slots))
    asyncio.run(run_turn(rt, TurnRequest(tr.id), sized, generate, 0, memory_for))
    assert seen["memory"] == (row["memory"], row["summary"])
    assert (seen["context"], seen["bridge"]) == (row["context"], row["bridge"])


def test_a_stage1_corpus_adds_reconstruction_spans_split_by_file(tmp_path, tok_dir):
    """Stage I reads a text corpus beside the trajectories: every span of its text files, a file wholly on one
    side of the split, installed packages and test suites left out, at most ``stage1_chunks`` spans."""
    from palimpsest.platform.prompt.tokens import get_tokenizer
    from palimpsest.training.remory_data import corpus_root, corpus_samples

    tok = get_tokenizer(tok_dir)
    corpus = tmp_path / "corpus"
    for name in ("a.py", "b.md", "pkg/c.txt", "pkg/d.rst"):
        (corpus / name).parent.mkdir(parents=True, exist_ok=True)
        (corpus / name).write_text(f"def {name.replace('/', '_').replace('.', '_')}(x):\n    return x * 2\n" * 20)
    for skip in ("site-packages/e.py", "tests/f.py", "g.json"):
        (corpus / skip).parent.mkdir(parents=True, exist_ok=True)
        (corpus / skip).write_text("skipped text " * 50)
    cfg = DataConfig(span_tokens=32, val_fraction=0.5, **WINDOW)
    rows = list(corpus_samples(str(corpus), tok, cfg))
    files = {r["trajectory"] for r in rows}
    assert files == {"corpus/a.py", "corpus/b.md", "corpus/pkg/c.txt", "corpus/pkg/d.rst"}
    assert all(8 <= len(r["span"]) <= 32 and r["split"] == split_of(r["trajectory"], 0.5) for r in rows)
    assert "skipped" not in tok.decode([i for r in rows for i in r["span"]])
    text = (corpus / "a.py").read_text()
    assert tok.decode([i for r in rows if r["trajectory"] == "corpus/a.py" for i in r["span"]]) == text  # every span
    assert len(list(corpus_samples(str(corpus), tok, DataConfig(span_tokens=32, stage1_chunks=5, **WINDOW)))) == 5
    assert corpus_root("stdlib").joinpath("json", "__init__.py").is_file()  # offline on every machine
    with pytest.raises(PalimpsestError, match="not a directory"):
        list(corpus_samples(str(tmp_path / "none"), tok, cfg))
    # built with the trajectories, and counted apart
    data = tmp_path / "d.jsonl"
    data.write_text("\n".join(json.dumps(traj(f"tr/{i}", n=10, obs=30)) for i in range(6)) + "\n")
    report = build_datasets(data, tok_dir, tmp_path / "ds", DataConfig(val_fraction=0.34, stage1_corpus=str(corpus),
                                                                        **WINDOW), parse_policy_config("window"))
    spans = pq.read_table(tmp_path / "ds" / "stage1.parquet").to_pylist()
    n_corpus = sum(report["counts"]["stage1_corpus"].values())
    assert n_corpus == sum(1 for s in spans if s["trajectory"].startswith("corpus/")) > 0
    assert sum(report["counts"]["stage1"].values()) == len(spans) > n_corpus
    # Stage I comes in a seeded order, not by length: a run of a few steps sees full spans of every source
    lengths = [len(s["span"]) for s in spans]
    assert lengths[:10] != sorted(lengths)[:10]
    build_datasets(data, tok_dir, tmp_path / "again", DataConfig(val_fraction=0.34, stage1_corpus=str(corpus),
                                                                 **WINDOW), parse_policy_config("window"))
    assert pq.read_table(tmp_path / "again" / "stage1.parquet").to_pylist() == spans  # the same order each build


def test_rows_come_from_every_training_file_split_by_id_and_files_may_not_share_an_id(tmp_path, tok_dir):
    """``data.extra_files``: a second file's boundaries are rows too, each trajectory split by its own id (so a
    held-out trajectory of either file is never trained on); the build records each file's digest; an id in two
    files is refused by name."""
    from palimpsest.pipelines.trajectories import file_sha256, files_sha256

    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_text("\n".join(json.dumps(traj(f"a/{i}", n=10, obs=30)) for i in range(4)) + "\n")
    b.write_text("\n".join(json.dumps(traj(f"b/{i}", n=10, obs=30)) for i in range(4)) + "\n")
    cfg = DataConfig(val_fraction=0.34, **WINDOW)
    one = build_datasets(a, tok_dir, tmp_path / "one", cfg, parse_policy_config("window"))
    both = build_datasets([a, b], tok_dir, tmp_path / "both", cfg, parse_policy_config("window"))
    rows = pq.read_table(tmp_path / "both" / "stage2.parquet").to_pylist()
    assert {r["trajectory"].split("/")[0] for r in rows} == {"a", "b"}
    assert sum(both["counts"]["stage2"].values()) > sum(one["counts"]["stage2"].values())
    assert all(r["split"] == split_of(r["trajectory"], 0.34) for r in rows)
    assert both["files"] == {str(a): file_sha256(a), str(b): file_sha256(b)}
    assert both["data_sha256"] == files_sha256([a, b]) != one["data_sha256"] == file_sha256(a)
    dup = tmp_path / "dup.jsonl"
    dup.write_text(json.dumps(traj("a/1", n=10, obs=30)) + "\n")
    with pytest.raises(PalimpsestError, match="'a/1' is in both"):
        build_datasets([a, dup], tok_dir, tmp_path / "dup", cfg, parse_policy_config("window"))
