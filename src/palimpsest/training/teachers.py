"""Teacher distributions: the actor's next-token distribution given the whole history, kept as its top-k
tokens plus the tail mass, computed once and cached in Parquet.

``eval-actions`` scores every student against them, and Stage II of REMORY training reads them instead
of recomputing the teacher's full-vocabulary logits at every step. The KL is taken over the partition
{the teacher's top-k, the rest} (``coarse_kl``), a lower bound of the full KL that is exact as k grows.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

TOP_K = 64


@dataclass
class Teacher:
    ids: torch.Tensor  # (R, k) the teacher's most likely tokens, most likely first
    logp: torch.Tensor  # (R, k) their log-probabilities
    tail: torch.Tensor  # (R,) log of the probability mass outside the top k

    def to(self, device) -> "Teacher":
        """The same teacher on ``device`` (a cached one is read on the CPU; the student may be on a GPU)."""
        return Teacher(self.ids.to(device), self.logp.to(device), self.tail.to(device))


#: The least log-mass a cached tail is taken to have (a teacher that put none outside its top k).
_MIN_LOG_TAIL = -69.0  # ~1e-30


def _log_rest(logp: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """(R,) log of the probability mass outside ``ids``: a logsumexp over the remaining tokens (-inf when none
    remain). ``1 - sum(top-k)`` in float32 loses it for a confident teacher: it rounds to 0 (or below)."""
    return logp.scatter(-1, ids, float("-inf")).logsumexp(-1)


def teacher_of(logits: torch.Tensor, k: int = TOP_K) -> Teacher:
    logp = F.log_softmax(logits.float(), -1)
    top, ids = logp.topk(min(k, logp.shape[-1]), -1)
    return Teacher(ids, top, _log_rest(logp, ids))


def coarse_kl(q_logits: torch.Tensor, teacher: Teacher) -> torch.Tensor:
    """(R,) KL(q || p) per position over the partition {the teacher's top-k tokens, the rest}: a lower bound
    of the full-vocabulary KL, exact as k grows (k = the vocabulary: the full KL). Differentiable in
    ``q_logits`` (Stage II trains on it)."""
    log_q = F.log_softmax(q_logits.float(), -1)
    teacher = teacher.to(log_q.device)
    q_k = log_q.gather(-1, teacher.ids)
    q_rest = _log_rest(log_q, teacher.ids)
    some = torch.isfinite(q_rest)  # no rest at all (k = the vocabulary): that term is 0
    q_rest = torch.where(some, q_rest, torch.zeros_like(q_rest))
    tail = teacher.tail.to(q_rest).clamp(min=_MIN_LOG_TAIL)
    rest_term = torch.where(some, q_rest.exp() * (q_rest - tail), torch.zeros_like(q_rest))
    kl = (q_k.exp() * (q_k - teacher.logp)).sum(-1) + rest_term
    return kl.clamp(min=0)


def score(q_logits: torch.Tensor, target: torch.Tensor, teacher: Teacher) -> dict[str, float]:
    """KL(q || p) over {teacher top-k, rest}, NLL of the target under q, top-1 agreement; means per token."""
    log_q = F.log_softmax(q_logits.float(), -1)
    teacher, target = teacher.to(log_q.device), target.to(log_q.device)
    nll = -log_q.gather(-1, target[:, None])[:, 0]
    top1 = (log_q.argmax(-1) == teacher.ids[:, 0]).float()
    return {"kl": float(coarse_kl(q_logits, teacher).mean()), "nll": float(nll.mean()), "top1": float(top1.mean())}


def actor_key(path: str, dtype: str = "float32") -> str:
    """What a teacher distribution depends on besides the boundary: the actor's weights and dtype."""
    return f"{path}:{dtype}"


@torch.no_grad()  # not inference mode: a teacher is a constant of a training loss, which autograd saves
def compute_teacher(actor, teacher_ids: list[int], target: list[int], k: int = TOP_K) -> Teacher:
    """The teacher at one boundary: the actor over [whole history; target], on the target positions."""
    device = next(actor.model.parameters()).device
    ids = torch.tensor(list(teacher_ids) + list(target), dtype=torch.long, device=device)
    logits = actor(input_ids=ids[None], last=len(target) + 1)[0, : len(target)]
    t = teacher_of(logits, k)
    return Teacher(t.ids.cpu(), t.logp.cpu(), t.tail.cpu())


class TeacherCache:
    """Teacher distributions in Parquet, keyed by (actor, data sha, trajectory, t, target length)."""

    def __init__(self, path: Path | None):
        self.path = path
        self.rows: dict[str, dict] = {}
        self.dirty = False
        self.hits = self.misses = 0
        if path is not None and path.is_file():
            import pyarrow.parquet as pq

            for r in pq.read_table(path).to_pylist():
                self.rows[r["key"]] = r

    @staticmethod
    def key(actor: str, data_sha: str, trajectory: str, t: int, prompt: list[int], target: list[int],
            k: int = TOP_K) -> str:
        """``actor``: the actor's folder and dtype (``actor_key``); ``data_sha``: the trajectory file's;
        ``prompt`` and ``target``: the teacher's ids (a changed layout or template is a different teacher)."""
        ids = hashlib.sha256(json.dumps([list(prompt), list(target)]).encode()).hexdigest()
        return hashlib.sha256(json.dumps([actor, data_sha, trajectory, t, ids, k]).encode()).hexdigest()

    def get(self, key: str) -> Teacher | None:
        r = self.rows.get(key)
        if r is None:
            self.misses += 1
            return None
        self.hits += 1
        return Teacher(torch.tensor(r["ids"], dtype=torch.long), torch.tensor(r["logp"]), torch.tensor(r["tail"]))

    def put(self, key: str, trajectory: str, t: int, teacher: Teacher) -> None:
        self.rows[key] = {"key": key, "trajectory": trajectory, "t": t, "ids": teacher.ids.tolist(),
                          "logp": teacher.logp.tolist(), "tail": teacher.tail.tolist()}
        self.dirty = True

    def save(self) -> None:
        if self.path is None or not self.dirty:
            return
        import pyarrow as pa
        import pyarrow.parquet as pq

        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        pq.write_table(pa.Table.from_pylist(list(self.rows.values())), tmp)
        tmp.replace(self.path)
        self.dirty = False


__all__ = ["TOP_K", "Teacher", "TeacherCache", "actor_key", "coarse_kl", "compute_teacher", "score", "teacher_of"]
