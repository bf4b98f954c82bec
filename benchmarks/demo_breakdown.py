"""Where the actor's cores go under a demo configuration: the load mix over a fixed stretch of its live traffic.

    .venv/bin/python benchmarks/demo_breakdown.py --config benchmarks/demo_before.yaml --seconds 480 [--full]

Starts the composed app with ``--config``, drives the dev trajectories through it as `palimpsest demo` does
(each once per arm), and after ``--seconds`` of traffic reads ``GET /v1/busy``: the actor's requests by kind
(turn prefill and decode, step summaries, the elasticizer) with their tokens and request-seconds, the memory
encoder's encodings and the shadow lane's scorings, beside the turns served and the shadow samples still
queued. It then stops. A run that would take an hour is described by its first minutes; the demo's own
breakdown (`palimpsest demo`) covers a whole run. ``--full`` drives as the demo did before it was sized (every
trajectory, two turns per session from step 4, every step of each trajectory appended, LLM summaries); without
it, as the default demo.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", type=Path, default=ROOT / "configs" / "serve" / "demo.yaml")
    ap.add_argument("--data", type=Path, default=ROOT.parent / "shared" / "data" / "trajectories" / "dev.jsonl")
    ap.add_argument("--seconds", type=float, default=480.0, help="traffic time after which the load mix is read")
    ap.add_argument("--full", action="store_true")
    ap.add_argument("--port", type=int, default=8133)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "demo_breakdown.json")
    args = ap.parse_args()
    from palimpsest.demo import DEMO_SESSIONS, busy_markdown, fitting
    from palimpsest.experiments.live import drive
    from palimpsest.serving.local import LocalServer
    from palimpsest.serving.serve_config import load_serve_config

    cfg = load_serve_config(args.config)
    if args.full:
        cfg = cfg.model_copy(update={"summarizer": cfg.summarizer.model_copy(update={"mode": "llm"})})
    trajs, _ = fitting([args.data], None if args.full else DEMO_SESSIONS, cfg.budget, cfg.actor.max_tokens)
    arms = [a.name for a in cfg.arms]
    t0 = time.perf_counter()
    server = LocalServer(cfg, port=args.port).start()
    start_s = time.perf_counter() - t0
    result: dict = {"config": str(args.config), "full": args.full, "arms": arms, "serve_start_s": start_s}
    try:
        driven: dict = {}

        def run() -> None:
            driven["res"] = drive(server.url, trajs, prefix=f"breakdown-{int(time.time())}/", every=8,
                                  first=4, max_turns=2 if args.full else 1,
                                  concurrency=4 if args.full else min(len(trajs) * len(arms), 16), arms=arms,
                                  tail=args.full)

        worker = threading.Thread(target=run, daemon=True)
        t1 = time.perf_counter()
        worker.start()
        worker.join(args.seconds)
        with httpx.Client(base_url=server.url, timeout=120) as client:
            busy = client.get("/v1/busy").json()
            shadow = client.get("/v1/ab/shadow").json()
        result.update(traffic_s=time.perf_counter() - t1, finished=not worker.is_alive(), busy=busy, shadow=shadow)
    finally:
        server.stop()
    md = busy_markdown(busy, {"serve start": start_s, "traffic read after": result["traffic_s"]})
    print(md)
    print(f"shadow lane: {shadow}; traffic {'finished' if result['finished'] else 'still running'} when read")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({**result, "markdown": md}, indent=2))
    print(f"results: {args.out}")


if __name__ == "__main__":
    main()
