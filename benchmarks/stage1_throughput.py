"""Stage I training throughput: spans per second of the training step, by batch size and precision, one run.

    .venv/bin/python benchmarks/stage1_throughput.py [--config configs/train/remory_small.yaml]
        [--batches 1,4,8] [--tokens 64] [--slots 8] [--repeat 5] [--threads 2] [--out FILE]

The launcher's own step (``training.step.TrainStep``, in-process backend, the config's learning rates) on spans of
``--tokens`` random ids through the config's network with ``block_size`` = the span and ``queries`` = ``--slots``
(the ladder's shape), for each batch size (``optim.stage1_batch``: a list of spans, one actor pass) under fp32
and under bf16 autocast (``optim.autocast``). Each cell: one warm-up step, then the median of ``--repeat``
steps; the span prefills are computed at every step (no cache), as on a span's first visit. Ratios are to
batch 1, fp32, in the same run. Results: ``benchmarks/results/stage1_throughput.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", type=Path, default=ROOT / "configs" / "train" / "remory_small.yaml")
    ap.add_argument("--batches", default="1,4,8")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "stage1_throughput.json")
    args = ap.parse_args()

    import torch

    from palimpsest.models.actor import FrozenActor
    from palimpsest.models.memory import MemoryConfig
    from palimpsest.models.memory_network import MemoryNetwork
    from palimpsest.platform.prompt.tokens import get_tokenizer
    from palimpsest.training.prepare import resolve_actor
    from palimpsest.training.remory_data import REPEAT_INSTRUCTION
    from palimpsest.training.step import LocalBackend, TrainStep
    from palimpsest.training.train_config import group_lrs, load_train_config

    torch.set_num_threads(args.threads)
    cfg = load_train_config(args.config)
    mcfg = MemoryConfig(**{**cfg.memory.to_dict(), "block_size": args.tokens, "queries": args.slots,
                           "max_slots": max(cfg.memory.max_slots, args.slots)})
    path = str(resolve_actor(cfg))
    actor = FrozenActor.from_pretrained(path, dtype=cfg.actor.dtype)
    instruction = torch.tensor(get_tokenizer(path).encode("\n" + REPEAT_INSTRUCTION + "\n"))
    g = torch.Generator().manual_seed(0)
    batches = [int(b) for b in args.batches.split(",")]
    spans = [{"span": torch.randint(0, actor.vocab_size, (args.tokens,), generator=g), "instruction": instruction}
             for _ in range(max(batches))]
    cells = []
    for autocast in ("none", "bfloat16"):
        for b in batches:
            torch.manual_seed(0)
            net = MemoryNetwork(mcfg, actor)
            step = TrainStep(LocalBackend(net, group_lrs(cfg.optim)), actor, autocast=autocast)
            rows = spans[:b] if b > 1 else spans[0]
            step(rows, 1)  # warm-up
            times = []
            for _ in range(args.repeat):
                t0 = time.perf_counter()
                step(rows, 1)
                times.append(time.perf_counter() - t0)
            p50 = statistics.median(times)
            cells.append({"autocast": autocast, "batch": b, "s_per_step": round(p50, 3),
                          "spans_per_s": round(b / p50, 3)})
            print(f"  {autocast:>8} batch {b}: {p50:.2f} s/step, {b / p50:.2f} spans/s", flush=True)
    base = next(c for c in cells if c["autocast"] == "none" and c["batch"] == 1)["spans_per_s"]
    for c in cells:
        c["ratio"] = round(c["spans_per_s"] / base, 2)
    doc = {"config": str(args.config.relative_to(ROOT) if args.config.is_relative_to(ROOT) else args.config),
           "tokens": args.tokens, "slots": args.slots, "repeat": args.repeat, "threads": args.threads,
           "parameters": MemoryNetwork(mcfg, actor).num_parameters(), "machine": "2 CPU cores (this machine)",
           "cells": cells}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=2))
    print(json.dumps(doc, indent=2))


if __name__ == "__main__":
    main()
