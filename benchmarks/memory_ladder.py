"""The memory network's learnability ladder, rung by rung, each with a control a memory carrying nothing passes.

    .venv/bin/python benchmarks/memory_ladder.py --rung 0            # at initialisation
    .venv/bin/python benchmarks/memory_ladder.py --rung 1            # capacity: free vectors in the slot
    .venv/bin/python benchmarks/memory_ladder.py --rung 2            # one span through the network
    .venv/bin/python benchmarks/memory_ladder.py --rung 3 --spans 100 --steps 2500 --batch 8 --autocast bfloat16
    .venv/bin/python benchmarks/memory_ladder.py --rung 4 --spans 16000 --steps N --batch 8 --autocast bfloat16
                                                                     # spans of files never trained on
    .venv/bin/python benchmarks/memory_ladder.py --rung 5            # needles in filler, 8 slots
    .venv/bin/python benchmarks/memory_ladder.py --rung 4 --model models:/palimpsest-memory/N --out F.json
                                                                     # a trained bundle on rung 4's spans

Spans are ``--tokens`` (64) ids of Stage I text: the dev trajectories' actions and observations and the
interpreter's standard library (``training.remory_data.stage1_rows``), split by file or trajectory (the
config's ``val_fraction``). The network is ``--config``'s ``memory:`` with ``block_size`` = the span and
``queries`` = ``--slots`` (8: 8 source tokens per soft token), trained with the launcher's own step
(``training.step.TrainStep``, Stage I, ``LocalBackend``; ``--batch`` spans per step in one actor pass and
``--autocast bfloat16`` for mixed precision, as ``optim.stage1_batch`` / ``optim.autocast`` train them) and
scored in fp32 by ``evaluation.reconstruction`` (none / own / other). Results:
``benchmarks/results/memory_ladder/rungN.json``.

What each rung asks, and its control:
- 0: the slots of one memory differ (mean pairwise cosine < 0.9) and reversing the source changes the memory
  (cosine < 0.95); a memory that ignores its input gives 1.0 for the second.
- 1: ``--slots`` free vectors through the frozen actor reproduce one span greedily, all of it; the control is
  what the instruction alone reproduces.
- 2: the network, trained on one span, reproduces it greedily; the control is the same network given another
  span's source (a memory that ignores its input reproduces the span from it too).
- 3: ``--spans`` training spans, scored on themselves: accuracy >= 0.9 and own <= other - 1 nat/token.
- 4: validation spans (files never trained on): own <= other - 0.3 and own <= none - 0.5 nats/token.
  With ``--model``, nothing is trained: a bundle ``palimpsest train`` wrote (``runs:/ID/stage1`` is the one Stage I
  left) is scored on the same validation spans, which lie in files and trajectories of the launcher's validation
  split too (the split is by name, ``training.remory_data.split_of``).
- 5: a ``kind=value`` line (a port, an 8-hex id, a log path) at a random place in ``--tokens`` ids of filler
  (Stage I text), ``--slots`` soft tokens; trained on ``--spans`` needles with [memory; "What is the value of
  KIND ...?"; value]; exact greedy recovery of the value >= 50% on training needles, then on held-out ones
  (filler from files never trained on, new values). The control: the same question with another needle's memory.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

from palimpsest.models.memory import MemoryConfig

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "results" / "memory_ladder"


def stage1_spans(cfg, actor_path: str, tokens: int, chunks: int) -> tuple[list[dict], list[dict]]:
    """(train, val) Stage I spans of exactly ``tokens`` ids."""

    from palimpsest.pipelines.trajectories import read_trajectories
    from palimpsest.platform.prompt.tokens import get_tokenizer
    from palimpsest.training.prepare import data_config
    from palimpsest.training.remory_data import stage1_rows

    dcfg = data_config(cfg).replace(span_tokens=tokens, stage1_corpus="stdlib", stage1_chunks=chunks)
    rows = [r for r in stage1_rows(read_trajectories(Path(cfg.data.file)).trajectories,
                                   get_tokenizer(actor_path), dcfg) if len(r["span"]) == tokens]
    return [r for r in rows if r["split"] == "train"], [r for r in rows if r["split"] == "val"]


class FreeSlots:
    """Rung 1's memory: ``n`` free vectors at the actor's embedding norm, nothing read."""

    def __new__(cls, n: int, actor):
        import torch
        from torch import nn

        class _Free(nn.Module):
            def __init__(self):
                super().__init__()
                emb = actor.model.get_input_embeddings().weight.detach()
                self.free = nn.Parameter(emb[torch.randint(0, emb.shape[0], (n,))].clone())
                self.register_buffer("norm", emb.norm(dim=-1).mean())
                self.cfg = None

            def forward(self, source, summary=None, min_passes=0):
                return self.free * (self.norm / self.free.norm(dim=-1, keepdim=True))

            def source(self, ids):
                return ids

            def slots_for(self, positions):
                return n

            def merge_passes(self, positions):
                return 0

            def parameter_groups(self):
                return {"slots": [self.free]}

            def gates(self):
                return []

        return _Free()


def train(net, actor, samples, steps: int, lrs: dict, warmup: int, seed: int, log_every: int = 50,
          check=None, check_every: int = 0, continuation: float = 0.0, batch: int = 1,
          autocast: str = "none") -> list[dict]:
    """Stage I steps of ``batch`` spans each on ``samples`` (tensors), shuffled passes; ``check(step)`` every
    ``check_every`` steps may stop the run early by returning True. Each span's prefill is kept for its next
    visit when spans are visited again and few enough to keep (the actor is frozen)."""
    from palimpsest.training.step import LocalBackend, PrefixCache, TrainStep, lr_at

    backend = LocalBackend(net, lrs, 0.0, 1.0)
    revisits = steps * batch > len(samples) and len(samples) <= 2000  # ~3 MB a span (64 ids): bounded
    step = TrainStep(backend, actor, continuation=continuation, autocast=autocast,
                prefix=PrefixCache(rows=len(samples)) if batch > 1 and revisits else None)
    rng = random.Random(seed)
    order: list[int] = []
    curve = []
    t0 = time.perf_counter()
    for i in range(steps):
        if not order:
            order = rng.sample(range(len(samples)), len(samples))
        backend.set_lr(lr_at(i, steps, 1.0, "cosine", warmup))
        if batch > 1:
            rows = []
            while len(rows) < batch:
                order = order or rng.sample(range(len(samples)), len(samples))
                rows.append(samples[order.pop()])
            f = step(rows, 1)
        else:
            s = samples[order.pop()]
            f = step(s, 1, net.merge_passes(int(s["span"].numel())))
        curve.append({"step": i + 1, "loss": f["loss"], "grad_norm": f["grad_norm"],
                      **{k: v for k, v in f.items() if k.startswith("grad/")}})
        if log_every and (i + 1) % log_every == 0:
            recent = sum(c["loss"] for c in curve[-log_every:]) / log_every
            print(f"  step {i + 1}: loss {recent:.4f} ({(time.perf_counter() - t0) / (i + 1):.2f} s/step)", flush=True)
        if check is not None and check_every and (i + 1) % check_every == 0 and check(i + 1):
            break
    return curve


KINDS = ("port", "id", "path")


def needle(rng: random.Random, kind: str) -> tuple[str, str]:
    """(the line placed in the filler, the value asked for)."""
    if kind == "port":
        value = str(rng.randrange(1024, 10000))
    elif kind == "id":
        value = "".join(rng.choice("0123456789abcdef") for _ in range(8))
    else:
        words = ("srv", "data", "logs", "cache", "build", "etc", "opt", "var", "run", "tmp", "home", "app")
        value = f"/{rng.choice(words)}/{rng.choice(words)}{rng.randrange(10, 100)}.log"
    return f"{kind}={value}", value


def needle_rows(rows: list[dict], n: int, tokens: int, tok, seed: int) -> list[dict]:
    """``n`` needle rows: filler text (the ids of Stage I spans, cut so the whole source is ``tokens`` ids) with a
    ``kind=value`` line at a random place; the question names the kind, the answer is the value."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        filler = rows[i % len(rows)]["span"]
        kind = KINDS[i % len(KINDS)]
        line, value = needle(rng, kind)
        ids = tok.encode("\n" + line + "\n")
        keep = filler[: max(tokens - len(ids), 8)]
        at = rng.randrange(0, len(keep) + 1)
        source = keep[:at] + ids + keep[at:]
        question = tok.encode(f"\nWhat is the value of {kind} in the text above? Answer with the value only.\n")
        out.append({"source": source, "instruction": question, "span": tok.encode(value), "kind": kind,
                    "value": value, "at": at})
    return out


