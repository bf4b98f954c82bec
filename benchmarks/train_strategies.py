"""Training throughput of ZeRO-2, ZeRO-3 and plain DDP side by side, in one run, on the same job.

    python benchmarks/train_strategies.py [--config configs/train/remory_small.yaml] [--steps 12]

Each strategy trains the config's memory network for --steps steps (half Stage I, half Stage II) on its
workers, without MLflow. Reported per strategy: wall time of the fit (Ray start-up included), mean
seconds per step and tokens/s per worker over the last steps (rank 0's view), peak RSS per worker.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from palimpsest.training.train_config import load_train_config


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", type=Path, default=Path("configs/train/remory_small.yaml"))
    ap.add_argument("--steps", type=int, default=12)
    args = ap.parse_args()
    import ray

    from palimpsest.training.launcher import launch

    base = load_train_config(args.config)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for label, dist in (("zero2", {"strategy": "deepspeed", "zero_stage": 2}),
                            ("zero3", {"strategy": "deepspeed", "zero_stage": 3}),
                            ("ddp", {"strategy": "ddp"})):
            cfg = base.model_copy(update={
                "name": f"bench-{label}", "storage": tmp,
                "distributed": base.distributed.model_copy(update=dist),
                "optim": base.optim.model_copy(update={"stage1_steps": args.steps // 2,
                                                       "stage2_steps": args.steps - args.steps // 2,
                                                       "stage2_replay_every": 0,  # every step's loss a KL
                                                       "checkpoint_every": args.steps})})
            summary = launch(cfg, track=False)
            m = summary["metrics"]
            results[label] = {"wall_s": summary["wall_s"], "last_step_s": round(m["seconds"], 2),
                              "tokens_per_s_per_worker": round(m["tokens_per_s"], 1),
                              "max_rss_mb_per_worker": round(m["max_rss_mb"], 0), "final_loss": round(m["loss"], 4)}
            print(label, json.dumps(results[label]), flush=True)
        ray.shutdown()
    print("\n| strategy | wall s | s/step (last) | tokens/s per worker | peak RSS per worker (MB) |")
    print("|---|---|---|---|---|")
    for k, r in results.items():
        print(f"| {k} | {r['wall_s']} | {r['last_step_s']} | {r['tokens_per_s_per_worker']} | "
              f"{r['max_rss_mb_per_worker']} |")


if __name__ == "__main__":
    main()
