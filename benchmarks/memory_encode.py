"""What the memory network costs per boundary: encoding time for the histories a boundary hands it.

    .venv/bin/python benchmarks/memory_encode.py [--config configs/train/remory_small.yaml]
        [--histories 256,1024,4096] [--repeat 5] [--device cpu] [--out FILE]

The network of ``--config`` (``memory:``; random LoRA, which costs what a trained one costs) beside the actor it
names, encoding a history of N ids (``MemoryEncoder.encode``: the actor's prefill of each block, then the memory
tokens through the actor's layers, merges past ``max_slots``) with a 48-id summary; p50 and min over
``--repeat`` runs after one warm-up, and the actor's own prefill of the same ids beside it (what a text arm pays
for those ids). Results: ``benchmarks/results/memory_encode.json``.
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
    ap.add_argument("--histories", default="256,1024,4096")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "memory_encode.json")
    args = ap.parse_args()

    import torch

    from palimpsest.models.actor import FrozenActor
    from palimpsest.models.encoder import MemoryEncoder
    from palimpsest.models.memory_network import MemoryNetwork
    from palimpsest.training.prepare import resolve_actor
    from palimpsest.training.train_config import load_train_config

    cfg = load_train_config(args.config)
    actor = FrozenActor.from_pretrained(resolve_actor(cfg), device=args.device, dtype=cfg.actor.dtype)
    torch.manual_seed(0)
    enc = MemoryEncoder(MemoryNetwork(cfg.memory, actor), actor)
    g = torch.Generator().manual_seed(0)
    summary = torch.randint(0, actor.vocab_size, (48,), generator=g)

    def timed(fn) -> dict:
        fn()
        times = []
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            fn()
            if args.device.startswith("cuda"):
                torch.cuda.synchronize()
            times.append((time.perf_counter() - t0) * 1000)
        return {"p50_ms": round(statistics.median(times), 1), "min_ms": round(min(times), 1)}

    rows = []
    for n in (int(x) for x in args.histories.split(",")):
        hist = torch.randint(0, actor.vocab_size, (n,), generator=g)
        with torch.inference_mode():
            encode = timed(lambda: enc.encode(hist, summary))
            prefill = timed(lambda: actor.prefill(hist))
        rows.append({"history_ids": n, "soft_tokens": enc.slots_for(n), "merge_passes": enc.memory.merge_passes(n),
                     "encode": encode, "actor_prefill": prefill})
        print(f"{n:>6} ids -> {rows[-1]['soft_tokens']} soft tokens ({rows[-1]['merge_passes']} merges): encode "
              f"{encode['p50_ms']} ms p50, the actor's prefill of the same ids {prefill['p50_ms']} ms", flush=True)
    out = {"config": str(args.config.relative_to(ROOT) if args.config.is_relative_to(ROOT) else args.config),
           "memory": cfg.memory.to_dict(), "device": args.device, "threads": torch.get_num_threads(),
           "parameters": enc.memory.num_parameters(), "actor_parameters": enc.memory.actor_parameters(),
           "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2))
    print(f"results: {args.out}")


if __name__ == "__main__":
    main()