def rung5(args, actor, network, train_rows, val_rows, lrs) -> dict:
    """Needles: train on ``--spans`` training needles (filler from training files), score exact recovery of the
    value greedily on training needles and on held-out ones (filler from validation files, new values)."""
    import torch

    from palimpsest.evaluation.reconstruction import greedy, score
    from palimpsest.platform.prompt.tokens import get_tokenizer

    tok = get_tokenizer(args.actor_path)
    train_n = needle_rows(train_rows, args.spans, args.tokens, tok, args.seed)
    held_n = needle_rows(val_rows, args.eval, args.tokens, tok, args.seed + 1)

    def tensors(rows):
        return [{k: torch.tensor(r[k], dtype=torch.long) for k in ("source", "instruction", "span")} for r in rows]

    train_t, held_t = tensors(train_n), tensors(held_n)
    net = network()
    evals = []

    def recovered(rows, ts) -> dict:
        net.eval()
        hits = sum(greedy(actor, net, t, len(r["span"])) == r["span"] for r, t in zip(rows, ts))
        other = sum(greedy(actor, net, t, len(r["span"]), source=ts[(i + 1) % len(ts)]["source"]) == r["span"]
                    for i, (r, t) in enumerate(zip(rows, ts)))
        net.train()
        return {"exact": hits / len(rows), "other_source_exact": other / len(rows), "needles": len(rows),
                **{f"nll_{m}": score(actor, net, ts, m)["nll"] for m in ("own", "other", "none")}}

    def check(step):
        doc = {"step": step, "train": recovered(train_n[: args.eval], train_t[: args.eval]),
               "held_out": recovered(held_n, held_t)}
        evals.append(doc)
        print(f"  step {step}: exact train {doc['train']['exact']:.2f} "
              f"(another source {doc['train']['other_source_exact']:.2f})"
              f", held-out {doc['held_out']['exact']:.2f} (another source {doc['held_out']['other_source_exact']:.2f})",
              flush=True)
        return args.until_passed and step > 0 and doc["train"]["exact"] >= 0.5 and doc["held_out"]["exact"] >= 0.5

    check(0)
    curve = train(net, actor, train_t, args.steps, lrs, args.warmup, args.seed, log_every=50, check=check,
                  check_every=args.eval_every or max(args.steps // 3, 1), batch=args.batch, autocast=args.autocast)
    if evals[-1]["step"] != len(curve):
        check(len(curve))
    final = evals[-1]
    return {"needles": {"train": len(train_n), "held_out": len(held_n), "kinds": list(KINDS),
                        "source_tokens": args.tokens},
            "examples": [{k: r[k] for k in ("kind", "value", "at")} for r in held_n[:5]],
            "steps_run": len(curve), "evals": evals, "final": final,
            "passed_train": final["train"]["exact"] >= 0.5, "passed": final["held_out"]["exact"] >= 0.5,
            "curve": [c for c in curve if c["step"] % 10 == 0]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rung", type=int, required=True, choices=range(6))
    ap.add_argument("--config", type=Path, default=ROOT / "configs" / "train" / "remory_small.yaml")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--spans", type=int, default=100, help="rung 3/4: training spans")
    ap.add_argument("--eval", type=int, default=64, help="spans scored")
    ap.add_argument("--eval-every", type=int, default=0, help="rung 3/4/5: steps between evaluations "
                    "(default: a quarter of --steps; a third at rung 5)")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--lr", type=float, default=None, help="LoRA (default: the config's optim.lr)")
    ap.add_argument("--lr-slots", type=float, default=None)
    ap.add_argument("--lr-readout", type=float, default=None)
    ap.add_argument("--lr-summary", type=float, default=None)
    ap.add_argument("--lora-rank", type=int, default=None, help="the LoRA rank (default: the config's), "
                                                                   "alpha scaled to keep alpha / rank")
    ap.add_argument("--continuation", type=float, default=0.0)
    ap.add_argument("--until-passed", action="store_true", help="rung 3/4/5: stop at the first evaluation that "
                    "passes (the schedule stays the one --steps sets)")
    ap.add_argument("--batch", type=int, default=1, help="rung 3/4/5: spans per step (one actor pass)")
    ap.add_argument("--autocast", default="none", choices=("none", "bfloat16"),
                    help="rung 3/4/5: the training step under torch.autocast (scoring stays fp32)")
    ap.add_argument("--chunks", type=int, default=20000, help="most standard-library spans read")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--model", default=None, help="rung 4: score this trained bundle (models:/..., runs:/..., a "
                    "directory) on the validation spans instead of training a network")
    args = ap.parse_args()
    if args.model and args.rung != 4:
        ap.error("--model scores a trained bundle at rung 4 only")

    import torch

    from palimpsest.evaluation.reconstruction import (
        as_tensors,
        evaluate,
        greedy,
        reads_its_input,
        rung0_passes,
        score,
        slot_stats,
    )
    from palimpsest.models.actor import FrozenActor
    from palimpsest.models.memory_network import MemoryNetwork
    from palimpsest.training.prepare import resolve_actor
    from palimpsest.training.train_config import group_lrs, load_train_config

    cfg = load_train_config(args.config)
    lrs = group_lrs(cfg.optim)
    for k, v in (("lora", args.lr), ("slots", args.lr_slots), ("readout", args.lr_readout),
                 ("summary", args.lr_summary)):
        if v is not None:
            lrs[k] = v
    rank = {} if args.lora_rank is None else {  # alpha / rank kept as configured
        "lora_rank": args.lora_rank, "lora_alpha": cfg.memory.lora_alpha * args.lora_rank / cfg.memory.lora_rank}
    mcfg = MemoryConfig(**{**cfg.memory.to_dict(), "block_size": args.tokens, "queries": args.slots,
                           "max_slots": max(cfg.memory.max_slots, args.slots), **rank})  # validated
    actor_path = str(resolve_actor(cfg))
    args.actor_path = actor_path
    torch.manual_seed(args.seed)
    actor = FrozenActor.from_pretrained(actor_path, dtype=cfg.actor.dtype)
    t0 = time.perf_counter()
    chunks = args.chunks if args.rung in (3, 4, 5) else 2000
    train_rows, val_rows = stage1_spans(cfg, actor_path, args.tokens, chunks)
    rng = random.Random(args.seed)
    rng.shuffle(train_rows)
    rng.shuffle(val_rows)
    print(f"spans of {args.tokens} ids: {len(train_rows)} train, {len(val_rows)} validation "
          f"({time.perf_counter() - t0:.0f} s)", flush=True)

    def network():
        torch.manual_seed(args.seed)
        net = MemoryNetwork(mcfg, actor)
        return net

    out: dict = {"rung": args.rung, "config": str(args.config.relative_to(ROOT) if args.config.is_relative_to(ROOT)
                                                   else args.config),
                 "memory": mcfg.to_dict(), "lrs": lrs, "warmup": args.warmup, "tokens": args.tokens,
                 "slots": args.slots, "seed": args.seed, "batch": args.batch, "autocast": args.autocast,
                 "torch_threads": torch.get_num_threads(), "machine": "2 CPU cores (this machine)"}
    t1 = time.perf_counter()
    if args.rung == 0:
        net = network()
        samples = as_tensors(val_rows[: args.eval])
        out["init"] = slot_stats(actor, net, samples)
        out["parameters"] = net.num_parameters()
        out["actor_parameters"] = net.actor_parameters()
        out["groups"] = {k: sum(p.numel() for p in v) for k, v in net.parameter_groups().items()}
        mean_net = MemoryNetwork(mcfg.model_copy(update={"slot_input": "mean"}), actor)
        out["slot_input_mean"] = slot_stats(actor, mean_net, samples)
        out["passed"] = rung0_passes(out["init"])
    elif args.rung in (1, 2):
        one = as_tensors(train_rows[:1])
        other = as_tensors(train_rows[1:2])
        net = FreeSlots(args.slots, actor) if args.rung == 1 else network()
        if args.rung == 1:
            out["lrs"] = {"slots": args.lr_slots or 0.05}
        target = one[0]["span"].tolist()
        n = len(target)
        state = {}

        def check(step):
            got = greedy(actor, net, one[0], n)
            state["matched"] = sum(a == b for a, b in zip(got, target))
            state["prefix"] = next((k for k, (a, b) in enumerate(zip(got, target)) if a != b), n)
            state["step"] = step
            print(f"  step {step}: {state['matched']}/{n} tokens greedy, exact prefix {state['prefix']}", flush=True)
            return state["prefix"] == n

        curve = train(net, actor, one, args.steps, out["lrs"],
                      args.warmup, args.seed, log_every=25, check=check, check_every=25,
                      continuation=args.continuation)
        if "step" not in state or state["step"] != len(curve):
            check(len(curve))
        control_src = other[0]["span"]
        ctrl = greedy(actor, net, one[0], n, source=control_src) if args.rung == 2 else None
        none = score(actor, net, one, "none")
        out.update(steps_run=len(curve), greedy_matched=state["matched"], greedy_exact_prefix=state["prefix"],
                   tokens=n, own=score(actor, net, one, "own"), none=none, curve=curve[-50:])
        if args.rung == 2:
            out["control_other_source_matched"] = sum(a == b for a, b in zip(ctrl, target))
            # rung 2's control is the other span's memory whatever its source: one group per span
            out["other"] = {"nll": score(actor, net, [{k: v for k, v in s.items() if k != "trajectory"}
                                                      for s in one + other], "other")["nll"]}
        out["passed"] = state["prefix"] == n
    elif args.model:
        from palimpsest.models.registry import load_memory, read_bundle

        bundle = read_bundle(args.model)
        if (bundle.memory.get("block_size"), bundle.memory.get("queries")) != (args.tokens, args.slots):
            raise SystemExit(f"{args.model}: blocks of {bundle.memory.get('block_size')} ids with "
                             f"{bundle.memory.get('queries')} soft tokens; rung 4's spans are one block of "
                             f"--tokens {args.tokens} with --slots {args.slots}")
        trained = set(bundle.train_trajectories or ())  # by name, as the launcher split; none may be scored
        held = [r for r in val_rows if r["trajectory"] not in trained]
        net = load_memory(args.model, actor)
        final = evaluate(actor, net, as_tensors(held[: args.eval]))
        out["validation_spans_the_bundle_trained_on"] = len(val_rows) - len(held)
        out.update(model=args.model, memory=bundle.memory, lrs=None, warmup=None, batch=None, autocast=None,
                   parameters=net.num_parameters(), final=final, passed=reads_its_input(final, 0.3, 0.5))
    elif args.rung in (3, 4):
        train_t = as_tensors(train_rows[: args.spans])
        net = network()
        out["parameters"] = net.num_parameters()
        evals = []
        eval_train = train_t[: args.eval]
        eval_val = as_tensors(val_rows[: args.eval])

        def check(step):
            doc = evaluate(actor, net, eval_train if args.rung == 3 else eval_val)
            evals.append({"step": step, **doc})
            print(f"  step {step}: own {doc['own']['nll']:.3f} acc {doc['own']['acc']:.3f} exact "
                  f"{doc['own']['exact']:.2f} | other "
                  f"{'n/a' if doc['other']['nll'] is None else format(doc['other']['nll'], '.3f')} | "
                  f"none {doc['none']['nll']:.3f}",
                  flush=True)
            return args.until_passed and step > 0 and passes(doc)

        def passes(doc):
            return (doc["own"]["acc"] >= 0.9 and reads_its_input(doc, 1.0)) if args.rung == 3 \
                else reads_its_input(doc, 0.3, 0.5)

        check(0)
        curve = train(net, actor, train_t, args.steps, lrs, args.warmup, args.seed, log_every=50, check=check,
                      check_every=args.eval_every or max(args.steps // 4, 1), continuation=args.continuation,
                      batch=args.batch, autocast=args.autocast)
        if evals[-1]["step"] != len(curve):
            check(len(curve))
        final = evals[-1]
        out["passed"] = passes(final)
        if args.rung == 4:
            out["train_spans_scored"] = evaluate(actor, net, eval_train)
        out.update(train_spans=len(train_t), steps_run=len(curve), evals=evals, final=final,
                   curve=[c for c in curve if c["step"] % 10 == 0])
    else:
        out.update(rung5(args, actor, network, train_rows, val_rows, lrs))
    out["seconds"] = round(time.perf_counter() - t1, 1)
    variant = (f"_rank{args.lora_rank}" if args.lora_rank is not None else "") + \
        (f"_slots{args.slots}" if args.slots != 8 else "") + (f"_batch{args.batch}" if args.batch != 1 else "") + \
        (f"_{args.autocast}" if args.autocast != "none" else "")  # a variant never overwrites the results of record
    path = args.out or OUT / (f"rung{args.rung}_model.json" if args.model else f"rung{args.rung}{variant}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2))
    print(json.dumps({k: v for k, v in out.items() if k not in ("curve", "evals")}, indent=2)[:3000])
    print(f"rung {args.rung}: {'PASSED' if out['passed'] else 'NOT PASSED'}; results: {path}")


if __name__ == "__main__":
    main()
