"""The REMORY training step: one row's loss, its gradients, the update and what the step measured.

It is the step the launcher's Ray Train workers run (``launcher.train_loop``), the step the learnability
ladder runs in one process (``benchmarks/remory_ladder.py``) and the step the tests run: one code path.
What differs between them is only the :class:`Backend`, the object that turns a loss into an update:

- :class:`DeepSpeedBackend`: a DeepSpeed engine (ZeRO-2 or -3) around the memory network;
- :class:`DDPBackend`: torch DistributedDataParallel with AdamW (the comparison strategy);
- :class:`LocalBackend`: the network itself with AdamW, in one process.

Every step reports the loss, the global gradient norm before clipping, the norm per top-level module of
the memory network (``grad/in_proj``, ``grad/blocks``, ``grad/summary_attn``, ``grad/out_proj``, ...) and
the summary gate's value tanh(g): the evidence a run needs when the loss does not move.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from typing import Any, Callable, Protocol

import torch

from palimpsest.models.actor import FrozenActor
from palimpsest.models.memory import MemoryNetwork
from palimpsest.training.losses import stage1_loss, stage2_loss

STAGE1_KEYS = ("span", "instruction")
STAGE2_KEYS = ("teacher", "memory", "summary", "context", "bridge", "target")


def sample_tensors(row: dict, stage: int, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """A Parquet row of ``pipelines.remory_data`` as the loss's tensors."""
    if stage not in (1, 2):
        raise ValueError(f"stage must be 1 or 2, got {stage}")
    keys = STAGE1_KEYS if stage == 1 else STAGE2_KEYS
    return {k: torch.tensor(row[k], dtype=torch.long, device=device) for k in keys}


def unwrap(module) -> MemoryNetwork:
    """The memory network inside a DeepSpeed engine or DDP wrapper (or itself)."""
    return module.module if hasattr(module, "module") else module


def sample_loss(module, actor: FrozenActor, sample: dict, stage: int, *, decay: float = 0.05, passes: int = 0,
                teacher=None, prefix=None) -> torch.Tensor:
    """The loss of one row. ``module`` may be wrapped (calling the wrapper keeps its hooks); ``teacher`` is a
    cached ``training.teachers.Teacher`` (None: a full-vocabulary teacher pass); ``prefix`` a
    :class:`PrefixCache` that keeps each row's constant parts (the context's KV cache, the memory's features)."""
    if stage == 1:
        return stage1_loss(module, actor, sample, passes)
    if stage == 2:
        return stage2_loss(module, actor, sample, decay, passes, teacher, prefix)
    raise ValueError(f"stage must be 1 or 2, got {stage}")


def module_groups(net: MemoryNetwork) -> dict[str, list[torch.nn.Parameter]]:
    """The memory network's parameters by top-level module (``blocks.0.cross.in_proj_weight`` -> ``blocks``)."""
    groups: dict[str, list[torch.nn.Parameter]] = OrderedDict()
    for name, p in net.named_parameters():
        if p.requires_grad:
            groups.setdefault(name.split(".")[0], []).append(p)
    return groups


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
    g = grad_of(net.summary_attn.gate)
    out["grad/gate"] = float(g.detach().abs().sum()) if g is not None else 0.0
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

    def set_lr(self, lr: float) -> None:
        """The learning rate of the next updates."""
        ...

    def lr(self) -> float:
        """The learning rate the optimizer holds (what the last ``set_lr`` reached)."""
        ...


def lr_at(step: int, steps: int, base: float, schedule: str = "constant") -> float:
    """The learning rate of a stage's ``step``-th update (from 0) of ``steps``: ``constant`` or ``cosine`` (from
    ``base`` to 0 over the stage; the ladder's rung 1 closed 0.73 of the gap in 300 steps with it, 0.59 in 150
    constant)."""
    if schedule == "constant":
        return base
    if schedule == "cosine":
        return base * 0.5 * (1 + math.cos(math.pi * min(step, steps) / max(steps, 1)))
    raise ValueError(f"unknown learning-rate schedule {schedule!r} (constant, cosine)")


def set_lr(optimizer, lr: float) -> None:
    """Every parameter group of ``optimizer`` (a torch optimizer, or DeepSpeed's ZeRO wrapper) at ``lr``."""
    for group in optimizer.param_groups:
        group["lr"] = lr


