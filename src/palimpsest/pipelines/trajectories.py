"""Reading agent trajectories (the JSONL schema of ``shared/data/trajectories/README.md``) into a ledger.

Each line is validated on its own: a malformed line is reported with its line number and id and
the rest of the file still loads; nothing already stored is altered (re-importing a trajectory
is a no-op, importing a changed one is refused by the ledger).
"""

from __future__ import annotations

import hashlib
import json
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from palimpsest.platform.ledger import Ledger
from palimpsest.platform.types import Authority, LedgerError, PalimpsestError, StepRecord


class TrajectoryError(PalimpsestError):
    pass


class Need(BaseModel):
    model_config = ConfigDict(extra="allow")
    token: str
    kind: str
    strength: str
    first_obs_step: int
    last_obs_step: int


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str
    arguments: str | None = None


class TrajStep(BaseModel):
    model_config = ConfigDict(extra="allow")
    t: int = Field(ge=0)
    kind: str
    thought: str = ""
    action: str = ""
    observation: str | None = None
    obs_source: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)
    needs: list[Need] = Field(default_factory=list)

    @field_validator("thought", "action", mode="before")
    @classmethod
    def _none_is_empty(cls, v: Any) -> Any:
        return "" if v is None else v


class Trajectory(BaseModel):
    model_config = ConfigDict(extra="allow")
    id: str = Field(min_length=1)
    task: str = Field(min_length=1)
    system: str = ""
    tools: str | None = None
    group: str | None = None
    steps: list[TrajStep]

    @field_validator("system", mode="before")
    @classmethod
    def _none_is_empty(cls, v: Any) -> Any:
        return "" if v is None else v

    @field_validator("steps")
    @classmethod
    def _ordered(cls, steps: list[TrajStep]) -> list[TrajStep]:
        if not steps:
            raise ValueError("the trajectory has no steps")
        for i, s in enumerate(steps):
            if s.t != i:
                raise ValueError(f"steps must be numbered 0..n-1 in order; position {i} has t={s.t}")
        return steps


def _authority(step: TrajStep) -> Authority:
    # Environment output is untrusted data even when a harness delivers it as a "user" message
    # (mini-swe-agent); a user simulator's or a human's reply is the principal speaking.
    if step.obs_source == "user_sim" or (step.obs_source == "user" and step.kind in ("respond", "message")):
        return Authority.USER
    return Authority.TOOL


def _tool_name(step: TrajStep) -> str | None:
    if step.tool_calls:
        return step.tool_calls[0].name
    if step.kind == "bash" and step.action.strip():
        try:
            return shlex.split(step.action.strip().splitlines()[0])[0][:40]
        except (ValueError, IndexError):
            return step.action.split()[0][:40]
    return {"code": "python", "respond": "reply", "message": "message"}.get(step.kind)


def to_record(step: TrajStep) -> StepRecord:
    return StepRecord(t=step.t, kind=step.kind, thought=step.thought, action=step.action,
                      observation=step.observation, authority=_authority(step), tool=_tool_name(step))


@dataclass
class ReadResult:
    trajectories: list[Trajectory] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)  # "line N (id X): problem"


def read_trajectories(path: str | Path) -> ReadResult:
    """Parse and validate every line; collect per-line errors instead of stopping at the first."""
    p = Path(path)
    if not p.is_file():
        raise TrajectoryError(f"trajectory file not found: {p}")
    out = ReadResult()
    with p.open("rb") as f:
        for n, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            try:
                obj = json.loads(raw.decode("utf-8"))
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                out.errors.append(f"line {n}: not a JSON object ({e})")
                continue
            tid = obj.get("id", "?") if isinstance(obj, dict) else "?"
            if not isinstance(obj, dict):
                out.errors.append(f"line {n}: expected a JSON object, got {type(obj).__name__}")
                continue
            try:
                out.trajectories.append(Trajectory.model_validate(obj))
            except ValidationError as e:
                problems = "; ".join(f"{'.'.join(str(x) for x in err['loc']) or 'line'}: {err['msg']}"
                                     for err in e.errors()[:3])
                out.errors.append(f"line {n} (id {tid!r}): {problems}")
    if not out.trajectories and not out.errors:
        out.errors.append(f"{p}: no trajectories")
    return out


