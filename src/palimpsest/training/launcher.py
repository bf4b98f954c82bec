"""`palimpsest train --config configs/train/<name>.yaml`: REMORY training on Ray Train + DeepSpeed.

The launcher only sets up: it validates the config and builds the datasets on the driver (every error surfaces before a
worker starts), then a TorchTrainer runs :func:`train_loop` on N workers (CPU here, GPUs by config). Each worker wraps
the memory network in a DeepSpeed engine (ZeRO-2 or -3, or plain DDP), keeps the frozen actor outside it, and runs the
pure loss of :mod:`palimpsest.training.losses`: Stage I steps, then Stage II steps from the same weights.

Checkpoints: every K steps each rank writes DeepSpeed's own checkpoint into a directory that ``ray.train.report`` turns
into a Ray Train checkpoint; a restarted worker group (FailureConfig) or a rerun of the same config resumes from the
latest one. MLflow is written by rank 0 only (one run, kept across restarts): params, the resolved config, per-step
metrics, and at the end the weights as a registered model tagged with the policy config it pairs with.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from palimpsest.models.memory import ARCHITECTURE
from palimpsest.models.registry import (
    bundle_record,
    mlflow_experiment,
    register_bundle,
    tracking_errors,
    tracking_uri,
    write_bundle,
)
from palimpsest.pipelines.tracking import check, configure
from palimpsest.platform.types import ConfigError, PalimpsestError
from palimpsest.training.prepare import (
    TEACHERS,
    _load_rows,
    _teacher_key,
    curriculum_row,
    data_config,
    prepare,
    replays,
    stage1_batch_rows,
)
from palimpsest.training.train_config import TrainConfig, group_lrs

__all__ = ["launch", "prepare", "register", "train_loop"]


def ds_config(cfg: TrainConfig) -> dict[str, Any]:
    o = cfg.optim
    out: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": o.grad_accum,
        "gradient_clipping": o.grad_clip,
        "optimizer": {"type": "AdamW", "params": {"lr": o.lr, "weight_decay": o.weight_decay, "torch_adam": True}},
        "zero_optimization": {"stage": cfg.distributed.zero_stage}, "steps_per_print": 1 << 30,
    }
    if cfg.actor.dtype == "bfloat16":
        out["bf16"] = {"enabled": True}
    if o.autocast != "none":  # the engine's forward runs torch.autocast itself (else it turns the step's off)
        out["torch_autocast"] = {"enabled": True, "dtype": o.autocast}
    return out


def build_memory(cfg: TrainConfig, actor) -> "object":
    # deferred: loads torch
    from palimpsest.models.memory_network import MemoryNetwork

    return MemoryNetwork(cfg.memory, actor)


def train_loop(loop_config: dict) -> None:
    """One Ray Train worker. ``loop_config``: {"train": TrainConfig as dict, "actor_path", "data_dir", "mlflow"}."""
    import ray.train
    import torch
    import torch.distributed as dist

    # deferred: loads torch
    from palimpsest.models.actor import FrozenActor
    from palimpsest.training.step import (
        DDPBackend,
        DeepSpeedBackend,
        PrefixCache,
        TrainStep,
        lr_at,
        sample_tensors,
    )

    cfg = TrainConfig.model_validate(loop_config["train"])
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    torch.manual_seed(cfg.optim.seed)  # identical initial weights on every rank
    # the actor, the rows and the network on the worker's device (Ray Train assigns each GPU worker its own)
    device = torch.device("cpu")
    if cfg.distributed.use_gpu:
        import ray.train.torch

        device = ray.train.torch.get_device()
    actor = FrozenActor.from_pretrained(loop_config["actor_path"], dtype=cfg.actor.dtype, device=str(device))
    memnet = build_memory(cfg, actor).to(device)
    o = cfg.optim
    lrs = group_lrs(o)
    backend = (DeepSpeedBackend(memnet, ds_config(cfg), lrs) if cfg.distributed.strategy == "deepspeed"
               else DDPBackend(memnet, lrs, o.weight_decay, o.grad_clip, o.grad_accum))  # plain DDP, for comparison
    engine = getattr(backend, "engine", None)
    prefix = PrefixCache(rows=o.prefix_cache_rows) if o.prefix_cache_rows else None
    run_step = TrainStep(backend, actor, o.kl_decay, prefix, continuation=o.stage1_continuation,
                         autocast=o.autocast)  # the step the ladder and the tests run
    # Stage II's reconstruction replays keep no prefill: their spans would push Stage II's rows out of the cache
    replay_step = TrainStep(backend, actor, o.kl_decay, None, continuation=o.stage1_continuation, autocast=o.autocast)

    step = 0
    ckpt = ray.train.get_checkpoint()
    if ckpt:
        with ckpt.as_directory() as d:
            if engine is not None:
                _, client = engine.load_checkpoint(d, tag="latest_step")
            else:
                client = torch.load(Path(d) / "ddp.pt", weights_only=True)
                backend.load(client)
            step = int(client["step"])
    resumed_from = step

    tracker = _RankZeroTracker(loop_config.get("mlflow"), rank)
    tracker.start(cfg, resumed_at=step)
    rows = {1: _load_rows(loop_config["data_dir"], 1), 2: _load_rows(loop_config["data_dir"], 2)}
    teachers, data_sha = None, loop_config.get("data_sha")
    if cfg.optim.teacher_cache and (Path(loop_config["data_dir"]) / TEACHERS).is_file():
        # deferred: loads torch
        from palimpsest.training.teachers import TeacherCache

        teachers = TeacherCache(Path(loop_config["data_dir"]) / TEACHERS)
    total = cfg.optim.stage1_steps + cfg.optim.stage2_steps
    fault = loop_config.get("fault") or {}
    while step < total:
        phase = 1 if step < cfg.optim.stage1_steps else 2  # the stage whose schedule and rows the step follows
        replay = replays(step, cfg.optim.stage1_steps, cfg.optim.stage2_replay_every)
        stage = 1 if replay else phase  # the loss: a replay is a Stage I step on spans Stage I has not read yet
        data = rows[stage]
        row_index = (stage1_batch_rows(step, world, rank, len(data), cfg.optim.stage1_batch)[0] if replay
                     else curriculum_row(step, cfg.optim.stage1_steps, world, rank, len(data),
                                         cfg.optim.stage2_replay_every)[1])
        row = data[row_index]
        sample = sample_tensors(row, stage, device)
        batch = None
        if stage == 1 and cfg.optim.stage1_batch > 1:  # one batch of spans (spans never need a merge pass)
            batch = [sample_tensors(data[i], 1, device)
                     for i in stage1_batch_rows(step, world, rank, len(data), cfg.optim.stage1_batch)]
        t0 = time.perf_counter()
        # Every rank runs as many merge passes as the rank that needs most (ZeRO-3 gathers per call).
        src = sample["span"] if stage == 1 else sample["memory"]
        passes = torch.tensor(0 if batch else memnet.merge_passes(int(src.numel())),
                              device=device)  # NCCL: device tensors
        if dist.is_initialized():
            dist.all_reduce(passes, op=dist.ReduceOp.MAX)
        teacher = (teachers.get(_teacher_key(cfg, loop_config["actor_path"], data_sha, row))
                   if stage == 2 and teachers is not None else None)  # None: a full teacher pass
        start, steps = (0, cfg.optim.stage1_steps) if phase == 1 else (cfg.optim.stage1_steps, cfg.optim.stage2_steps)
        backend.set_lr(lr_at(step - start, steps, 1.0, cfg.optim.schedule, cfg.optim.warmup_steps))
        figures = (replay_step if replay else run_step)(batch or sample, stage, int(passes), teacher)
        if replay:  # its own curve: Stage II's loss is a KL, this one a reconstruction NLL
            figures["replay_loss"] = figures.pop("loss")
        step += 1
        tokens = sum(int(v.numel()) for s in (batch or [sample]) for v in s.values())
        metrics = {"step": step, "stage": phase, **figures, "lr": backend.lr(), "resumed_from": resumed_from,
                   "seconds": time.perf_counter() - t0,
                   "max_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                   "tokens_per_s": tokens / max(time.perf_counter() - t0, 1e-9),
                   "teacher_cached": float(teacher is not None), "row": float(row_index)}
        if step == cfg.optim.stage1_steps and cfg.optim.stage2_steps and loop_config.get("mlflow"):
            # the network as Stage I left it, beside the run: reconstruction is scored before Stage II too
            with tempfile.TemporaryDirectory() as tmp:
                _export_bundle(cfg, memnet, actor, Path(tmp), engine, loop_config["data_dir"])  # every rank (ZeRO-3)
                tracker.artifacts(tmp, STAGE1_BUNDLE)
        if fault.get("rank") == rank and fault.get("step") == step and not Path(fault["marker"]).exists():
            Path(fault["marker"]).write_text("killed once")  # fault injection for the resume test
            os._exit(1)
        tracker.step(metrics)
        if step % cfg.optim.checkpoint_every == 0 or step == total:
            with tempfile.TemporaryDirectory() as tmp:
                if engine is not None:
                    engine.save_checkpoint(tmp, tag="latest_step", client_state={"step": step})
                elif rank == 0:
                    torch.save({**backend.state(), "step": step}, Path(tmp) / "ddp.pt")
                if step == total:
                    _export_bundle(cfg, memnet, actor, Path(tmp), engine, loop_config["data_dir"])
                ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(tmp))
        else:
            ray.train.report(metrics)
    tracker.finish()
    if engine is not None:
        engine.destroy()
    if dist.is_initialized():
        dist.barrier()


def _export_bundle(cfg: TrainConfig, module, actor, out: Path, engine, data_dir: str | None = None) -> None:
    """Full weights + config for loading without DeepSpeed (gathered under ZeRO-3)."""
    params = list(module.parameters())
    if engine is not None and cfg.distributed.zero_stage == 3:
        import deepspeed

        with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
            state = {k: v.detach().cpu().clone() for k, v in module.state_dict().items()}
    else:
        state = {k: v.detach().cpu().clone() for k, v in module.state_dict().items()}
    report = _data_report(data_dir)
    meta = bundle_record(
        cfg.memory.to_dict(),
        {**cfg.actor.model_dump(), "hidden_size": actor.hidden_size,
         "layers": int(actor.model.config.num_hidden_layers), **actor.fingerprint()},
        policy_config=cfg.tracking.policy_config, name=cfg.name,
        # the resolved policy config the samples were compiled with (content and hash)
        policy={"file": cfg.tracking.policy_config, **(report.get("policy") or {})},
        data={**data_config(cfg).to_dict(), "sha256": report.get("data_sha256"), **_splits(data_dir),
              # the read version the rows were built with (none recorded: version 1, before it was)
              "memory_read": (report.get("config") or {}).get("memory_read")})
    write_bundle(out, state, meta)


STAGE1_BUNDLE = "stage1"  # in a tracked run with a Stage II: the bundle at the end of Stage I (runs:/ID/stage1)
RUN_NETWORK = "network.json"  # in a run's directory: the network its checkpoints hold

#: optim fields a resumed run may change: when checkpoints are written and what is cached, not what is trained
RESUMABLE_OPTIM = frozenset({"checkpoint_every", "prefix_cache_rows"})


def _claim_run_dir(run_dir: Path, cfg: TrainConfig) -> None:
    """A rerun of the same config resumes from its latest checkpoint. A run directory whose checkpoints hold
    another network (another architecture or memory config, or one written before the directory recorded it)
    cannot be resumed: it is moved aside, and the move is said on stderr, so the new run starts from step 0.
    The same network under another recipe (``optim``, but for ``RESUMABLE_OPTIM``) is refused once it holds a
    checkpoint, naming what changed: resuming would train one checkpoint under two recipes."""
    want = {"architecture": ARCHITECTURE, "memory": cfg.memory.to_dict(), "actor": cfg.actor.model_dump()}
    optim = cfg.optim.model_dump()
    marker = run_dir / RUN_NETWORK
    if run_dir.is_dir() and any(run_dir.iterdir()):
        have = json.loads(marker.read_text()) if marker.is_file() else None
        if have is not None and {k: have.get(k) for k in want} == want:
            recorded = have.get("optim")
            defaults = type(cfg.optim)().model_dump()  # a field added since the record: its default was in force
            changed = sorted(k for k in optim if k not in RESUMABLE_OPTIM
                             and (recorded or {}).get(k, defaults.get(k)) != optim[k])
            checkpoints = any(p.name.startswith("checkpoint_") for p in run_dir.iterdir())
            if recorded is not None and changed and checkpoints:
                raise ConfigError(f"{run_dir} holds checkpoints of this network trained with another recipe: "
                                  + "; ".join(f"optim.{k} was {recorded.get(k, defaults.get(k))!r}, "
                                              f"the config says {optim[k]!r}" for k in changed)
                                  + ". Give the run another name, or move the directory away to start from step 0")
            marker.write_text(json.dumps({**want, "optim": optim}, indent=2))
            return
        stamp, n = time.strftime("%Y%m%d-%H%M%S"), 0
        aside = run_dir.with_name(f"{run_dir.name}.replaced-{stamp}")
        while aside.exists():
            n += 1
            aside = run_dir.with_name(f"{run_dir.name}.replaced-{stamp}-{n}")
        run_dir.rename(aside)
        print(f"{run_dir} held checkpoints of another network "
              f"({'unrecorded' if have is None else have.get('architecture')}); moved to {aside}, "
              f"training starts from step 0", file=sys.stderr)
    run_dir.mkdir(parents=True, exist_ok=True)
    marker.write_text(json.dumps({**want, "optim": optim}, indent=2))


def _data_report(data_dir: str | None) -> dict:
    """What the data builder recorded (``report.json``: counts, the policy record, the data's sha)."""
    f = Path(data_dir) / "report.json" if data_dir else None
    return json.loads(f.read_text()) if f is not None and f.is_file() else {}


def _splits(data_dir: str | None) -> dict:
    """The trajectories each split of the training data held, over both stages (Stage I trains on spans of
    trajectories that may have no Stage II row): evaluation refuses the training ones."""
    if data_dir is None or not (Path(data_dir) / "stage2.parquet").is_file():
        return {}
    import pyarrow.parquet as pq

    rows = []
    for stage in ("stage1", "stage2"):
        f = Path(data_dir) / f"{stage}.parquet"
        if f.is_file():
            rows += pq.read_table(f, columns=["trajectory", "split"]).to_pylist()
    return {f"{sp}_trajectories": sorted({r["trajectory"] for r in rows if r["split"] == sp})
            for sp in ("train", "val")}


class _RankZeroTracker:
    """MLflow from rank 0 only; every other rank (and a run without tracking) does nothing."""

    def __init__(self, spec: dict | None, rank: int):
        self.on = bool(spec) and rank == 0
        self.spec = spec or {}

    def start(self, cfg: TrainConfig, resumed_at: int) -> None:
        if not self.on:
            return
        import mlflow

        mlflow.set_tracking_uri(self.spec["uri"])
        mlflow.start_run(run_id=self.spec["run_id"])
        if resumed_at == 0:
            mlflow.log_params({"name": cfg.name, "zero_stage": cfg.distributed.zero_stage,
                               "strategy": cfg.distributed.strategy, "num_workers": cfg.distributed.num_workers,
                               **{f"memory.{k}": v for k, v in cfg.memory.model_dump().items()},
                               **{f"optim.{k}": v for k, v in cfg.optim.model_dump().items()}})
            # the data section as built: its derived fields (soft slots, seed) filled in
            mlflow.log_dict({**cfg.model_dump(mode="json"), "data": data_config(cfg).to_dict()}, "config.json")
        else:
            mlflow.set_tag("resumed_at_step", str(resumed_at))

    def step(self, metrics: dict) -> None:
        if self.on:
            import mlflow

            mlflow.log_metrics({k: float(v) for k, v in metrics.items() if k not in ("step", "resumed_from")},
                               step=int(metrics["step"]))

    def artifacts(self, local_dir: str, path: str) -> None:
        if self.on:
            import mlflow

            mlflow.log_artifacts(local_dir, artifact_path=path)

    def finish(self) -> None:
        if self.on:
            import mlflow

            mlflow.end_run()


def launch(cfg: TrainConfig, fault: dict | None = None, track: bool = True) -> dict:
    """Prepare on the driver, train on Ray Train workers, register the result. Returns a summary."""
    import ray
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    # before the data and the teachers are built: a run this config may not resume is refused first
    _claim_run_dir(Path(cfg.storage).expanduser().resolve() / cfg.name / cfg.name, cfg)
    t_prep = time.perf_counter()
    prep = prepare(cfg)
    timings = {"prepare_s": round(time.perf_counter() - t_prep, 1)}  # data rows (the serving code) + teachers
    mlflow_spec, run_id = None, None
    if track:
        configure(cfg.tracking.uri, cfg.tracking.artifact_location)
        check()
        mlflow, exp = mlflow_experiment(cfg.tracking.experiment)
        with tracking_errors():  # a store that cannot be used is a clear error
            run_id = mlflow.start_run(experiment_id=exp, run_name=cfg.name).info.run_id
            mlflow.end_run()
        mlflow_spec = {"uri": tracking_uri(), "run_id": run_id}
    if os.environ.get("RAY_TMPDIR"):
        Path(os.environ["RAY_TMPDIR"]).mkdir(parents=True, exist_ok=True)
    if not ray.is_initialized():
        ray.init(include_dashboard=False, log_to_driver=False, configure_logging=False)
    d = cfg.distributed
    trainer = TorchTrainer(
        train_loop,
        train_loop_config={"train": cfg.model_dump(mode="json"), "actor_path": prep.actor_path,
                           "data_dir": prep.data_dir, "data_sha": prep.data_report.get("data_sha256"),
                           "mlflow": mlflow_spec, "fault": fault},
        scaling_config=ScalingConfig(num_workers=d.num_workers, use_gpu=d.use_gpu,
                                     resources_per_worker={"CPU": d.cpus_per_worker}),
        torch_config=TorchConfig(backend="nccl" if d.use_gpu else "gloo"),
        run_config=RunConfig(name=cfg.name, storage_path=prep.storage,
                             checkpoint_config=CheckpointConfig(num_to_keep=2),
                             failure_config=FailureConfig(max_failures=d.max_failures)),
    )
    t0 = time.perf_counter()
    result = trainer.fit()
    wall = time.perf_counter() - t0
    if result.error:
        raise PalimpsestError(f"training failed: {result.error}")
    summary = {"name": cfg.name, "wall_s": round(wall, 1), "metrics": dict(result.metrics or {}),
               "checkpoint": result.checkpoint.path if result.checkpoint else None, "data": prep.data_report["counts"],
               "teachers": prep.data_report.get("teachers"),
               "mlflow_run_id": run_id, "timings": {**timings, "fit_s": round(wall, 1)},
               "stage1_bundle": _stage1_bundle(run_id)}
    if track and result.checkpoint is not None:
        t_reg = time.perf_counter()
        summary["registered"] = register(cfg, result.checkpoint, run_id)
        summary["timings"]["register_s"] = round(time.perf_counter() - t_reg, 1)
    return summary


def _stage1_bundle(run_id: str | None) -> str | None:
    """The run's Stage I bundle, where this run logged one (a run resumed past Stage I did not)."""
    if not run_id:
        return None
    import mlflow

    logged = mlflow.MlflowClient().list_artifacts(run_id, STAGE1_BUNDLE)
    return f"runs:/{run_id}/{STAGE1_BUNDLE}" if logged else None


def register(cfg: TrainConfig, checkpoint, run_id: str) -> str | None:
    """Log the final bundle to the run and register it; returns 'models:/NAME/VERSION'."""
    with checkpoint.as_directory() as d:
        return register_bundle(Path(d), run_id, cfg.tracking.register_as,
                               {"policy_config": cfg.tracking.policy_config, "actor": cfg.actor.path})