class LocalBackend:
    """The network and AdamW in this process (the ladder, the tests); also DDP's update (see below)."""

    def __init__(self, net: MemoryNetwork, lr: float, weight_decay: float = 0.0, grad_clip: float = 1.0,
                 module=None):
        self.net = net
        self.module = module if module is not None else net
        self.grad_clip = grad_clip
        self.optimizer = torch.optim.AdamW(net.parameters(), lr=lr, weight_decay=weight_decay)

    def update(self, loss: torch.Tensor) -> dict[str, float]:
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        figures = grad_norms(self.net, lambda p: p.grad)
        norm = torch.nn.utils.clip_grad_norm_(self.net.parameters(), self.grad_clip)
        self.optimizer.step()
        return {"grad_norm": float(norm), **figures}

    def gate(self) -> float:
        return float(torch.tanh(self.net.summary_attn.gate.detach()).reshape(-1)[0])

    def set_lr(self, lr: float) -> None:
        set_lr(self.optimizer, lr)

    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def state(self) -> dict:
        return {"model": self.net.state_dict(), "optim": self.optimizer.state_dict()}

    def load(self, state: dict) -> None:
        self.net.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optim"])


class DDPBackend(LocalBackend):
    """torch DistributedDataParallel (gradients all-reduced in backward) with the local AdamW update."""

    def __init__(self, net: MemoryNetwork, lr: float, weight_decay: float = 0.0, grad_clip: float = 1.0):
        super().__init__(net, lr, weight_decay, grad_clip, module=torch.nn.parallel.DistributedDataParallel(net))


class DeepSpeedBackend:
    """A DeepSpeed engine around the network (``launcher.ds_config``: AdamW, clipping, the ZeRO stage)."""

    def __init__(self, net: MemoryNetwork, config: dict):
        import deepspeed

        self.net = net
        self.engine, *_ = deepspeed.initialize(model=net, model_parameters=list(net.parameters()), config=config)
        self.module = self.engine

    def update(self, loss: torch.Tensor) -> dict[str, float]:
        from deepspeed.utils import safe_get_full_grad

        self.engine.backward(loss)
        figures = grad_norms(self.net, safe_get_full_grad)  # every rank calls it: ZeRO gathers with collectives
        self.engine.step()
        norm = self.engine.get_global_grad_norm()
        return {"grad_norm": float(norm) if norm is not None else float("nan"), **figures}

    def set_lr(self, lr: float) -> None:
        set_lr(self.engine.optimizer, lr)

    def lr(self) -> float:
        return float(self.engine.optimizer.param_groups[0]["lr"])

    def gate(self) -> float:
        # under ZeRO-3 a parameter is a partition of it on each rank (empty unless kept whole by the persistence
        # threshold): the optimizer's full fp32 copy is gathered (every rank calls it)
        from deepspeed.utils import safe_get_full_fp32_param

        return float(torch.tanh(safe_get_full_fp32_param(self.net.summary_attn.gate)).reshape(-1)[0])


class Step:
    """One training step on one row: loss (through the frozen actor), update, figures."""

    def __init__(self, backend: Backend, actor: FrozenActor, kl_decay: float = 0.05, prefix: "PrefixCache | None" = None):
        self.backend, self.actor, self.kl_decay, self.prefix = backend, actor, kl_decay, prefix

    def __call__(self, sample: dict, stage: int, passes: int = 0, teacher=None) -> dict[str, float]:
        unwrap(self.backend.module).train()
        loss = sample_loss(self.backend.module, self.actor, sample, stage, decay=self.kl_decay, passes=passes,
                           teacher=teacher, prefix=self.prefix)
        figures = self.backend.update(loss)
        return {"loss": float(loss.detach()), "gate": self.backend.gate(), **figures}


class PrefixCache:
    """What a row's Stage II loss computes that training never changes, kept for the next visit of the row:
    the KV cache of the context before the soft slot and the actor's features of what the memory reads.
    Bounded by ``rows`` (least recently used out): a KV cache of 2K SmolLM2 positions is ~90 MB."""

    KINDS = 2  # entries per row: the context's KV cache and the memory's features

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


__all__ = ["Backend", "DDPBackend", "DeepSpeedBackend", "LocalBackend", "PrefixCache", "Step",
           "grad_norms", "init_stage2_from_stage1", "lr_at", "set_lr", "module_groups", "sample_loss", "sample_tensors", "unwrap"]
