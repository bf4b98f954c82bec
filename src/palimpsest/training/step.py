"""The REMORY training step: one row's loss, its gradients, the update and what the step measured.

It is the step the launcher's Ray Train workers run (``launcher.train_loop``), the step the learnability
ladder runs in one process (``benchmarks/remory_ladder.py``) and the step the tests run: one code path.
What differs between them is only the :class:`Backend`, the object that turns a loss into an update:

- :class:`DeepSpeedBackend`: a DeepSpeed engine (ZeRO-2 or -3) around the memory network;
- :class:`DDPBackend`: torch DistributedDataParallel with AdamW (the comparison strategy);
- :class:`LocalBackend`: the network itself with AdamW, in one process.

Every step reports the loss, the global gradient norm before clipping, the norm per parameter group of the
memory network (``grad/lora``, ``grad/slots``, ``grad/readout``, ``grad/summary``), the gates' gradient and
their mean value tanh(g): the evidence a run needs when the loss does not move.

The optimiser recipe (``OptimSection``): a learning rate per parameter group (LoRA, slot vectors, readout,
the summary attention and its gates), linear warmup then cosine decay (:func:`lr_at`), gradient clipping and
gradient accumulation (an update every ``grad_accum`` rows).
"""

from __future__ import annotations

import contextlib
import math
from collections import OrderedDict
from typing import Any, Callable, Protocol

import torch

from palimpsest.models.actor import FrozenActor
from palimpsest.models.memory_network import MemoryNetwork
from palimpsest.training.losses import stage1_batch_loss, stage1_loss, stage2_loss

STAGE1_KEYS = ("span", "instruction")
STAGE2_KEYS = ("teacher", "memory", "summary", "context", "bridge", "target")


