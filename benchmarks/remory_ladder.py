"""REMORY's Stage II ladder: does the memory close the KL gap at real boundaries, where it trained?

    .venv/bin/python benchmarks/remory_ladder.py --rung 1 [--config configs/train/remory_small.yaml]
        [--steps 150] [--lr 1e-3] [--boundaries N] [--lora-rank R] [--eval-every 10] [--out FILE]

(The reconstruction rungs 0-5 that come first are ``benchmarks/memory_ladder.py``; this is "Stage II, then".)

Before a training run is scaled, it must overfit. Each rung trains the memory network of a training config
with the launcher's own step (``training.step.TrainStep``, here on the in-process backend) on Stage II rows built
by the serving code (``launcher.prepare``: the policy compiled at the budget with the soft positions reserved,
the teacher the whole history), and scores it where it trained:

- **rung 1**: one boundary, train = eval; the memory must close >= 90% of pace's KL gap there;
- **rung 2**: ``--boundaries`` (64) boundaries, train = eval: >= 60%;
- rung 3, the held-out figure, is ``palimpsest eval-actions --policy pace,pace+memory`` on a memory trained
  by ``palimpsest train`` (the trajectories it never saw).

The figure is eval-actions' own: at each boundary KL(student || teacher) per target token over the teacher's
top-64 and the tail; ``pace`` is the policy's prompt at the whole budget (text in the memory's positions),
``pace+empty`` the memory arm's text without the soft span, ``pace+memory`` with it; gap closed =
1 - KL(pace+memory) / KL(pace). The run reports every step's loss, the gradient norm per module of the network
and the summary gate tanh(g), so a rung that fails says where: no gradient, a gate that never opens, a loss
that does not move. After training every row is scored again with the memory of another trajectory's row
(``input_control``; the donor is recorded per row): a memory that ignores what it reads scores the same. The
figures are also split between the recall boundaries (the action needs a fact only the left-out history
holds) and the others, with how many recall boundaries have the fact in the memory's read and in the prompt.

Results: ``benchmarks/results/ladder_rung<N>.json``.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

from palimpsest.models.memory import MemoryConfig

ROOT = Path(__file__).resolve().parents[1]
TARGETS = {1: 0.90, 2: 0.60}


def prepared_rows(cfg, fresh: bool = False):
    """The run's Stage II rows and data folder, built by ``launcher.prepare`` (reused when the trajectory file
    and the data config are those of the last build)."""

    from palimpsest.pipelines.trajectories import file_sha256
    from palimpsest.training.prepare import _load_rows, data_config, prepare, resolve_actor

    data_dir = Path(cfg.storage).expanduser().resolve() / cfg.name / "data"
    report = data_dir / "report.json"
    if not fresh and report.is_file():
        old = json.loads(report.read_text())
        if old.get("data_sha256") == file_sha256(Path(cfg.data.file)) and old["config"] == data_config(cfg).to_dict():
            return str(resolve_actor(cfg)), data_dir, old, _load_rows(str(data_dir), 2)
    run = prepare(cfg.model_copy(update={"optim": cfg.optim.model_copy(update={"teacher_cache": False})}))
    return run.actor_path, data_dir, run.data_report, _load_rows(str(data_dir), 2)


def free_span(net):
    """The memory network with its output replaced by free vectors: as many soft positions as it would give, each
    scaled to the same norm, trained directly and reading nothing (the slot's capacity without a network). Its
    other parameters stay and get no gradient."""
    import torch
    from torch import nn

    class FreeSpan(type(net)):
        def forward(self, source, summary=None, min_passes=0):
            out = self.free[: self.slots_for(source.positions)]
            return out * (self.embed_norm / out.norm(dim=-1, keepdim=True).clamp(min=1e-6))

        def parameter_groups(self):
            return {"slots": [self.free]}

        def gates(self):
            return []

    net.__class__ = FreeSpan
    for p in net.parameters():
        p.requires_grad_(False)
    net.free = nn.Parameter(torch.randn(net.cfg.max_slots, net.d) / net.d ** 0.5)
    return net


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rung", type=int, choices=(1, 2), required=True)
    ap.add_argument("--config", type=Path, default=ROOT / "configs" / "train" / "remory_small.yaml")
    ap.add_argument("--boundaries", type=int, default=None, help="rung 2's boundaries (default 64)")
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--lr", type=float, default=None, help="LoRA's (default: the config's optim.lr; every other "
                                                          "group keeps its ratio to it)")
    ap.add_argument("--lora-rank", type=int, default=None, help="default: the config's memory.lora_rank")
    ap.add_argument("--queries", type=int, default=None, help="soft tokens per block (default: the config's)")
    ap.add_argument("--budget", type=int, default=None,
                    help="the student's budget (default: the config's data.budget); the dev prefixes take 1.4-3K "
                         "tokens, so below ~2.5K the rows are the recall sessions'")
    ap.add_argument("--recall-sessions", type=int, default=None,
                    help="programmatic recall sessions added to the data (default: the config's data.recall_sessions)")
    ap.add_argument("--recall-steps", type=int, default=None,
                    help="the most real steps between a recall session's fact and its use (default: the config's)")
    ap.add_argument("--memory-tokens", type=int, default=None,
                    help="what the memory reads, in ids (default: the config's data.memory_tokens)")
    ap.add_argument("--schedule", choices=("constant", "cosine"), default="cosine", help="the learning rate over steps")
    ap.add_argument("--kl-decay", type=float, default=None,
                    help="position weights of the loss, 1 / (1 + d * j) (default: the config's; 0 is the metric's "
                         "uniform mean over the target tokens)")
    ap.add_argument("--free-span", action="store_true",
                    help="the ceiling of the slot: train free soft vectors in the memory's positions (as many, the "
                         "same norm) instead of the network, reading nothing")
    ap.add_argument("--eval-every", type=int, default=10)
    ap.add_argument("--device", default=None,
                    help="where the actor and the network run (default: cuda when the config's distributed.use_gpu "
                         "is set and a GPU is there, else cpu)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--fresh-data", action="store_true", help="build the rows again even when the last build fits")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()

    import torch

    from palimpsest.evaluation.actions import (
        Arm,
        MemoryArm,
        TeacherCache,
        evaluate_actions,
        summarize_actions,
    )
    from palimpsest.models.actor import FrozenActor
    from palimpsest.models.encoder import MemoryEncoder
    from palimpsest.models.memory import MemoryRead
    from palimpsest.pipelines.environment import open_runtime
    from palimpsest.pipelines.replay_sessions import prepare_sessions
    from palimpsest.pipelines.trajectories import file_sha256, read_trajectories
    from palimpsest.platform.policies import load_policy_file
    from palimpsest.training.launcher import build_memory
    from palimpsest.training.losses import stage2_student
    from palimpsest.training.prepare import TEACHERS, _teacher_key, data_config
    from palimpsest.training.remory_data import stage2_recall
    from palimpsest.training.step import LocalBackend, PrefixCache, TrainStep, lr_at, sample_tensors
    from palimpsest.training.teachers import TOP_K, actor_key, compute_teacher, score
    from palimpsest.training.train_config import group_lrs, load_train_config

    cfg = load_train_config(args.config)
    mem_over = {k: v for k, v in (("lora_rank", args.lora_rank), ("queries", args.queries)) if v is not None}
    if mem_over:
        cfg = cfg.model_copy(update={"memory": MemoryConfig(**{**cfg.memory.to_dict(), **mem_over})})  # validated
    data_over = {k: v for k, v in (("recall_sessions", args.recall_sessions), ("budget", args.budget),
                                   ("recall_steps", args.recall_steps), ("memory_tokens", args.memory_tokens))
                 if v is not None}
    if data_over:
        cfg = cfg.model_copy(update={"data": cfg.data.model_copy(update=data_over)})
    lr = args.lr or cfg.optim.lr
    n = 1 if args.rung == 1 else (args.boundaries or 64)
    t0 = time.perf_counter()
    actor_path, data_dir, report, rows = prepared_rows(cfg, args.fresh_data)
    train = [r for r in rows if r["split"] == "train"]
    if not train:
        raise SystemExit(f"{cfg.data.file}: no Stage II training row at budget {cfg.data.budget}")
    # rung 1: the shortest training row (rows are sorted by history length); rung 2: a seeded sample
    chosen = train[:1] if n == 1 else sorted(random.Random(args.seed).sample(train, min(n, len(train))),
                                             key=lambda r: (r["trajectory"], r["t"]))
    prep_s = time.perf_counter() - t0
    print(f"rung {args.rung}: {len(chosen)} boundaries of {len(train)} training rows "
          f"({len({r['trajectory'] for r in chosen})} trajectories); data {prep_s:.0f} s", flush=True)

    torch.set_num_threads(max(torch.get_num_threads(), 1))
    torch.manual_seed(cfg.optim.seed)
    device = args.device or ("cuda" if cfg.distributed.use_gpu and torch.cuda.is_available() else "cpu")
    actor = FrozenActor.from_pretrained(actor_path, dtype=cfg.actor.dtype, device=device)
    net = build_memory(cfg, actor)
    if args.free_span:
        net = free_span(net)
    net = net.to(device)
    params = net.num_parameters()
    samples = [sample_tensors(r, 2, device) for r in chosen]
    cache = TeacherCache(data_dir / TEACHERS)
    data_sha = report["data_sha256"]
    teachers = []
    for r in chosen:  # the teacher training reads, cached where the launcher keeps it
        key = _teacher_key(cfg, actor_path, data_sha, r)
        t = cache.get(key)
        if t is None:
            t = compute_teacher(actor, r["teacher"], r["target"], TOP_K)
            cache.put(key, r["trajectory"], int(r["t"]), t)
        teachers.append(t)
    cache.save()
    prefix = PrefixCache(rows=len(chosen))  # every row: its context's KV (~120 MB at 2.6K SmolLM2 ids) and features

    def row_kls(rows=None) -> list[float]:
        """KL(pace+memory) per chosen row, the training path's scoring (eval-actions' figure at these rows);
        ``rows`` replaces each row's sample (the mismatched control)."""
        net.eval()
        with torch.no_grad():
            return [score(stage2_student(net, actor, s, 0, prefix), s["target"], t)["kl"]
                    for s, t in zip(rows or samples, teachers)]

    def memory_kl() -> float:
        kls = row_kls()
        return sum(kls) / len(kls)

    lrs = {k: v * lr / cfg.optim.lr for k, v in group_lrs(cfg.optim).items()}
    if args.free_span:
        lrs = {"slots": lr}
    backend = LocalBackend(net, lrs, cfg.optim.weight_decay, cfg.optim.grad_clip)
    kl_decay = cfg.optim.kl_decay if args.kl_decay is None else args.kl_decay
    step = TrainStep(backend, actor, kl_decay, prefix)
    curve, evals = [], [{"step": 0, "kl_memory": memory_kl()}]
    print(f"memory network: {params:,} parameters ({params / sum(p.numel() for p in actor.parameters()):.2%} of "
          f"the actor); KL(pace+memory) at init {evals[0]['kl_memory']:.4f}", flush=True)
    t_train = time.perf_counter()
    for i in range(args.steps):
        j = i % len(samples)
        backend.set_lr(lr_at(i, args.steps, 1.0, args.schedule, cfg.optim.warmup_steps))
        s0 = time.perf_counter()
        passes = net.merge_passes(int(samples[j]["memory"].numel()))
        figures = step(samples[j], 2, passes, teachers[j])
        curve.append({"step": i + 1, "row": j, **figures, "seconds": round(time.perf_counter() - s0, 2),
                      "lr": backend.optimizer.param_groups[0]["lr"]})
        if (i + 1) % args.eval_every == 0 or i + 1 == args.steps:
            evals.append({"step": i + 1, "kl_memory": memory_kl()})
            g = {k[5:]: f"{v:.2e}" for k, v in figures.items() if k.startswith("grad/")}
            print(f"step {i + 1}: loss {figures['loss']:.4f}, KL(pace+memory) {evals[-1]['kl_memory']:.4f}, "
                  f"grad norm {figures['grad_norm']:.3e}, gate {figures['gate']:+.4f}, per module {g}", flush=True)
    train_s = time.perf_counter() - t_train

    # Does the memory read its input? Each row is scored again with the memory made from another trajectory's
    # left-out history (its own context, summary, bridge and target): a memory that ignores what it reads (a
    # constant span) scores the same. Rung 2 pairs each row with the next chosen row of another trajectory (a
    # row of the same session would share most of its history), rung 1 with up to 8 training rows of others.
    own = row_kls()
    if len(chosen) > 1:
        donor_rows = [[next((chosen[(i + k) % len(chosen)] for k in range(1, len(chosen))
                             if chosen[(i + k) % len(chosen)]["trajectory"] != r["trajectory"]), None)]
                      for i, r in enumerate(chosen)]
    else:
        donor_rows = [[d for d in train if d["trajectory"] != chosen[0]["trajectory"]][:8]]
    donor_rows = [[d for d in ds if d is not None] for ds in donor_rows]
    mismatched: list[float | None] = []
    with torch.no_grad():
        for i, (s, ds) in enumerate(zip(samples, donor_rows)):
            kls = [score(stage2_student(net, actor, {**s, "memory": sample_tensors(d, 2, device)["memory"]}, 0,
                                        prefix), s["target"], teachers[i])["kl"] for d in ds]
            mismatched.append(sum(kls) / len(kls) if kls else None)  # None: no row of another trajectory
    read = read_trajectories(Path(cfg.data.file))
    pool = read.trajectories + stage2_recall(read.trajectories, data_config(cfg))  # as the rows were built
    last_step = {t.id: len(t.steps) - 1 for t in pool}
    use = [r["trajectory"].startswith("recall/") and int(r["t"]) == last_step.get(r["trajectory"]) for r in chosen]
    fact = {t.id: (getattr(t, "meta", None) or {}).get("fact") for t in pool}

    # The official figure: eval-actions' own scoring of pace, pace+empty and pace+memory at these boundaries.
    policy = load_policy_file(cfg.tracking.policy_config)
    wanted = {r["trajectory"] for r in chosen}
    # the data build's own ledger: a step's id is the ledger's (``[#296 bash ls]``, ``glimpse(#296)``), so a fresh
    # ledger would number the steps from 1 and hand the arms a prompt 12 ids away from the rows trained on
    rt = open_runtime(data_dir / "ledger.db", cfg.data.embedder, actor_path)
    sessions = prepare_sessions(rt, [t for t in pool if t.id in wanted], False, file_sha256(Path(cfg.data.file)), [])
    arm = MemoryArm(MemoryEncoder(net.eval(), actor), MemoryRead(max_history_tokens=cfg.data.memory_tokens,
                                                             max_field_chars=cfg.data.max_observation_chars))
    arms = [Arm("pace", policy), Arm("pace+empty", policy, arm, inject=False), Arm("pace+memory", policy, arm)]
    result = evaluate_actions(rt, sessions, arms, cfg.data.budget, actor, data_sha=data_sha,
                              actor_key=actor_key(actor_path, cfg.actor.dtype), window=cfg.data.max_history_tokens,
                              max_target_tokens=cfg.data.max_target_tokens, reference="pace", cache=cache,
                              only={(r["trajectory"], int(r["t"])) for r in chosen})
    # whether the value a recall boundary needs is in what the memory read (a memory cannot carry what it
    # never saw) and in the prompt's own text (then the memory has nothing to add)
    tok = rt.ledger.tokenizer
    fact_in = [None if not u else {"read": fact[r["trajectory"]] in tok.decode(r["memory"]),
                                   "prompt": fact[r["trajectory"]] in tok.decode(r["context"] + r["bridge"])}
               for r, u in zip(chosen, use)]
    rt.ledger.close()
    gap = result.gap_closed.get("pace+memory")
    target = TARGETS[args.rung]
    # the same figures over the recall boundaries (the action needs a fact only the left-out history holds) and
    # over the others (ordinary continuations)
    is_use = {(r["trajectory"], int(r["t"])): u for r, u in zip(chosen, use)}

    def paired(idx) -> dict:
        """Mean KL with the row's own memory and with another trajectory's, over the rows of ``idx`` that have
        a donor (``rows``; None where none has)."""
        has = [i for i in idx if mismatched[i] is not None]
        if not has:
            return {"rows": 0, "kl_own_memory": None, "kl_mismatched_memory": None}
        return {"rows": len(has), "kl_own_memory": sum(own[i] for i in has) / len(has),
                "kl_mismatched_memory": sum(mismatched[i] for i in has) / len(has)}

    by_kind = {}
    for kind, flag in (("recall_use", True), ("other", False)):
        rows_k = [b for b in result.boundaries if is_use.get((b["trajectory"], int(b["t"]))) == flag]
        idx = [i for i, u in enumerate(use) if u == flag]
        if not idx:
            continue
        part = summarize_actions(rows_k, [a.label for a in arms], "pace")
        by_kind[kind] = {"boundaries": len(idx), "gap_closed": part.gap_closed.get("pace+memory"),
                         "kl": {k: v["kl"] for k, v in part.policies.items()}, **paired(idx)}
        if flag:
            by_kind[kind]["fact_in_read"] = sum(fact_in[i]["read"] for i in idx)
            by_kind[kind]["fact_in_prompt"] = sum(fact_in[i]["prompt"] for i in idx)
    control = {**paired(range(len(chosen))), "donors_per_row": max(len(ds) for ds in donor_rows),
               "by_kind": by_kind}
    out = {"rung": args.rung, "config": str(args.config), "device": device, "memory": cfg.memory.to_dict(),
           "parameters": params, "schedule": args.schedule, "lrs": lrs,
           "actor_parameters": sum(p.numel() for p in actor.parameters()), "lr": lr, "steps": args.steps,
           "kl_decay": kl_decay, "free_span": args.free_span,
           "boundaries": [{"trajectory": r["trajectory"], "t": r["t"], "context": len(r["context"]),
                           "memory": len(r["memory"]), "bridge": len(r["bridge"]), "teacher": len(r["teacher"]),
                           "recall_use": u, "fact": fi, "kl_own_memory": ko, "kl_mismatched_memory": km,
                           "donors": [{"trajectory": d["trajectory"], "t": d["t"]} for d in ds]}
                          for r, u, fi, ko, km, ds in zip(chosen, use, fact_in, own, mismatched, donor_rows)],
           "eval_actions": result.to_json(), "gap_closed": gap, "target": target, "input_control": control,
           "met": gap is not None and gap >= target, "curve": curve, "evals": evals,
           "seconds": {"data": round(prep_s, 1), "train": round(train_s, 1),
                       "per_step": round(train_s / max(args.steps, 1), 2)},
           "prefix_cache": {"hits": prefix.hits, "misses": prefix.misses}}
    path = args.out or ROOT / "benchmarks" / "results" / f"ladder_rung{args.rung}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2, default=str))
    print("\n| policy | KL | NLL | top-1 | positions | gap closed vs pace |\n|---|---|---|---|---|---|")
    for label, p in result.policies.items():
        g = result.gap_closed.get(label)
        print(f"| {label} | {p['kl']:.4f} | {p['nll']:.3f} | {p['top1']:.3f} | {p['positions']:.0f} | "
              f"{'-' if g is None else f'{g:+.3f}'} |")
    def pair(k: dict) -> str:
        if not k["rows"]:
            return "no row of another trajectory to swap in"
        return (f"KL with the row's own memory {k['kl_own_memory']:.4f}, another trajectory's "
                f"{k['kl_mismatched_memory']:.4f} ({k['rows']} rows)")

    print(f"\ninput control: {pair(control)}")
    for kind, k in by_kind.items():
        g = "-" if k["gap_closed"] is None else f"{k['gap_closed']:+.3f}"
        seen = f", the fact in the read {k['fact_in_read']}, in the prompt {k['fact_in_prompt']}" \
            if "fact_in_read" in k else ""
        print(f"  {kind}: {k['boundaries']} boundaries, gap closed {g}{seen}; {pair(k)}")
    print(f"\nrung {args.rung}: gap closed {gap if gap is None else f'{gap:.3f}'} (target {target:.2f}): "
          f"{'met' if out['met'] else 'NOT met'}; {train_s:.0f} s for {args.steps} steps; results: {path}")


if __name__ == "__main__":
    main()
