"""Recorded trajectories as live A/B traffic through the HTTP endpoint.

Each trajectory becomes a session (its arm is assigned by the server's sticky hash), or with ``arms`` one
session per arm (named ``ID@ARM``, the arm chosen explicitly), so that arms are compared on the same
trajectories, pair by pair (experiments/ab_report.py). Its steps are appended one by one as an agent would, and
at the turn points the server compiles the context and the actor proposes the next action. The proposal is
scored against the action the recorded agent really took next (token F1 over identifiers, paths and words), and
the session's mean is posted as its outcome, so arms are compared on what the actor did with the context each
one compiled.
"""

from __future__ import annotations

import re
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from palimpsest.pipelines.trajectories import Trajectory, read_trajectories, to_record
from palimpsest.platform.types import PalimpsestError

_WORD = re.compile(r"[A-Za-z0-9_./:-]+")


def token_f1(pred: str, gold: str) -> float:
    p = Counter(w.lower() for w in _WORD.findall(pred or ""))
    g = Counter(w.lower() for w in _WORD.findall(gold or ""))
    common = sum((p & g).values())
    if not p or not g or not common:
        return 0.0
    precision, recall = common / sum(p.values()), common / sum(g.values())
    return 2 * precision * recall / (precision + recall)


def turn_points(n_steps: int, every: int, first: int) -> list[int]:
    """History lengths t at which a turn is asked (the actor then proposes step t)."""
    pts = list(range(first, n_steps, every))
    if n_steps - 1 >= first and (not pts or pts[-1] != n_steps - 1):
        pts.append(n_steps - 1)
    return pts


@dataclass
class DriveResult:
    sessions: dict[str, str] = field(default_factory=dict)  # session id -> arm
    turns: int = 0
    errors: list[str] = field(default_factory=list)
    f1: dict[str, float] = field(default_factory=dict)
    wall_s: float = 0.0
    started: float = 0.0


def _drive_one(client, traj: Trajectory, sid: str, every: int, first: int, budget: int | None, max_tokens: int,
               max_turns: int, res: DriveResult, arm: str | None = None, tail: bool = True) -> None:
    r = client.post("/v1/sessions", json={"session_id": sid, "task": traj.task, "system": traj.system,
                                          "tools": traj.tools, **({"arm": arm} if arm else {})})
    if r.status_code != 200:
        res.errors.append(f"{sid}: create {r.status_code} {r.text[:200]}")
        return
    res.sessions[sid] = r.json()["arm"]
    points = set(turn_points(len(traj.steps), every, first)[:max_turns])
    scores = []
    # without ``tail``, the session ends with its last turn: the steps after it would be recorded (and enriched)
    # for no turn to read them
    steps = traj.steps if tail or not points else [s for s in traj.steps if s.t <= max(points)]
    for s in steps:
        if s.t in points:
            body = {"max_tokens": max_tokens, **({"budget": budget} if budget else {})}
            r = client.post(f"/v1/sessions/{sid}/turn", json=body)
            if r.status_code == 200:
                res.turns += 1
                scores.append(token_f1(r.json()["action"], s.action))
            else:
                res.errors.append(f"{sid} t={s.t}: turn {r.status_code} {r.text[:200]}")
        rec = to_record(s)
        r = client.post(f"/v1/sessions/{sid}/steps", json={
            "t": rec.t, "kind": rec.kind, "thought": rec.thought, "action": rec.action, "observation": rec.observation,
            "authority": rec.authority.value, "tool": rec.tool})
        if r.status_code != 200:
            res.errors.append(f"{sid} t={s.t}: append {r.status_code} {r.text[:200]}")
            return
    if scores:
        res.f1[sid] = sum(scores) / len(scores)
        client.post(f"/v1/sessions/{sid}/outcome", json={"value": res.f1[sid], "note": "next-action token F1"})


def drive(url: str, data: Path | list[Trajectory], *, prefix: str = "", every: int = 8, first: int = 4,
          budget: int | None = None, max_tokens: int = 24, max_turns: int = 1000, concurrency: int = 4,
          limit: int | None = None, on_session=None, arms: list[str] | None = None, headers: dict | None = None,
          tail: bool = True) -> DriveResult:
    """Drive every trajectory (the first ``limit``) as sessions; with ``arms``, once per arm (paired). Without
    ``tail`` a session stops at its last turn (its later steps are not appended)."""
    import httpx

    trajs = read_trajectories(data).trajectories if isinstance(data, Path) else list(data)
    trajs = trajs[:limit] if limit else trajs
    if not trajs:
        raise PalimpsestError(f"no usable trajectory in {data}")
    res = DriveResult(started=time.time())
    t0 = time.perf_counter()
    with httpx.Client(base_url=url, timeout=600, headers=headers) as client, ThreadPoolExecutor(concurrency) as pool:
        jobs = [(tr, f"{prefix}{tr.id}@{arm}" if arm else f"{prefix}{tr.id}", arm)
                for tr in trajs for arm in (arms or [None])]
        futures = [pool.submit(_drive_one, client, tr, sid, every, first, budget, max_tokens, max_turns, res, arm, tail)
                   for tr, sid, arm in jobs]
        for f, (_, sid, _) in zip(futures, jobs):
            f.result()
            if on_session:
                on_session(sid, res)
    res.wall_s = time.perf_counter() - t0
    return res
