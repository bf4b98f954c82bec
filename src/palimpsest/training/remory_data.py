"""REMORY training data from agent trajectories, as Parquet.

Stage I samples: spans of observations and actions (at most ``span_tokens`` tokens) that the memory
must let the actor reproduce after a "repeat" instruction.

Stage II samples are built by the code that serves (train like you serve): the trajectories are imported
into a ledger, and at each boundary t the prompt of the memory's policy is compiled at the student's
``budget`` by ``pipelines.replay_sessions.walk_turns`` (the runtime, policies and compiler serving uses), with the
soft positions reserved as serving reserves them. A boundary is one ``eval-actions`` would score
(``pipelines.replay_sessions.teacher_boundaries``): the whole history and the next action fit the teacher's window
(``max_history_tokens``), the budget cannot show it all, and the compiled prompt left some step out.

  teacher  = the whole history, the ``full`` policy's served prompt (ids up to the assistant prompt),
  memory   = what the memory network reads: the raw chat of the steps the compiled prompt rendered below
             full resolution or hid, and ``summary``, the context before the soft slot
             (``platform.prompt.chat.memory_read``, the call serving makes),
  context  = the student's ids before the soft slot, ``bridge`` the recent raw turns and the assistant
             prompt after it (the soft span goes between them),
  target   = the real next assistant response (step t's thought and action).

Rows carry ``history_len`` (the teacher's length) for a curriculum and ``split``: the train/validation
split is by trajectory (a hash of its id), so no result is ever reported on a trajectory trained on.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any, Iterator, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from palimpsest.pipelines.environment import open_runtime
from palimpsest.pipelines.recall_sessions import recall_sessions
from palimpsest.pipelines.replay_sessions import Skipped, prepare_sessions, teacher_boundaries, walk_turns
from palimpsest.pipelines.trajectories import Trajectory, file_sha256, files_sha256, read_files, split_of
from palimpsest.platform.compile.budget import Budget
from palimpsest.platform.prompt.chat import MEMORY_READ_VERSION, memory_read
from palimpsest.platform.types import BudgetError, PalimpsestError

REPEAT_INSTRUCTION = "Repeat the text above exactly."


class DataConfig(BaseModel):
    """What the data builder reads and how: the training config's ``data:`` section is this model, whole.

    ``soft_slots`` and ``seed`` are derived in a training config (from its ``memory:`` and ``optim.seed``:
    ``training.prepare.data_config``) and refused there when set by hand."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    file: str | None = Field(None, description="trajectories (JSONL); Stage I/II Parquet is built from it (a "
                             "training config must name it)")
    extra_files: tuple[str, ...] = Field((), description="more trajectory files read beside ``file`` (ids "
                                         "disjoint from it and each other): each trajectory is split by its id "
                                         "as ``file``'s are, so their held-out trajectories are never trained on")
    max_history_tokens: int = Field(2048, ge=16, le=131072, description="the teacher's window: a boundary's whole "
                                    "history and its target fit in it")
    max_target_tokens: int = Field(64, ge=1)
    min_history_steps: int = Field(2, ge=1, description="the first boundary: this many steps of history")
    stride: int = Field(1, ge=1, description="every stride-th boundary")
    max_observation_chars: int = Field(800, ge=64, description="each field of a step the memory reads is cut to "
                                       "this (its bundle's read: MemoryRead.max_field_chars)")
    span_tokens: int = Field(256, ge=8, description="Stage I: spans of at most this many tokens (training: a multiple "
                             "of memory.block_size, whose default it is)")
    val_fraction: float = Field(0.2, ge=0.0, lt=1.0, description="the share of trajectories (by a hash of the "
                                "id) held out for validation")
    budget: int = Field(1024, ge=64, description="the student's token budget: the policy's prompt is compiled at "
                        "it, with the soft positions reserved, as the served arm compiles it")
    memory_tokens: int = Field(1024, ge=16, description="the memory reads at most this many tokens of what the "
                               "prompt left out (its bundle's read: MemoryRead.max_history_tokens)")
    soft_slots: int = Field(64, ge=0, description="soft positions the budget reserves for the memory (derived: "
                            "MemoryNetwork.slots_for(memory_tokens))")
    embedder: Literal["minilm", "hashing"] = Field("minilm", description="the key embedder the policy plans with "
                                                   "(serving's)")
    recall_sessions: int = Field(0, ge=0, le=100_000, description="programmatic sessions added to Stage II: a fact "
                                 "shown early that a later action needs, around real steps of the training split "
                                 "(pipelines.recall_sessions)")
    recall_steps: int = Field(10, ge=4, le=1000, description="the most real steps between a recall session's fact "
                              "and its use: longer sessions give rows at larger budgets (their history outgrows "
                              "the budget) and longer teacher windows")
    stage1_corpus: str | None = Field(None, description="text added to Stage I's reconstruction spans: a directory "
                                      "of .py/.md/.rst/.txt files, or 'stdlib' (the interpreter's standard library)")
    stage1_chunks: int = Field(0, ge=0, le=10_000_000, description="at most this many corpus spans (0: all)")
    seed: int = Field(0, description="the order of Stage I spans and the recall sessions (derived: optim.seed)")
    # what the memory reads (platform.prompt.chat.MEMORY_READ_VERSION): recorded in report.json and the bundle, so a
    # build of another read is not reused and a model trained on one is warned about where served otherwise
    memory_read: int = MEMORY_READ_VERSION

    @field_validator("memory_read")
    @classmethod
    def _read_version(cls, v: int) -> int:
        if v != MEMORY_READ_VERSION:
            raise ValueError(f"memory_read {v}: this code builds what the memory reads at version "
                             f"{MEMORY_READ_VERSION} only (platform.prompt.chat.MEMORY_READ_VERSION)")
        return v

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")

    def replace(self, **changes: Any) -> "DataConfig":
        """A validated copy with ``changes``."""
        return DataConfig(**{**self.to_dict(), **changes})


