"""What a training run needs before its workers start: the actor's path, the datasets built by the serving code
(``training.remory_data``), and the teacher cache (the frozen actor's targets, computed once per data file
and config)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from palimpsest.models.registry import (
    resolve_actor_path,
)
from palimpsest.platform.policies import load_policy_file
from palimpsest.platform.types import ConfigError
from palimpsest.training.remory_data import DataConfig, build_datasets
from palimpsest.training.train_config import TrainConfig


def curriculum_row(step: int, stage1_steps: int, world: int, rank: int, n_rows: int,
                   replay_every: int = 0) -> tuple[int, int]:
    """(stage, row index) of a global step on one rank. Each stage walks its own rows from the start (they
    are sorted shortest history first: the curriculum), the ranks taking consecutive rows, epoch after
    epoch; Stage II starts at its shortest history, not where the global step count happens to point.
    Stage II counts its distillation steps only: a reconstruction replay (``replay_every``) takes no row's
    turn, so every row is distilled once an epoch."""
    stage = 1 if step < stage1_steps else 2
    local = step if stage == 1 else step - stage1_steps
    if stage == 2 and replay_every > 0:
        local -= (local + 1) // replay_every  # the replays before this step (and this one, if it is one)
    return stage, (local * world + rank) % n_rows


def replays(step: int, stage1_steps: int, every: int) -> bool:
    """Whether global ``step`` (from 0) is a Stage I reconstruction step replayed inside Stage II
    (``optim.stage2_replay_every``): the ``every``-th, ``2 * every``-th, ... step of Stage II."""
    local = step - stage1_steps
    return every > 0 and local >= 0 and local % every == every - 1


def stage1_batch_rows(step: int, world: int, rank: int, n_rows: int, batch: int) -> list[int]:
    """The Stage I row indices of a global step on one rank when each takes ``batch`` rows: consecutive rows,
    rank after rank, epoch after epoch (``batch`` 1 is :func:`curriculum_row`'s walk)."""
    first = (step * world + rank) * batch
    return [(first + j) % n_rows for j in range(batch)]


def _load_rows(data_dir: str, stage: int, split: str = "train") -> list[dict]:
    import pyarrow.parquet as pq

    rows = pq.read_table(Path(data_dir) / f"stage{stage}.parquet").to_pylist()
    return [r for r in rows if r["split"] == split]


@dataclass(frozen=True)
class PreparedRun:
    config: TrainConfig
    actor_path: str
    data_dir: str
    storage: str
    data_report: dict


def resolve_actor(cfg: TrainConfig) -> Path:
    return resolve_actor_path(cfg.actor.path)


def data_config(cfg: TrainConfig) -> DataConfig:
    """The data builder's config of a training config: its ``data:`` section, with the two fields derived from the
    rest (the soft positions the memory takes, ``MemoryNetwork.slots_for``, and the run's seed)."""
    d, m = cfg.data, cfg.memory
    slots = m.slots_for(d.memory_tokens)
    return d.replace(soft_slots=slots, seed=cfg.optim.seed)


def prepare(cfg: TrainConfig) -> PreparedRun:
    """Everything that can fail on bad input, on the driver: actor path, data, sizes."""
    from transformers import AutoConfig


    actor = resolve_actor(cfg)
    arch = AutoConfig.from_pretrained(str(actor))
    if getattr(arch, "model_type", None) not in ("llama", "qwen2", "qwen3", "mistral"):
        raise ConfigError(f"the memory network runs the actor's own decoder layers: {actor} is a "
                          f"{getattr(arch, 'model_type', '?')} model (llama, qwen2, qwen3 and mistral are supported)")
    files = [Path(f) for f in (cfg.data.file, *cfg.data.extra_files)]
    for f in files:
        if not f.is_file():
            raise ConfigError(f"training data not found: {f}")
    data = ", ".join(map(str, files))
    storage = Path(cfg.storage).expanduser().resolve() / cfg.name
    policy = load_policy_file(cfg.tracking.policy_config)
    report = build_datasets(files, str(actor), storage / "data", data_config(cfg), policy)
    if cfg.optim.stage2_steps and not report["counts"]["stage2"]["train"]:
        raise ConfigError(f"{data}: no Stage II training sample (all boundaries fell in the validation split)")
    if cfg.optim.stage1_steps and not report["counts"]["stage1"]["train"]:
        raise ConfigError(f"{data}: no Stage I training sample")
    if cfg.optim.stage2_steps and cfg.optim.teacher_cache:
        report["teachers"] = cache_teachers(cfg, str(actor), storage / "data", report["data_sha256"])
    return PreparedRun(cfg, str(actor), str(storage / "data"), str(storage), report)


TEACHERS = "teachers.parquet"


def _teacher_key(cfg: TrainConfig, actor_path: str, data_sha: str, row: dict) -> str:
    # deferred: loads torch
    from palimpsest.training.teachers import TeacherCache, actor_key

    return TeacherCache.key(actor_key(actor_path, cfg.actor.dtype), data_sha, row["trajectory"], int(row["t"]),
                            row["teacher"], row["target"])


def cache_teachers(cfg: TrainConfig, actor_path: str, data_dir: Path, data_sha: str) -> dict:
    """The teacher of every Stage II training row the run will visit, computed once on the driver (top-k +
    tail mass, the cache ``eval-actions`` keeps; on a GPU when the run uses GPUs and the driver has one):
    workers read it instead of a full teacher pass at every step. Rows already cached (a resumed or
    repeated run) are not computed again."""
    import torch

    # deferred: loads torch
    from palimpsest.models.actor import FrozenActor
    from palimpsest.training.teachers import TeacherCache, compute_teacher

    cache = TeacherCache(data_dir / TEACHERS)
    rows = _load_rows(str(data_dir), 2)
    o, world = cfg.optim, cfg.distributed.num_workers
    visited = sorted({curriculum_row(o.stage1_steps + s, o.stage1_steps, world, r, len(rows), o.stage2_replay_every)[1]
                      for s in range(o.stage2_steps) for r in range(world)
                      if not replays(o.stage1_steps + s, o.stage1_steps, o.stage2_replay_every)})
    todo = [rows[i] for i in visited if _teacher_key(cfg, actor_path, data_sha, rows[i]) not in cache.rows]
    t0 = time.perf_counter()
    if todo:
        device = "cuda" if cfg.distributed.use_gpu and torch.cuda.is_available() else "cpu"
        actor = FrozenActor.from_pretrained(actor_path, dtype=cfg.actor.dtype, device=device)
        for r in todo:
            teacher = compute_teacher(actor, r["teacher"], r["target"])
            cache.put(_teacher_key(cfg, actor_path, data_sha, r), r["trajectory"], int(r["t"]), teacher)
        cache.save()
    return {"rows": len(rows), "visited": len(visited), "computed": len(todo),
            "seconds": round(time.perf_counter() - t0, 1)}
