"""REMORY Stage I's own check: does the frozen actor reconstruct a span it never sees from the span's memory?

    .venv/bin/python benchmarks/remory_stage1.py [--config configs/train/remory_small.yaml] [--corpus stdlib]
        [--chunks 12000] [--steps 1500] [--lr 1e-3] [--eval 200] [--out FILE]

Data: the Stage I spans the training run reads (``training.remory_data``: every ``span_tokens`` tokens of the
dev trajectories' actions and observations, plus ``--corpus``, by default the interpreter's standard library,
Python source that exists offline on every machine and is in no evaluation set), split by file/trajectory
(``val_fraction`` of the config). The memory network of ``--config`` is trained on training spans with the
launcher's own step (``training.step.TrainStep``, stage 1, the in-process backend), one span per step.

The check, on ``--eval`` validation spans (files never trained on), teacher-forced: token accuracy (the
actor's argmax equals the span's next token) and NLL per token, for

- **no memory**: the actor given the "repeat" instruction alone (what it guesses of the span from its
  own prefix: the baseline a memory must beat);
- **memory**: [memory of the span; instruction; span so far], at initialisation and after training;
- **another span's memory**: the same, each span given the memory of another: a memory that carries nothing
  of its span (a learned generic prefix) does as well here as with its own.

Results: ``benchmarks/results/remory_stage1.json``.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def spans(cfg, actor_path: str, corpus: str | None, chunks: int) -> tuple[list[dict], dict]:
    """The Stage I rows of a training config with ``corpus`` added: (rows, counts)."""

    from palimpsest.pipelines.trajectories import read_trajectories
    from palimpsest.platform.prompt.tokens import get_tokenizer
    from palimpsest.training.prepare import data_config
    from palimpsest.training.remory_data import stage1_rows

    dcfg = data_config(cfg).replace(stage1_corpus=corpus, stage1_chunks=chunks)
    rows = stage1_rows(read_trajectories(Path(cfg.data.file)).trajectories, get_tokenizer(actor_path), dcfg)
    n_corpus = sum(1 for r in rows if r["trajectory"].startswith("corpus/"))
    counts = {sp: sum(1 for r in rows if r["split"] == sp) for sp in ("train", "val")}
    return rows, {"trajectory_spans": len(rows) - n_corpus, "corpus_spans": n_corpus, **counts,
                  "files_or_trajectories": len({r["trajectory"] for r in rows})}


def check(net, actor, samples: list[dict], mismatched: bool = False) -> dict:
    """Teacher-forced token accuracy and NLL per token on ``samples``, with ``net``'s memory (None: without);
    ``mismatched``: each span with the memory of the next one (what a memory that does not depend on its
    span, a learned generic prefix, would also give)."""
    import torch
    import torch.nn.functional as F

    from palimpsest.training.losses import stage1_logits

    hits = total = 0
    nll = 0.0
    if net is not None:
        net.eval()
    with torch.no_grad():
        for i, s in enumerate(samples):
            other = samples[(i + 1) % len(samples)]["span"] if mismatched else None
            logits = stage1_logits(net, actor, s, source=other).float()
            hits += int((logits.argmax(-1) == s["span"]).sum())
            nll += float(F.cross_entropy(logits, s["span"], reduction="sum"))
            total += int(s["span"].numel())
    return {"token_accuracy": hits / total, "nll": nll / total, "tokens": total, "spans": len(samples)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", type=Path, default=ROOT / "configs" / "train" / "remory_small.yaml")
    ap.add_argument("--corpus", default="stdlib", help="a directory of text files, 'stdlib', or 'none'")
    ap.add_argument("--chunks", type=int, default=12000, help="at most this many corpus spans")
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--lr", type=float, default=None, help="default: the config's optim.lr")
    ap.add_argument("--eval", type=int, default=200, help="validation spans checked (a seeded sample)")
    ap.add_argument("--eval-every", type=int, default=250)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "remory_stage1.json")
    args = ap.parse_args()

    import torch

    from palimpsest.models.actor import FrozenActor
    from palimpsest.training.launcher import build_memory
    from palimpsest.training.prepare import resolve_actor
    from palimpsest.training.step import LocalBackend, TrainStep, lr_at, sample_tensors
    from palimpsest.training.train_config import load_train_config

    cfg = load_train_config(args.config)
    lr = args.lr or cfg.optim.lr
    actor_path = str(resolve_actor(cfg))
    t0 = time.perf_counter()
    rows, counts = spans(cfg, actor_path, None if args.corpus == "none" else args.corpus, args.chunks)
    train = [r for r in rows if r["split"] == "train"]
    val = random.Random(0).sample([r for r in rows if r["split"] == "val"],
                                  min(args.eval, counts["val"]))
    data_s = time.perf_counter() - t0
    print(f"Stage I spans: {counts} ({data_s:.0f} s); checking {len(val)} validation spans", flush=True)

    torch.manual_seed(cfg.optim.seed)
    actor = FrozenActor.from_pretrained(actor_path, dtype=cfg.actor.dtype)
    net = build_memory(cfg, actor)
    val_t = [sample_tensors(r, 1) for r in val]
    baseline = check(None, actor, val_t)
    evals = [{"step": 0, **check(net, actor, val_t)}]
    print(f"no memory: accuracy {baseline['token_accuracy']:.3f}, NLL {baseline['nll']:.3f}; memory at init: "
          f"accuracy {evals[0]['token_accuracy']:.3f}, NLL {evals[0]['nll']:.3f}", flush=True)
    backend = LocalBackend(net, lr, cfg.optim.weight_decay, cfg.optim.grad_clip)
    step = TrainStep(backend, actor, cfg.optim.kl_decay)
    order = random.Random(cfg.optim.seed).sample(range(len(train)), min(args.steps, len(train)))
    while len(order) < args.steps:  # more steps than spans: further passes, each shuffled
        order += random.Random(len(order)).sample(range(len(train)), min(args.steps - len(order), len(train)))
    curve = []
    t_train = time.perf_counter()
    for i, j in enumerate(order):
        backend.set_lr(lr_at(i, args.steps, 1.0, "cosine"))  # the schedule's factor: cosine over the run
        s = sample_tensors(train[j], 1)
        figures = step(s, 1, net.merge_passes(int(s["span"].numel())))
        curve.append({"step": i + 1, "loss": figures["loss"], "grad_norm": figures["grad_norm"]})
        if (i + 1) % args.eval_every == 0 or i + 1 == args.steps:
            evals.append({"step": i + 1, **check(net, actor, val_t),
                          "mismatched": check(net, actor, val_t, mismatched=True)})
            recent = sum(c["loss"] for c in curve[-50:]) / len(curve[-50:])
            print(f"step {i + 1}: train loss (last 50) {recent:.3f}, grad norm {figures['grad_norm']:.2e}; "
                  f"validation accuracy {evals[-1]['token_accuracy']:.3f}, NLL {evals[-1]['nll']:.3f} (another span's "
                  f"memory: {evals[-1]['mismatched']['token_accuracy']:.3f}, {evals[-1]['mismatched']['nll']:.3f})",
                  flush=True)
    train_s = time.perf_counter() - t_train
    params = net.num_parameters()
    out = {"config": str(args.config), "corpus": args.corpus, "chunks": args.chunks, "counts": counts,
           "network": cfg.memory.model_dump(), "parameters": params, "span_tokens": cfg.data.span_tokens,
           "soft_tokens_per_span": net.slots_for(cfg.data.span_tokens), "lr": lr, "steps": args.steps,
           "no_memory": baseline, "memory": evals[-1], "evals": evals, "curve": curve,
           "seconds": {"data": round(data_s, 1), "train": round(train_s, 1),
                       "per_step": round(train_s / max(args.steps, 1), 3)}}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2))
    print(f"\n| validation spans ({len(val)}, {baseline['tokens']} tokens) | token accuracy | NLL/token |\n"
          "|---|---|---|")
    print(f"| no memory (instruction only) | {baseline['token_accuracy']:.3f} | {baseline['nll']:.3f} |")
    print(f"| memory at init | {evals[0]['token_accuracy']:.3f} | {evals[0]['nll']:.3f} |")
    print(f"| memory after {args.steps} steps | {evals[-1]['token_accuracy']:.3f} | {evals[-1]['nll']:.3f} |")
    mm = evals[-1]["mismatched"]
    print(f"| another span's memory after {args.steps} steps | {mm['token_accuracy']:.3f} | {mm['nll']:.3f} |")
    print(f"{params:,} parameters; {train_s:.0f} s of training; results: {args.out}")


if __name__ == "__main__":
    main()