def file_sha256(path: str | Path) -> str:
    h = hashlib.sha256()
    with Path(path).open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def read_files(files: list[Path]) -> ReadResult:
    """The trajectories of several files, in order; an id that two files share is an error (a trajectory would
    be counted twice, and its split would no longer say where it was trained). A file alone reads as
    :func:`read_trajectories` reads it."""
    out, seen = ReadResult(), {}
    for f in files:
        read = read_trajectories(f)
        for traj in read.trajectories:
            if seen.get(traj.id, f) != f:  # a repeat inside one file is the import's to skip, as it always was
                raise TrajectoryError(f"trajectory {traj.id!r} is in both {seen[traj.id]} and {f}: training files "
                                      "must not share ids")
            seen[traj.id] = f
            out.trajectories.append(traj)
        out.errors += [f"{f.name}: {e}" for e in read.errors] if len(files) > 1 else read.errors
    return out


def files_sha256(paths: list[str | Path]) -> str:
    """One file's :func:`file_sha256`; of several, the SHA-256 of their digests in order (what a build of them
    read)."""
    if len(paths) == 1:
        return file_sha256(paths[0])
    return hashlib.sha256("".join(file_sha256(p) for p in paths).encode()).hexdigest()


def import_trajectory(ledger: Ledger, traj: Trajectory, upto: int | None = None) -> int:
    """Create the session and append its steps (all, or those with t < upto). Returns steps stored."""
    ledger.create_session(traj.id, traj.task, traj.system, traj.tools,
                          meta={"group": traj.group, "source": "trajectory-import"})
    steps = traj.steps if upto is None else traj.steps[:upto]
    ledger.append_many(traj.id, [to_record(s) for s in steps])
    return len(steps)


@dataclass
class ImportReport:
    imported: list[tuple[str, int]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


def import_file(ledger: Ledger, path: str | Path, on_trajectory=None) -> ImportReport:
    """Import every valid trajectory of a file; report the ones that were refused and why."""
    read = read_trajectories(path)
    report = ImportReport(errors=list(read.errors))
    for traj in read.trajectories:
        try:
            report.imported.append((traj.id, import_trajectory(ledger, traj)))
        except LedgerError as e:
            report.errors.append(f"id {traj.id!r}: {e}")
        if on_trajectory:
            on_trajectory(traj)
    return report


def split_of(trajectory_id: str, val_fraction: float) -> str:
    """A trajectory's split (``val`` or ``train``), fixed by a hash of its id: the same on every run and machine."""
    h = int(hashlib.sha256(trajectory_id.encode()).hexdigest()[:8], 16) / 0xFFFFFFFF
    return "val" if h < val_fraction else "train"


def half_of(trajectory_id: str) -> str:
    """``fit`` or ``report``: the hash half of a trajectory (``split_of(id, 0.5)``: ``val`` is the fit half)."""
    return "fit" if split_of(trajectory_id, 0.5) == "val" else "report"


def hash_halves(data: str | Path, out: str | Path) -> dict[str, Path]:
    """The file's lines split by a hash of each trajectory's id into ``fit`` (``split_of(id, 0.5) == "val"``) and
    ``report`` halves, written as ``<stem>-fit.jsonl`` and ``<stem>-report.jsonl`` under ``out``: fit on one, report
    on the other, the same halves on every run and machine (``benchmarks/fit_pace_plus.py`` splits dev so)."""
    src, out = Path(data), Path(out)
    out.mkdir(parents=True, exist_ok=True)
    lines: dict[str, list[str]] = {"fit": [], "report": []}
    for line in src.read_text(encoding="utf-8").splitlines():
        try:
            tid = json.loads(line).get("id")
        except (ValueError, AttributeError):
            continue
        if isinstance(tid, str):
            lines[half_of(tid)].append(line)
    paths = {k: out / f"{src.stem}-{k}.jsonl" for k in lines}
    for k, p in paths.items():
        p.write_text("".join(x + "\n" for x in lines[k]), encoding="utf-8")
    return paths