def policy_record(policy) -> dict[str, Any]:
    """The resolved policy config the samples are compiled with: its content and its hash (the bundle and
    MLflow keep both; serving compares an arm's hash with its memory's)."""
    return {"config": policy.model_dump(mode="json"), "hash": policy.config_hash()}


def stage2_samples(rt, sess, policy, cfg: DataConfig) -> Iterator[dict[str, Any]]:
    """Stage II rows of one imported session (``pipelines.replay_sessions.prepare_sessions``), compiled as served."""
    limit = Budget(cfg.budget, cfg.max_target_tokens, cfg.soft_slots)  # what the served memory arm reserves
    teachers = {t: (ids, target) for t, ids, target in
                teacher_boundaries(rt, sess, cfg.budget, cfg.max_history_tokens, cfg.max_target_tokens,
                                   cfg.min_history_steps, cfg.soft_slots)
                if (t - cfg.min_history_steps) % cfg.stride == 0}
    if not teachers:
        return
    split = split_of(sess.session_id, cfg.val_fraction)
    tok = rt.ledger.tokenizer
    last = max(teachers)
    for rs, _snap, turn, _s in walk_turns(rt, sess, policy, limit):
        if rs.t > last:
            break
        if rs.t not in teachers or isinstance(turn, BudgetError):
            continue
        read = memory_read(tok, turn, cfg.max_observation_chars, cfg.memory_tokens)
        if read is None:  # the prompt shows every step raw: nothing for the memory to add
            continue
        teacher, target = teachers[rs.t]
        yield {"trajectory": sess.session_id, "t": rs.t, "split": split, "teacher": teacher,
               "memory": read[0], "summary": read[1], "context": list(turn.prompt.context_ids),
               "bridge": list(turn.prompt.bridge_ids), "target": target, "history_len": len(teacher)}


def stage1_samples(traj: Trajectory, tokenizer, cfg: DataConfig) -> Iterator[dict[str, Any]]:
    """``tokenizer``: the actor's ChatTokenizer (``encode`` adds no special token)."""
    split = split_of(traj.id, cfg.val_fraction)
    instruction = tokenizer.encode("\n" + REPEAT_INSTRUCTION + "\n")
    for s in traj.steps:
        for text in (s.action, s.observation):
            if not text:
                continue
            ids = tokenizer.encode(text)
            for start in range(0, len(ids), cfg.span_tokens):
                span = ids[start: start + cfg.span_tokens]
                if len(span) >= 8:
                    yield {"trajectory": traj.id, "t": s.t, "split": split, "span": span,
                           "instruction": instruction, "history_len": len(span)}


CORPUS_SUFFIXES = (".py", ".md", ".rst", ".txt")


def corpus_root(corpus: str) -> Path:
    """The directory of a Stage I corpus: ``stdlib`` is the running interpreter's standard library (Python
    source that every machine running this code has, offline, and no evaluation set contains); anything
    else is a directory."""
    import sysconfig

    root = Path(sysconfig.get_paths()["stdlib"]) if corpus == "stdlib" else Path(corpus).expanduser()
    if not root.is_dir():
        raise PalimpsestError(f"stage1_corpus {corpus!r}: {root} is not a directory")
    return root.resolve()


def corpus_samples(corpus: str, tokenizer, cfg: DataConfig) -> Iterator[dict[str, Any]]:
    """Stage I spans of a text corpus: every ``span_tokens`` tokens of its files (``CORPUS_SUFFIXES``; installed
    packages and test suites left out), files in a seeded order, at most ``stage1_chunks`` spans. A file is
    one "trajectory" (``corpus/<path>``) for the split, so its spans are all train or all validation."""
    root = corpus_root(corpus)
    files = sorted(p for p in root.rglob("*") if p.suffix in CORPUS_SUFFIXES and p.is_file()
                   and not {"site-packages", "dist-packages", "test", "tests", "idlelib"}
                           & set(p.relative_to(root).parts))
    random.Random(cfg.seed).shuffle(files)
    instruction = tokenizer.encode("\n" + REPEAT_INSTRUCTION + "\n")
    n = 0
    for f in files:
        name = f"corpus/{f.relative_to(root).as_posix()}"
        split = split_of(name, cfg.val_fraction)
        try:
            text = f.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        ids = tokenizer.encode(text)
        for k, start in enumerate(range(0, len(ids), cfg.span_tokens)):
            span = ids[start: start + cfg.span_tokens]
            if len(span) < 8:
                continue
            yield {"trajectory": name, "t": k, "split": split, "span": span, "instruction": instruction,
                   "history_len": len(span)}
            n += 1
            if cfg.stage1_chunks and n >= cfg.stage1_chunks:
                return


