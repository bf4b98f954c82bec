"""REMORY training data from agent trajectories, as Parquet.

Stage I samples: spans of observations and actions (at most ``span_tokens`` tokens) that the memory
must let the actor reproduce after a "repeat" instruction.

Stage II samples, one per compaction boundary t of a trajectory:
  history  = steps before t as the served chat at full resolution, ending with the assistant prompt (the
             teacher's input; it must fit the actor's window, so long trajectories give many boundaries,
             each within ``max_history_tokens``),
  summary  = the same chat with every step before t at its brief rendering (the student's text; the
             memory goes right after it), laid out by ``palimpsest.platform.chat`` as serving lays it out,
  bridge   = the assistant prompt that follows the memory,
  target   = the real next assistant response (step t's thought and action).
Rows carry ``history_len`` for a curriculum by history length and ``split``: the train/validation split
is by trajectory (a hash of its id), so no result is ever reported on a trajectory trained on.
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterator

from palimpsest.pipelines.trajectories import Trajectory, TrajStep, read_trajectories, to_record
from palimpsest.platform.abstraction import RuleSummarizer
from palimpsest.platform.chat import chat_ids, messages_at, raw_history_messages
from palimpsest.platform.tokens import as_chat_tokenizer
from palimpsest.platform.types import PalimpsestError, Resolution, Session

REPEAT_INSTRUCTION = "Repeat the text above exactly."


@dataclass(frozen=True)
class DataConfig:
    max_history_tokens: int = 1024  # the teacher sees the whole history: at most the actor's window
    max_target_tokens: int = 96
    min_history_steps: int = 2
    stride: int = 1  # every stride-th boundary
    span_tokens: int = 128
    val_fraction: float = 0.2
    max_observation_chars: int = 4000  # an observation is cut to this in the chat history (both sides)

    def __post_init__(self) -> None:
        if not 0.0 <= self.val_fraction < 1.0:
            raise ValueError("val_fraction must be within [0, 1)")
        for name in ("max_history_tokens", "max_target_tokens", "min_history_steps", "stride", "span_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")


def split_of(trajectory_id: str, val_fraction: float) -> str:
    h = int(hashlib.sha256(trajectory_id.encode()).hexdigest()[:8], 16) / 0xFFFFFFFF
    return "val" if h < val_fraction else "train"


def _assistant(step: TrajStep) -> str:
    return "\n".join(x for x in (step.thought, step.action) if x).strip() or "(no action)"


def stage2_samples(traj: Trajectory, tokenizer, cfg: DataConfig) -> Iterator[dict[str, Any]]:
    """Stage II boundaries laid out by the serving prompt's own module (``palimpsest.platform.chat``): the
    teacher's history is the served chat at full resolution, the student's summary the same chat with every
    step at its brief rendering (the soft span follows it), the bridge the assistant prompt."""
    chat = as_chat_tokenizer(tokenizer)
    writer = RuleSummarizer()
    records = [to_record(s) for s in traj.steps]
    briefs = [writer.summarize(r).brief for r in records]
    session = Session(id=traj.id, task=traj.task, system=traj.system or "")
    split = split_of(traj.id, cfg.val_fraction)
    cap = cfg.max_observation_chars
    for t in range(cfg.min_history_steps, len(traj.steps), cfg.stride):
        target_text = _assistant(traj.steps[t])
        history = chat_ids(chat, raw_history_messages(session, records[:t], cap)).all
        if len(history) > cfg.max_history_tokens:
            break  # histories only grow with t: no later boundary of this trajectory fits either
        summary = chat_ids(chat, messages_at(session, records[:t], [Resolution.BRIEF] * t, briefs[:t], cap))
        target = chat.encode(target_text)[: cfg.max_target_tokens]
        yield {"trajectory": traj.id, "t": t, "split": split, "history": history,
               "summary": list(summary.context), "bridge": list(summary.bridge),
               "target": target, "history_len": len(history)}


def stage1_samples(traj: Trajectory, tokenizer, cfg: DataConfig) -> Iterator[dict[str, Any]]:
    split = split_of(traj.id, cfg.val_fraction)
    instruction = tokenizer.encode("\n" + REPEAT_INSTRUCTION + "\n", add_special_tokens=False)
    for s in traj.steps:
        for text in (s.action, s.observation):
            if not text:
                continue
            ids = tokenizer.encode(text, add_special_tokens=False)
            for start in range(0, len(ids), cfg.span_tokens):
                span = ids[start: start + cfg.span_tokens]
                if len(span) >= 8:
                    yield {"trajectory": traj.id, "t": s.t, "split": split, "span": span,
                           "instruction": instruction, "history_len": len(span)}


def build_datasets(data: Path, tokenizer, out: Path, cfg: DataConfig = DataConfig()) -> dict[str, Any]:
    """Write stage1.parquet and stage2.parquet into ``out`` (rows sorted by history length: the
    curriculum); returns counts per split. An input with no usable sample is an error."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    read = read_trajectories(data)
    rows1: list[dict] = []
    rows2: list[dict] = []
    for traj in read.trajectories:
        rows1 += stage1_samples(traj, tokenizer, cfg)
        rows2 += stage2_samples(traj, tokenizer, cfg)
    if not rows2:
        raise PalimpsestError(f"{data}: no Stage II boundary fits max_history_tokens={cfg.max_history_tokens}"
                              + (f" ({'; '.join(read.errors[:2])})" if read.errors else ""))
    out.mkdir(parents=True, exist_ok=True)
    for name, rows in (("stage1", rows1), ("stage2", rows2)):
        rows.sort(key=lambda r: (r["history_len"], r["trajectory"], r["t"]))
        pq.write_table(pa.Table.from_pylist(rows), out / f"{name}.parquet")
    counts = {name: {sp: sum(1 for r in rows if r["split"] == sp) for sp in ("train", "val")}
              for name, rows in (("stage1", rows1), ("stage2", rows2))}
    return {"config": asdict(cfg), "counts": counts, "skipped": read.errors,
            "trajectories": {sp: sorted({r["trajectory"] for r in rows2 if r["split"] == sp}) for sp in ("train", "val")}}
