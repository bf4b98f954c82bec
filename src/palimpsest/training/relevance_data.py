"""The relevance predictor's rows: at each turn t of each trajectory (every turn is a boundary candidate), every old
step's feature row (``platform.policies.relevance.features``, what a served boundary computes) and its label, read from
the trajectories' need annotations: does a step of the epoch ahead (t .. t + horizon - 1) need a token that the old
step showed and that nothing appended since t shows again? Those are the needs only the boundary's plan can
serve. Also the ranking figures the predictor is judged on, against the cosine (precision and recall of the
steps the epoch reuses).

Fit on one half, report on the other (``trajectories.split_of``, the halves ``hash_halves`` writes): the rows
record their trajectory, and ``build_rows`` takes only the half it is asked for.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Literal, Sequence

import numpy as np

from palimpsest.pipelines.replay_sessions import Skipped, appears, prepare_sessions
from palimpsest.pipelines.trajectories import Trajectory, file_sha256, half_of, read_trajectories
from palimpsest.platform.policies.base import query_text
from palimpsest.platform.policies.relevance import features
from palimpsest.platform.prompt.render import own_words
from palimpsest.platform.runtime import Runtime
from palimpsest.platform.types import PalimpsestError

Half = Literal["fit", "report", "all"]


def labels(traj: Trajectory, t: int, old: np.ndarray, horizon: int, recent: int = 2) -> np.ndarray:
    """(len(old),) 1 where a step u in [t, t + horizon) has a strong need whose token the old step showed
    (``obs_steps``) and neither the ``recent`` steps shown in full at the boundary nor a step appended since, in
    [t - recent, u), shows or writes: what only the boundary's plan of the old steps can bring."""
    y = np.zeros(len(old), dtype=np.int8)
    pos = {int(i): k for k, i in enumerate(old)}
    texts = [own_words(s) for s in traj.steps]
    for u in range(t, min(t + horizon, len(traj.steps))):
        for need in traj.steps[u].needs:
            if need.strength != "strong":
                continue
            if any(appears(need.token, texts[j]) for j in range(max(t - recent, 0), u)):
                continue
            for i in getattr(need, "obs_steps", None) or [need.last_obs_step]:
                if int(i) in pos:
                    y[pos[int(i)]] = 1
    return y


@dataclass
class Rows:
    x: np.ndarray  # (N, F) float32
    y: np.ndarray  # (N,) int8
    group: np.ndarray  # (N,) int64: one id per (trajectory, t)
    trajectory: list[str]  # per group
    t: list[int]  # per group

    def save(self, path: Path) -> None:
        np.savez_compressed(path, x=self.x, y=self.y, group=self.group, trajectory=np.asarray(self.trajectory),
                            t=np.asarray(self.t))

    @classmethod
    def load(cls, path: Path) -> "Rows":
        with np.load(path, allow_pickle=False) as z:
            return cls(z["x"], z["y"], z["group"], [str(s) for s in z["trajectory"]], [int(v) for v in z["t"]])


def build_rows(rt: Runtime, data: Path, half: Half, horizon: int, recent: int = 2, min_old: int = 1,
               on_trajectory: Callable[[str], None] | None = None) -> Rows:
    """Every (turn, old step) row of the trajectories of ``data`` in ``half``. The runtime's embedder is the one
    the policy serves with (its keys are the snapshot's)."""
    read = read_trajectories(data)
    trajs = [tr for tr in read.trajectories if half == "all" or half_of(tr.id) == half]
    if not trajs:
        raise PalimpsestError(f"{data}: no trajectory in the {half} half")
    skipped: list[Skipped] = []
    sessions = prepare_sessions(rt, trajs, False, file_sha256(data), skipped)
    by_id = {tr.id: tr for tr in trajs}
    xs, ys, gs, names, ts = [], [], [], [], []
    for sess in sessions:
        traj = by_id[sess.session_id]
        full = rt.snapshot(sess.session_id)
        turns = [t for t in range(recent + min_old, full.t) if np.count_nonzero(full.has_key[: t - recent]) >= min_old]
        texts = [query_text(full.upto(t), recent, "recent_first") for t in turns]
        vectors = rt.embedder.embed(texts) if texts else None  # one batch per trajectory (the same vectors)
        for t, text, q in zip(turns, texts, vectors if vectors is not None else []):
            snap = full.upto(t)
            old = np.flatnonzero(snap.has_key[: t - recent])
            xs.append(features(snap, old, q, text))
            ys.append(labels(traj, t, old, horizon, recent))
            gs.append(np.full(old.size, len(names), dtype=np.int64))
            names.append(traj.id)
            ts.append(t)
        if on_trajectory:
            on_trajectory(traj.id)
    if not xs:
        raise PalimpsestError(f"{data}: no turn with an old step to score in the {half} half")
    return Rows(np.concatenate(xs), np.concatenate(ys), np.concatenate(gs), names, ts)


def ranking(scores: np.ndarray, y: np.ndarray, group: np.ndarray, ks: Sequence[int] = (4, 8)) -> dict:
    """How well ``scores`` find the reused steps: per turn, the top k old steps against those reused (precision
    and recall over all turns pooled, turns with a reused step only), and the average precision of the pooled
    ranking within turns (mean over turns with a reused step)."""
    out: dict = {"rows": int(y.size), "positives": int(y.sum()), "turns": int(np.unique(group).size)}
    order = np.lexsort((-scores, group))
    g, yy = group[order], y[order]
    starts = np.flatnonzero(np.r_[True, g[1:] != g[:-1]])
    ends = np.r_[starts[1:], g.size]
    aps = []
    hits = {k: [0, 0, 0] for k in ks}  # found, shown, reused
    for a, b in zip(starts, ends):
        ys = yy[a:b]
        n_pos = int(ys.sum())
        if not n_pos:
            continue
        cum = np.cumsum(ys)
        aps.append(float((cum[ys == 1] / (np.flatnonzero(ys) + 1)).mean()))
        for k in ks:
            top = ys[:k]
            hits[k][0] += int(top.sum())
            hits[k][1] += int(top.size)
            hits[k][2] += n_pos
    out["turns_with_reuse"] = len(aps)
    out["average_precision"] = round(float(np.mean(aps)), 4) if aps else None
    for k, (found, shown, reused) in hits.items():
        out[f"precision_at_{k}"] = round(found / shown, 4) if shown else None
        out[f"recall_at_{k}"] = round(found / reused, 4) if reused else None
    return out


__all__ = ["Rows", "build_rows", "half_of", "labels", "ranking"]