def stage1_rows(trajectories: list[Trajectory], tokenizer, cfg: DataConfig) -> list[dict[str, Any]]:
    """Every Stage I span: the trajectories' actions and observations, then ``stage1_corpus`` when set."""
    rows = [r for traj in trajectories for r in stage1_samples(traj, tokenizer, cfg)]
    if cfg.stage1_corpus:
        rows += corpus_samples(cfg.stage1_corpus, tokenizer, cfg)
    return rows


def stage2_recall(trajectories: list[Trajectory], cfg: DataConfig) -> list[Trajectory]:
    """The programmatic recall sessions Stage II reads beside ``trajectories`` (``data.recall_sessions``, their
    fillers from the training split only): the same sessions for the same file and config, so an evaluation
    of the rows can import them again."""
    return recall_sessions(trajectories, cfg.recall_sessions, cfg.val_fraction, cfg.seed,
                           max_observation_chars=cfg.max_observation_chars, max_fill=cfg.recall_steps)


def build_datasets(data: Path | list[Path], tokenizer: str, out: Path, cfg: DataConfig, policy) -> dict[str, Any]:
    """Write stage1.parquet (spans in a seeded order) and stage2.parquet (rows sorted by history length: the
    curriculum) into ``out``; returns counts per split, the trajectories of each split and the policy record.
    ``data`` is one trajectory file or several (``file`` and ``extra_files``), ``tokenizer`` the actor's (a folder
    or tokenizer.json), ``policy`` the memory's policy config, ``cfg.embedder`` the key embedder serving uses. An
    input with no usable sample is an error."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    files = [Path(data)] if isinstance(data, (str, Path)) else [Path(f) for f in data]
    read = read_files(files)
    recall = stage2_recall(read.trajectories, cfg)
    out.mkdir(parents=True, exist_ok=True)
    ledger = out / "ledger.db"
    for f in out.glob("ledger.db*"):  # built afresh: the ledger is this build's scratch space
        f.unlink()
    rt = open_runtime(ledger, cfg.embedder, tokenizer)
    try:
        skipped: list[Skipped] = []
        sessions = prepare_sessions(rt, read.trajectories + recall, False, files_sha256(files), skipped)
        tok = rt.ledger.tokenizer
        rows2: list[dict] = []
        rows1 = stage1_rows(read.trajectories, tok, cfg)
        for sess in sessions:
            rows2 += stage2_samples(rt, sess, policy, cfg)
    finally:
        rt.ledger.close()
    errors = list(read.errors) + [f"{s.trajectory}: {s.reason}" for s in skipped]
    if not rows2:
        raise PalimpsestError(f"{', '.join(map(str, files))}: no Stage II boundary: none fits "
                              f"max_history_tokens={cfg.max_history_tokens} with a compiled prompt at budget "
                              f"{cfg.budget} that leaves a step out"
                              + (f" ({'; '.join(errors[:2])})" if errors else ""))
    # Stage II is a curriculum by history length (the seed's); Stage I spans come in a seeded order, so that a
    # run of a few steps sees spans of every length and source (sorted, its first rows are the short tails)
    rows2.sort(key=lambda r: (r["history_len"], r["trajectory"], r["t"]))
    rows1.sort(key=lambda r: (r["trajectory"], r["t"]))
    random.Random(cfg.seed).shuffle(rows1)
    for name, rows in (("stage1", rows1), ("stage2", rows2)):
        pq.write_table(pa.Table.from_pylist(rows), out / f"{name}.parquet")
    counts = {name: {sp: sum(1 for r in rows if r["split"] == sp) for sp in ("train", "val")}
              for name, rows in (("stage1", rows1), ("stage2", rows2))}
    counts["stage1_corpus"] = {sp: sum(1 for r in rows1 if r["split"] == sp and r["trajectory"].startswith("corpus/"))
                               for sp in ("train", "val")}
    counts["stage2_recall"] = {sp: sum(1 for r in rows2 if r["split"] == sp and r["trajectory"].startswith("recall/"))
                               for sp in ("train", "val")}
    report = {"config": cfg.to_dict(), "counts": counts, "skipped": errors, "embedder": cfg.embedder,
              "policy": policy_record(policy), "data_sha256": files_sha256(files),
              "files": {str(f): file_sha256(f) for f in files},
              "trajectories": {sp: sorted({r["trajectory"] for r in rows2 if r["split"] == sp})
                               for sp in ("train", "val")}}
    (out / "report.json").write_text(json.dumps(report, indent=2))
    return report