def sample_tensors(row: dict, stage: int, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """A Parquet row of ``training.remory_data`` as the loss's tensors."""
    if stage not in (1, 2):
        raise ValueError(f"stage must be 1 or 2, got {stage}")
    keys = STAGE1_KEYS if stage == 1 else STAGE2_KEYS
    return {k: torch.tensor(row[k], dtype=torch.long, device=device) for k in keys}


def unwrap(module) -> MemoryNetwork:
    """The memory network inside a DeepSpeed engine or DDP wrapper (or itself)."""
    return module.module if hasattr(module, "module") else module


def sample_loss(module, actor: FrozenActor, sample: dict, stage: int, *, decay: float = 0.05, passes: int = 0,
                teacher=None, prefix=None, continuation: float = 0.0) -> torch.Tensor:
    """The loss of one row (Stage I: or a list of rows, one batch). ``module`` may be wrapped (calling the wrapper
    keeps its hooks); ``teacher`` is a cached ``training.teachers.Teacher`` (None: a full-vocabulary teacher pass);
    ``prefix`` a :class:`PrefixCache` that keeps each row's constant parts (the context's KV cache, the memory's
    features)."""
    if stage == 1 and isinstance(sample, list):  # a batch of spans: one actor pass
        return stage1_batch_loss(module, actor, sample, continuation, prefix)
    if stage == 1:
        return stage1_loss(module, actor, sample, passes, continuation)
    if stage == 2:
        return stage2_loss(module, actor, sample, decay, passes, teacher, prefix)
    raise ValueError(f"stage must be 1 or 2, got {stage}")


def module_groups(net: MemoryNetwork) -> dict[str, list[torch.nn.Parameter]]:
    """The memory network's parameters by optimiser group (``MemoryNetwork.parameter_groups``)."""
    return OrderedDict((k, [p for p in v if p.requires_grad]) for k, v in net.parameter_groups().items())


def optimizer_groups(net: MemoryNetwork, lrs: dict[str, float], weight_decay: float = 0.0) -> list[dict]:
    """torch/DeepSpeed parameter groups with each group's own learning rate (``lrs``: group -> lr); the gates
    and the slot vectors are never decayed."""
    out = []
    for name, params in module_groups(net).items():
        if name not in lrs:
            raise ValueError(f"no learning rate for parameter group {name!r} (have {sorted(lrs)})")
        out.append({"params": params, "lr": lrs[name], "name": name,
                    "weight_decay": 0.0 if name in ("slots", "summary", "span_gate") else weight_decay})
    return out


def grad_norms(net: MemoryNetwork, grad_of: Callable[[torch.nn.Parameter], torch.Tensor | None]) -> dict[str, float]:
    """The L2 norm of the gradient per top-level module, and of the gate's own gradient; a module whose
    parameters got no gradient reads 0."""
    out: dict[str, float] = {}
    for name, params in module_groups(net).items():
        sq = 0.0
        for p in params:
            g = grad_of(p)
            if g is not None:
                sq += float(g.detach().float().pow(2).sum())
        out[f"grad/{name}"] = math.sqrt(sq)
    out["grad/gate"] = sum(float(g.detach().abs().sum()) for g in (grad_of(p) for p in net.gates()) if g is not None)
    return out


class Backend(Protocol):
    """Turns a loss into an update. ``module`` is what the loss calls (the wrapper, so its hooks apply)."""

    module: Any
    net: MemoryNetwork

    def update(self, loss: torch.Tensor) -> dict[str, float]:
        """Backward, measure, clip, step; returns the gradient figures of this step."""
        ...

    def gate(self) -> float:
        """tanh of the summary gate, whole on every rank (a collective where parameters are partitioned)."""
        ...

    def set_lr(self, factor: float) -> None:
        """The schedule's factor for the next updates (each group at its base rate times it)."""
        ...

    def lr(self) -> float:
        """The learning rate the optimizer holds for its first group (LoRA)."""
        ...


def lr_at(step: int, steps: int, base: float, schedule: str = "constant", warmup: int = 0) -> float:
    """The learning rate of a stage's ``step``-th update (from 0) of ``steps``: a linear warmup over ``warmup``
    steps, then ``constant`` or ``cosine`` (from ``base`` to 0 over the rest of the stage)."""
    if schedule not in ("constant", "cosine"):
        raise ValueError(f"unknown learning-rate schedule {schedule!r} (constant, cosine)")
    if warmup and step < warmup:
        return base * (step + 1) / (warmup + 1)
    if schedule == "constant":
        return base
    rest = max(steps - warmup, 1)
    return base * 0.5 * (1 + math.cos(math.pi * min(step - warmup, rest) / rest))


def set_lr(optimizer, factor: float, bases: list[float]) -> None:
    """Every parameter group of ``optimizer`` (a torch optimizer, or DeepSpeed's ZeRO wrapper) at its base
    learning rate times ``factor`` (the schedule's value)."""
    for group, base in zip(optimizer.param_groups, bases):
        group["lr"] = base * factor


class LocalBackend:
    """The network and AdamW in this process (the ladder, the tests); also DDP's update (see below)."""

    def __init__(self, net: MemoryNetwork, lr: float | dict[str, float], weight_decay: float = 0.0,
                 grad_clip: float = 1.0, module=None, grad_accum: int = 1):
        self.net = net
        self.module = module if module is not None else net
        self.grad_clip, self.grad_accum, self.micro = grad_clip, max(1, grad_accum), 0
        lrs = lr if isinstance(lr, dict) else {k: lr for k in module_groups(net)}
        groups = optimizer_groups(net, lrs, weight_decay)
        self.bases = [g["lr"] for g in groups]
        self.optimizer = torch.optim.AdamW(groups, lr=self.bases[0], weight_decay=weight_decay)

    def update(self, loss: torch.Tensor) -> dict[str, float]:
        (loss / self.grad_accum).backward()
        self.micro += 1
        figures = grad_norms(self.net, lambda p: p.grad)
        if self.micro % self.grad_accum:  # accumulating: no update yet
            return {"grad_norm": float("nan"), **figures}
        norm = torch.nn.utils.clip_grad_norm_(self.net.parameters(), self.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return {"grad_norm": float(norm), **figures}

    def gate(self) -> float:
        gates = self.net.gates()
        return float(sum(torch.tanh(g.detach()).reshape(-1)[0] for g in gates) / len(gates)) if gates else 0.0

    def set_lr(self, factor: float) -> None:
        set_lr(self.optimizer, factor, self.bases)

    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def state(self) -> dict:
        return {"model": self.net.state_dict(), "optim": self.optimizer.state_dict()}

    def load(self, state: dict) -> None:
        self.net.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optim"])


class DDPBackend(LocalBackend):
    """torch DistributedDataParallel (gradients all-reduced in backward) with the local AdamW update."""

    def __init__(self, net: MemoryNetwork, lr: float | dict[str, float], weight_decay: float = 0.0,
                 grad_clip: float = 1.0, grad_accum: int = 1):
        super().__init__(net, lr, weight_decay, grad_clip, module=torch.nn.parallel.DistributedDataParallel(net),
                         grad_accum=grad_accum)


class DeepSpeedBackend:
    """A DeepSpeed engine around the network (``launcher.ds_config``: AdamW, clipping, the ZeRO stage)."""

    def __init__(self, net: MemoryNetwork, config: dict, lrs: dict[str, float] | None = None):
        import deepspeed

        self.net = net
        base = config["optimizer"]["params"]["lr"]
        groups = optimizer_groups(net, lrs or {k: base for k in module_groups(net)},
                                  config["optimizer"]["params"].get("weight_decay", 0.0))
        self.bases = [g["lr"] for g in groups]
        self.engine, *_ = deepspeed.initialize(model=net, model_parameters=groups, config=config)
        self.module = self.engine

    def update(self, loss: torch.Tensor) -> dict[str, float]:
        from deepspeed.utils import safe_get_full_grad

        self.engine.backward(loss)
        figures = grad_norms(self.net, safe_get_full_grad)  # every rank calls it: ZeRO gathers with collectives
        self.engine.step()
        norm = self.engine.get_global_grad_norm()
        return {"grad_norm": float(norm) if norm is not None else float("nan"), **figures}

    def set_lr(self, factor: float) -> None:
        set_lr(self.engine.optimizer, factor, self.bases)

    def lr(self) -> float:
        return float(self.engine.optimizer.param_groups[0]["lr"])

    def gate(self) -> float:
        # under ZeRO-3 a parameter is a partition of it on each rank (empty unless kept whole by the persistence
        # threshold): the optimizer's full fp32 copy is gathered (every rank calls it)
        from deepspeed.utils import safe_get_full_fp32_param

        gates = self.net.gates()
        if not gates:
            return 0.0
        return float(sum(torch.tanh(safe_get_full_fp32_param(g)).reshape(-1)[0] for g in gates) / len(gates))


AUTOCAST = {"none": None, "bfloat16": torch.bfloat16}  # OptimSection.autocast (float16 would need loss scaling)


class TrainStep:
    """One training step on one row: loss (through the frozen actor), update, figures."""

    def __init__(self, backend: Backend, actor: FrozenActor, kl_decay: float = 0.05,
                 prefix: "PrefixCache | None" = None, continuation: float = 0.0, autocast: str = "none"):
        self.backend, self.actor, self.kl_decay, self.prefix = backend, actor, kl_decay, prefix
        self.continuation = continuation
        if autocast not in AUTOCAST:
            raise ValueError(f"autocast must be one of {sorted(AUTOCAST)}, got {autocast!r}")
        self.autocast = AUTOCAST[autocast]

    def __call__(self, sample: dict | list[dict], stage: int, passes: int = 0, teacher=None) -> dict[str, float]:
        unwrap(self.backend.module).train()
        mixed = (torch.autocast(self.actor.device.type, dtype=self.autocast) if self.autocast is not None
                 else contextlib.nullcontext())  # the forward in mixed precision; the backward follows it
        with mixed:
            loss = sample_loss(self.backend.module, self.actor, sample, stage, decay=self.kl_decay, passes=passes,
                               teacher=teacher, prefix=self.prefix, continuation=self.continuation)
        figures = self.backend.update(loss)
        return {"loss": float(loss.detach()), "gate": self.backend.gate(), **figures}


class PrefixCache:
    """What a row's Stage II loss computes that training never changes, kept for the next visit of the row:
    the KV cache of the context before the soft slot and the actor's features of what the memory reads (also
    each span's features in a Stage I batch).
    Bounded by ``rows`` (least recently used out): a KV cache of 2K SmolLM2 positions is ~90 MB."""

    KINDS = 3  # entries per row: the context's KV cache, the actor's prefill of what the memory reads and the
    # text-alone student's KL (what the span gate weighs the memory against)

    def __init__(self, rows: int = 4):
        self.rows = rows
        self.entries: OrderedDict[tuple, Any] = OrderedDict()
        self.hits = self.misses = 0

    @staticmethod
    def key(kind: str, ids: torch.Tensor) -> tuple:
        return kind, int(ids.numel()), hash(tuple(ids.tolist()))

    def get(self, key: tuple, make: Callable[[], Any]) -> Any:
        if key in self.entries:
            self.hits += 1
            self.entries.move_to_end(key)
            return self.entries[key]
        self.misses += 1
        value = make()
        if self.rows > 0:
            self.entries[key] = value
            while len(self.entries) > self.KINDS * self.rows:
                self.entries.popitem(last=False)
        return value


def init_stage2_from_stage1(stage2: MemoryNetwork, stage1_state: dict) -> None:
    """Stage II starts from the Stage I weights: same architecture, every tensor copied (strict)."""
    stage2.load_state_dict(stage1_state, strict=True)


__all__ = ["Backend", "DDPBackend", "DeepSpeedBackend", "LocalBackend", "PrefixCache", "TrainStep", "grad_norms",
           "optimizer_groups", "init_stage2_from_stage1", "lr_at", "set_lr", "module_groups", "sample_loss",
           "sample_tensors", "unwrap"]
