"""The training config: one strict pydantic model, validated before any worker starts."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, ValidationError, model_validator

from palimpsest.models.memory import MemoryConfig
from palimpsest.platform.config_files import StrictSection, problems, read_yaml
from palimpsest.platform.types import ConfigError
from palimpsest.training.remory_data import DataConfig


class ActorSection(StrictSection):
    path: str = Field("smollm2", description="'smollm2' (the converted offline actor) or a local HF folder")
    dtype: Literal["float32", "bfloat16"] = "float32"


class OptimSection(StrictSection):
    stage1_steps: int = Field(40, ge=0)
    stage2_steps: int = Field(80, ge=0)
    lr: float = Field(1e-4, gt=0, description="the LoRA adapters' learning rate")
    lr_slots: float = Field(1e-3, gt=0, description="the per-slot input vectors'")
    lr_readout: float = Field(1e-5, gt=0, description="the readout's (it starts at identity)")
    lr_summary: float = Field(1e-4, gt=0, description="the summary attention's and its gates'")
    lr_span_gate: float = Field(0.01, gt=0, description="the span gate's: Adam moves each of its d + 1 weights "
                                "by about lr a step, so its logit by up to lr (1 + |x|_1), x = the span's mean / "
                                "embed_norm (|x|_1 <= sqrt(d))")
    warmup_steps: int = Field(0, ge=0, description="linear warmup at the start of each stage")
    schedule: Literal["constant", "cosine"] = Field("cosine", description="the learning rate over each stage's "
                                                    "steps after warmup: constant, or cosine to 0 "
                                                    "(training.step.lr_at)")
    grad_accum: int = Field(1, ge=1, le=1024, description="rows per update (gradient accumulation)")
    stage1_batch: int = Field(1, ge=1, le=256, description="Stage I spans per step on each worker, read and "
                              "scored in one batch (losses.stage1_batch_loss): the same loss as one at a time, more "
                              "spans per second (benchmarks/stage1_throughput.py)")
    stage2_replay_every: int = Field(0, ge=0, description="every this many steps of Stage II is a Stage I "
                                     "reconstruction step (a batch of fresh spans, Stage II's learning rate), so "
                                     "that distillation does not unlearn reading; 0: none (the seed's Stage II)")
    stage1_continuation: float = Field(0.0, ge=0.0, le=1.0, description="Stage I's weight of continuation "
                                       "(the memory of a span's first half predicts its second) beside "
                                       "reconstruction")
    autocast: Literal["none", "bfloat16"] = Field(
        "none", description="mixed precision: the step's forward under torch.autocast at this dtype, the backward "
        "following it (the network's weights, the optimizer and the loss stay at their own dtype); "
        "benchmarks/stage1_throughput.py measures it")
    weight_decay: float = Field(0.0, ge=0)
    grad_clip: float = Field(1.0, gt=0)
    kl_decay: float = Field(0.05, ge=0, description="w_j proportional to 1 / (1 + kl_decay * j)")
    checkpoint_every: int = Field(20, ge=1)
    teacher_cache: bool = Field(True, description="Stage II reads each row's teacher (top-64 + tail mass) computed "
                                "once on the driver, a KL over that partition; false: a full-vocabulary teacher "
                                "pass at every step")
    prefix_cache_rows: int = Field(0, ge=0, le=4096, description="Stage II rows per worker whose context KV cache "
                                   "and memory features are kept for the row's next visit (training.step."
                                   "PrefixCache; ~120 MB per row of 2.6K SmolLM2 ids): epochs over a few rows get "
                                   "~10x cheaper on CPUs; 0 keeps none")
    seed: int = 0


class DistributedSection(StrictSection):
    strategy: Literal["deepspeed", "ddp"] = "deepspeed"
    zero_stage: Literal[2, 3] = 2
    num_workers: int = Field(2, ge=1)
    use_gpu: bool = False
    cpus_per_worker: float = Field(1.0, gt=0)
    max_failures: int = Field(2, ge=0, description="worker failures the run survives (resuming from its checkpoint)")


class TrackingSection(StrictSection):
    uri: str | None = Field(None, description="MLflow tracking URI (a server in production); "
                                              "$MLFLOW_TRACKING_URI, else the local store, when unset")
    artifact_location: str | None = Field(None, description="where a new experiment keeps artifacts (an object "
                                                            "store URI); the server's default when unset")
    experiment: str = "palimpsest-memory"
    register_as: str | None = Field("palimpsest-memory", description="registered model name; None = do not register")
    policy_config: str = Field("configs/policies/pace_plus.yaml",
                               description="the policy config this memory pairs with")


def group_lrs(o: OptimSection) -> dict[str, float]:
    """The learning rate of each parameter group of ``models.memory_network.MemoryNetwork.parameter_groups``."""
    return {"lora": o.lr, "slots": o.lr_slots, "readout": o.lr_readout, "summary": o.lr_summary,
            "span_gate": o.lr_span_gate}


class TrainConfig(StrictSection):
    """The whole training config (``data:`` is ``training.remory_data.DataConfig``, what the data builder
    reads; ``memory:`` is ``models.memory.MemoryConfig``, the network as served)."""

    name: str = Field(..., pattern=r"^[\w.-]{1,64}$")
    actor: ActorSection = ActorSection()
    data: DataConfig  # the data builder's one config; soft_slots and seed are derived (training.prepare.data_config)
    memory: MemoryConfig = MemoryConfig()  # the network's one config (models/memory.py), as trained and served
    optim: OptimSection = OptimSection()
    distributed: DistributedSection = DistributedSection()
    tracking: TrackingSection = TrackingSection()
    storage: str = Field(".palimpsest/ray_results", description="Ray Train run storage (checkpoints)")

    @model_validator(mode="after")
    def _data(self) -> "TrainConfig":
        if self.data.file is None:
            raise ValueError("data.file: the trajectories (JSONL) to train on are required")
        return self

    @model_validator(mode="after")
    def _accumulation(self) -> "TrainConfig":
        o = self.optim
        if o.grad_accum > 1:  # an update must not mix the stages, and a checkpoint must not fall mid-accumulation
            bad = [f"{k} ({getattr(o, k)})" for k in ("stage1_steps", "stage2_steps", "checkpoint_every")
                   if getattr(o, k) % o.grad_accum]
            if bad:
                raise ValueError(f"optim.grad_accum ({o.grad_accum}) must divide {', '.join(bad)}")
        return self

    @model_validator(mode="after")
    def _replay(self) -> "TrainConfig":
        o = self.optim
        if o.stage2_replay_every == 1:
            raise ValueError("optim.stage2_replay_every (1) would make every Stage II step a reconstruction step: "
                             "use 0 (none) or at least 2")
        if o.stage2_replay_every > 1 and o.grad_accum > 1:  # an update must not mix the two losses
            raise ValueError(f"optim.stage2_replay_every ({o.stage2_replay_every}) needs optim.grad_accum 1 "
                             f"(got {o.grad_accum}): an update would mix reconstruction and distillation")
        return self

    @model_validator(mode="after")
    def _stage1_batch(self) -> "TrainConfig":
        m = self.memory  # a batch reads its spans in one pass, which a span needing a merge cannot join
        slots = m.first_level(self.data.span_tokens)
        if self.optim.stage1_batch > 1 and slots > m.max_slots:
            raise ValueError(f"optim.stage1_batch ({self.optim.stage1_batch}) needs spans that need no merge: "
                             f"data.span_tokens {self.data.span_tokens} gives {slots} soft tokens > "
                             f"memory.max_slots {m.max_slots}")
        return self

    @model_validator(mode="after")
    def _stage1_ratio(self) -> "TrainConfig":
        m = self.memory  # a block yields Q soft tokens however few ids fill it: a short span is compressed less
        if self.data.span_tokens % m.block_size:
            raise ValueError(f"data.span_tokens ({self.data.span_tokens}) must be a multiple of memory.block_size "
                             f"({m.block_size}): Stage I must compress at the {m.block_size / m.queries:g} ids per "
                             f"soft token the memory serves at, and a span that fills part of a block gives "
                             f"{m.queries} soft tokens to fewer ids")
        return self


def load_train_config(path: str | Path) -> TrainConfig:
    return parse_train_config(read_yaml(path, "training config"), where=str(path))


#: fields of ``data:`` a training config derives (``training.prepare.data_config``): a file may not set them
DERIVED_DATA = {"soft_slots": "memory (MemoryConfig.slots_for(data.memory_tokens))", "seed": "optim.seed"}


def parse_train_config(data, where: str = "config") -> TrainConfig:
    """A training config from its file's mapping. A dump of a parsed config (what the launcher hands each
    worker) validates with ``TrainConfig.model_validate`` directly."""
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: a training config is a mapping")
    section = data.get("data")
    bad = [f"data.{k} is derived from {v}" for k, v in DERIVED_DATA.items()
           if isinstance(section, dict) and k in section]
    if bad:
        raise ConfigError(f"{where}: invalid training config: {'; '.join(bad)}: leave it out")
    try:
        return TrainConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(f"{where}: invalid training config: {problems(e)}") from None
