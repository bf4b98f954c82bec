"""Reconstruction of a trained memory on spans of one split of a trajectory file: the training trajectories
beside the held-out ones that ``palimpsest eval-reconstruction`` scores (it takes held-out only, or all).

    .venv/bin/python benchmarks/recon_split.py --model models:/palimpsest-memory/latest
        [--data ../shared/data/trajectories/dev.jsonl] [--split train|held-out] [--spans 64] [--tokens 64]

The same spans sampler and scoring as ``eval-reconstruction`` (``training/reconstruction.py``: teacher-forced NLL
per token with no memory, the span's own memory and another span's; exact = the first 32 ids come back
greedily); the split is the bundle's own record of the trajectories it trained on. Prints one JSON document.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="models:/palimpsest-memory/N, a runs:/ URI or a bundle dir")
    ap.add_argument("--data", type=Path, default=ROOT.parent / "shared" / "data" / "trajectories" / "dev.jsonl")
    ap.add_argument("--split", choices=("train", "held-out"), default="train")
    ap.add_argument("--spans", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    from palimpsest.models.actor import FrozenActor
    from palimpsest.models.registry import load_memory, read_bundle, resolve_actor_path, resolve_memory_ref
    from palimpsest.pipelines.trajectories import read_trajectories
    from palimpsest.platform.tokens import get_tokenizer
    from palimpsest.training.reconstruction import as_tensors, evaluate, trajectory_spans

    ref = resolve_memory_ref(args.model)
    if ref is None:
        raise SystemExit(f"--model {args.model!r} names no memory model")
    bundle = read_bundle(ref)
    if bundle.train_trajectories is None:
        raise SystemExit(f"{ref} records no training split")
    every = {t.id for t in read_trajectories(args.data).trajectories}
    trained = set(bundle.train_trajectories)
    skip = every - trained if args.split == "train" else trained
    actor_path = resolve_actor_path(bundle.actor.get("path") or "smollm2")
    actor = FrozenActor.from_pretrained(actor_path, dtype=bundle.actor.get("dtype") or "float32")
    net = load_memory(ref, actor)
    picked = trajectory_spans(args.data, get_tokenizer(str(actor_path)), args.tokens, args.spans, args.seed, skip=skip)
    if len(picked) < 2:
        raise SystemExit(f"{args.data}: fewer than 2 spans of {args.tokens} ids in the {args.split} split")
    doc = evaluate(actor, net, as_tensors(picked, actor.device), 32)
    doc |= {"model": ref, "split": args.split, "trajectories": len({p["trajectory"] for p in picked}),
            "seed": args.seed, "own_minus_other": doc["own"]["nll"] - doc["other"]["nll"],
            "own_minus_none": doc["own"]["nll"] - doc["none"]["nll"]}
    print(json.dumps(doc))


if __name__ == "__main__":
    main()
