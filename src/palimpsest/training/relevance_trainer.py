"""`palimpsest train-relevance --config configs/relevance/train.yaml`: the relevance predictor, a Ray Train job.

The driver builds the rows (``training.relevance_data.build_rows``: the fit half's turns, each old step's
features from the served embedder and its label from the need annotations) before any worker starts, holds out
a share of the fit half's trajectories to watch, and a TorchTrainer (one CPU worker by default) fits the head:
a logistic regression (``hidden: 0``) or one hidden layer, class-weighted binary cross-entropy, AdamW, full
batch. The worker reports each epoch's loss and the held-out figures and checkpoints the head's arrays; the
driver writes the bundle (``models.relevance_head``) and registers it in MLflow as ``palimpsest-relevance``.
The report half is refused: it is what the predictor is judged on.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path

import numpy as np
from pydantic import Field, ValidationError

from palimpsest.models.registry import mlflow_experiment, tracking_errors, tracking_uri
from palimpsest.models.relevance_head import REGISTERED_RELEVANCE, register_head, write_head
from palimpsest.pipelines.environment import open_runtime
from palimpsest.pipelines.tracking import check, configure
from palimpsest.pipelines.trajectories import half_of, split_of
from palimpsest.platform.config_files import StrictSection, problems, read_yaml
from palimpsest.platform.policies.relevance import FEATURES_VERSION, SCALARS, RelevanceHead
from palimpsest.platform.types import ConfigError, PalimpsestError
from palimpsest.training.relevance_data import Rows, build_rows, ranking


class RelevanceTracking(StrictSection):
    uri: str | None = Field(None, description="MLflow tracking URI; $MLFLOW_TRACKING_URI, else the local store")
    artifact_location: str | None = None
    experiment: str = "palimpsest-relevance"
    register_as: str | None = Field(REGISTERED_RELEVANCE, description="registered model name; None: do not register")


class RelevanceTrainConfig(StrictSection):
    name: str = Field(..., pattern=r"^[\w.-]{1,64}$")
    data: str = Field(..., description="trajectories (JSONL, the shared schema) with need annotations")
    half: str = Field("fit", pattern="^(fit|all)$", description="the hash half trained on (never 'report')")
    holdout: float = Field(0.2, ge=0.0, lt=1.0, description="share of the half's trajectories held out to watch")
    horizon: int = Field(10, ge=1, le=256, description="the epoch ahead, in steps: labels read its needs")
    recent: int = Field(2, ge=1, le=64, description="PACE's N: the steps a boundary shows in full")
    hidden: int = Field(0, ge=0, le=1024, description="hidden units (0: a logistic regression)")
    query_key: bool = Field(False, description="also read q ⊙ k (one feature per embedding dimension) beside the "
                            "scalar features")
    epochs: int = Field(300, ge=1, le=100_000)
    lr: float = Field(3e-3, gt=0)
    weight_decay: float = Field(1e-3, ge=0)
    seed: int = 0
    num_workers: int = Field(1, ge=1, le=1, description="one worker: the rows fit in memory, a full batch")
    ledger: str = Field(".palimpsest/relevance.db", description="the ledger the trajectories are imported into "
                        "(summaries and keys cached there)")
    embedder: str = Field("minilm", description="the served key embedder (minilm) or hashing (tests)")
    tokenizer: str = Field("smollm2", description="token counting: smollm2, approx or a tokenizer.json path")
    storage: str = Field(".palimpsest/ray_results", description="Ray Train's storage folder")
    tracking: RelevanceTracking = RelevanceTracking()


def load_config(path: str | Path) -> RelevanceTrainConfig:
    raw = read_yaml(path, "relevance training config")
    try:
        return RelevanceTrainConfig.model_validate(raw)
    except ValidationError as e:
        raise ConfigError(f"{path}: {problems(e)}") from None


def _standardise(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    mean = x.mean(axis=0).astype(np.float64)
    scale = x.std(axis=0).astype(np.float64)
    return mean, np.where(scale > 1e-8, scale, 1.0)


def fit_head(x: np.ndarray, y: np.ndarray, hidden: int, epochs: int, lr: float, weight_decay: float, seed: int,
             on_epoch=None) -> RelevanceHead:
    """The head fitted on (x, y): standardised features, class-weighted BCE, AdamW on the full batch."""
    import torch

    torch.manual_seed(seed)
    mean, scale = _standardise(x)
    xt = torch.as_tensor((x - mean) / scale, dtype=torch.float32)
    yt = torch.as_tensor(y, dtype=torch.float32)
    layers = [torch.nn.Linear(x.shape[1], hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 1)] if hidden else \
        [torch.nn.Linear(x.shape[1], 1)]
    net = torch.nn.Sequential(*layers)
    pos = float(yt.sum())
    loss_fn = torch.nn.BCEWithLogitsLoss(pos_weight=torch.tensor(max(len(y) - pos, 1.0) / max(pos, 1.0)))
    opt = torch.optim.AdamW(net.parameters(), lr=lr, weight_decay=weight_decay)
    for epoch in range(epochs):
        opt.zero_grad()
        loss = loss_fn(net(xt).squeeze(1), yt)
        loss.backward()
        opt.step()
        if on_epoch:
            on_epoch(epoch, float(loss))
    state = [p.detach().double().numpy() for p in net.parameters()]
    if hidden:
        w1, b1, w2, b2 = state
        return RelevanceHead(mean, scale, w1.T.copy(), b1, w2[0].copy(), float(b2[0]))
    w, b = state
    return RelevanceHead(mean, scale, np.zeros((0, 0)), np.zeros(0), w[0].copy(), float(b[0]))


def _split(rows: Rows, holdout: float) -> tuple[np.ndarray, np.ndarray]:
    """Row masks (train, watch): the watched trajectories are a hash share of the fit half."""
    watch_traj = np.array([split_of("watch/" + name, holdout) == "val" for name in rows.trajectory])
    watch = watch_traj[rows.group] if holdout else np.zeros(rows.y.size, dtype=bool)
    return ~watch, watch


def watch_figures(head: RelevanceHead, rows: Rows, watch: np.ndarray) -> dict:
    """The head against the cosine (the first feature) on the watched rows: the ranking figures of each."""
    if not watch.any():
        return {}
    out = {}
    for name, s in (("head", head.logits(head.read(rows.x[watch]))), ("cosine", rows.x[watch][:, 0])):
        got = ranking(np.asarray(s, dtype=np.float64), rows.y[watch], rows.group[watch])
        out.update({f"watch_{name}_{k}": v for k, v in got.items() if isinstance(v, float)})
    return out


def train_loop(loop_config: dict) -> None:
    """The Ray Train worker: fit the head on the rows the driver built, report its loss, the watched figures and
    the head's arrays as the checkpoint; MLflow from rank 0."""
    import ray.train

    cfg = RelevanceTrainConfig.model_validate(loop_config["train"])
    rows = Rows.load(Path(loop_config["rows"]))
    train, watch = _split(rows, cfg.holdout)
    spec = loop_config.get("mlflow") if ray.train.get_context().get_world_rank() == 0 else None
    every = max(cfg.epochs // 10, 1)
    mlflow = None
    if spec:
        import mlflow

        mlflow.set_tracking_uri(spec["uri"])
        mlflow.start_run(run_id=spec["run_id"])

    def on_epoch(epoch: int, loss: float) -> None:
        if (epoch + 1) % every == 0:
            if mlflow:
                mlflow.log_metric("loss", loss, step=epoch + 1)
            ray.train.report({"epoch": epoch + 1, "loss": loss})

    x = rows.x if cfg.query_key else rows.x[:, : len(SCALARS)]
    head = fit_head(x[train], rows.y[train], cfg.hidden, cfg.epochs, cfg.lr, cfg.weight_decay, cfg.seed, on_epoch)
    final = {"epoch": cfg.epochs, **watch_figures(head, rows, watch)}
    if mlflow:
        mlflow.log_metrics({k: float(v) for k, v in final.items()}, step=cfg.epochs)
        mlflow.end_run()
    with tempfile.TemporaryDirectory() as d:
        np.savez(Path(d) / "head.npz", **head.arrays())
        ray.train.report(final, checkpoint=ray.train.Checkpoint.from_directory(d))


def prepare(cfg: RelevanceTrainConfig, out: Path) -> tuple[Path, dict]:
    """Build the rows on the driver (every error before a worker starts); returns their file and a record."""
    data = Path(cfg.data)
    if not data.is_file():
        raise PalimpsestError(f"data: no trajectories at {data}")
    rt = open_runtime(cfg.ledger, cfg.embedder, cfg.tokenizer)
    rows = build_rows(rt, data, cfg.half, cfg.horizon, cfg.recent)  # type: ignore[arg-type]
    if any(half_of(t) == "report" for t in rows.trajectory) and cfg.half != "all":
        raise PalimpsestError("the rows hold a trajectory of the report half")  # pragma: no cover - by construction
    out.mkdir(parents=True, exist_ok=True)
    path = out / "rows.npz"
    rows.save(path)
    train, watch = _split(rows, cfg.holdout)
    record = {"data": str(data), "half": cfg.half, "trajectories": sorted(set(rows.trajectory)),
              "rows": int(rows.y.size), "positives": int(rows.y.sum()), "turns": len(rows.t),
              "watch_rows": int(watch.sum()), "embedder": rt.embedder.name}
    return path, record


def launch(cfg: RelevanceTrainConfig, track: bool = True) -> dict:
    """Build the rows, fit on Ray Train, write the bundle, register it. Returns a summary."""
    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    if cfg.half == "report":  # pragma: no cover - the config's pattern refuses it first
        raise ConfigError("half: the report half is for judging the predictor, never for training it")
    storage = Path(cfg.storage).resolve()
    work = storage / f"{cfg.name}-data"
    t0 = time.perf_counter()
    rows_path, record = prepare(cfg, work)
    timings = {"prepare_s": round(time.perf_counter() - t0, 1)}
    run_id = None
    if track:
        configure(cfg.tracking.uri, cfg.tracking.artifact_location)
        check()
        mlflow, exp = mlflow_experiment(cfg.tracking.experiment)
        with tracking_errors():
            run = mlflow.start_run(experiment_id=exp, run_name=cfg.name)
            run_id = run.info.run_id
            mlflow.log_params({k: v for k, v in cfg.model_dump().items() if k != "tracking"})
            mlflow.log_dict({**record, "trajectories": record["trajectories"]}, "data.json")
            mlflow.end_run()
    if os.environ.get("RAY_TMPDIR"):
        Path(os.environ["RAY_TMPDIR"]).mkdir(parents=True, exist_ok=True)
    if not ray.is_initialized():
        ray.init(include_dashboard=False, log_to_driver=False, configure_logging=False)
    trainer = TorchTrainer(
        train_loop, train_loop_config={"train": cfg.model_dump(mode="json"), "rows": str(rows_path),
                                       "mlflow": {"uri": tracking_uri(), "run_id": run_id} if run_id else None},
        scaling_config=ScalingConfig(num_workers=cfg.num_workers, use_gpu=False, resources_per_worker={"CPU": 1}),
        torch_config=TorchConfig(backend="gloo"),
        run_config=RunConfig(name=f"{cfg.name}-{int(time.time())}", storage_path=str(storage)))
    t1 = time.perf_counter()
    result = trainer.fit()
    timings["fit_s"] = round(time.perf_counter() - t1, 1)
    if result.error:
        raise PalimpsestError(f"training failed: {result.error}")
    with result.checkpoint.as_directory() as d, np.load(Path(d) / "head.npz", allow_pickle=False) as arrays:
        meta = {"name": cfg.name, "horizon": cfg.horizon, "recent": cfg.recent, "hidden": cfg.hidden,
                "embedder": record["embedder"], "data": {k: v for k, v in record.items() if k != "embedder"},
                "features": list(SCALARS) + (["q*k"] if cfg.query_key else []), "features_version": FEATURES_VERSION}
        head = RelevanceHead.from_arrays(arrays, meta)
    bundle = write_head(work / "bundle", head)
    summary = {"name": cfg.name, "rows": record["rows"], "positives": record["positives"],
               "trajectories": len(record["trajectories"]), "bundle": str(bundle), "mlflow_run_id": run_id,
               "metrics": {k: v for k, v in (result.metrics or {}).items() if isinstance(v, (int, float))},
               "timings": timings}
    if track and run_id:
        summary["registered"] = register_head(bundle, run_id, cfg.tracking.register_as,
                                              {"data": cfg.data, "half": cfg.half, "horizon": str(cfg.horizon)})
    (work / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    return summary


__all__ = ["RelevanceTrainConfig", "fit_head", "launch", "load_config", "prepare", "train_loop"]
