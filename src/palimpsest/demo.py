"""`make demo`, the main job end to end on embedded defaults (top layer, beside the command line):

1. prepare the offline models (SmolLM2-135M actor folder and tokenizer, all-MiniLM-L6-v2);
2. train a small REMORY memory network with Ray Train + DeepSpeed if none fitting the actor is registered;
3. start the composed Serve app on 127.0.0.1 (actor on vLLM with prompt embeds, embedder, summarizer,
   memory encoder, ingress);
4. replay the dev trajectories through the HTTP endpoint as live A/B traffic on two arms (`pace` and
   `pace` + soft memory), each trajectory once per arm (paired), posting each session's outcome; every
   served turn is scored for shadow fidelity against the full-history reference off the turn path;
5. print the per-arm comparison with confidence intervals (outcome, shadow fidelity, tokens, latency,
   prefix-cache hit rate), the power statement, the paired comparison, and the MLflow run that holds it;
6. shut everything down.
"""

from __future__ import annotations

import time
from pathlib import Path

from rich.console import Console
from rich.markdown import Markdown

from palimpsest.platform.types import PalimpsestError

DEMO_SERVE = Path("configs/serve/demo.yaml")
DEMO_TRAIN = Path("configs/train/remory_demo.yaml")


def ensure_memory(out: Console, train_config: Path, data: Path) -> str | None:
    """The registered memory model for SmolLM2, training the demo one first when there is none."""
    from palimpsest.models.assets import smollm2_dir
    from palimpsest.models.encoder import load_memory
    from palimpsest.models.registry import resolve_memory_ref

    ref = resolve_memory_ref("auto")
    if ref is not None:
        import json

        hidden = json.loads((smollm2_dir() / "config.json").read_text())["hidden_size"]
        if load_memory(ref).cfg.d_actor == hidden:
            out.print(f"memory model: {ref} (registered)")
            return ref
    from palimpsest.training.config import load_train_config
    from palimpsest.training.launcher import launch

    cfg = load_train_config(train_config)
    cfg = cfg.model_copy(update={"data": cfg.data.model_copy(update={"file": str(data)})})
    out.print(f"no memory model for the actor is registered: training {cfg.name} with Ray Train + DeepSpeed "
              f"({cfg.optim.stage1_steps}+{cfg.optim.stage2_steps} steps, {cfg.distributed.num_workers} workers) ...")
    t0 = time.perf_counter()
    summary = launch(cfg)
    out.print(f"trained in {time.perf_counter() - t0:.0f} s; registered {summary.get('registered')}")
    return summary.get("registered")


def wait_shadow(url: str, timeout_s: float) -> dict:
    """Wait until the ingress has scored (or skipped) every turn it sampled for shadow fidelity."""
    import httpx

    deadline = time.monotonic() + timeout_s
    state: dict = {}
    with httpx.Client(base_url=url, timeout=120) as client:
        while time.monotonic() < deadline:
            state = client.get("/v1/ab/shadow", params={"wait_s": 60}).json()
            if state.get("drained"):
                break
    return state


def run_main_demo(out: Console, data: Path, serve_config: Path = DEMO_SERVE, train_config: Path = DEMO_TRAIN,
                  port: int = 8000, every: int = 8, max_turns: int = 2, concurrency: int = 4,
                  limit: int | None = None, track: bool = True) -> dict:
    from palimpsest.models.assets import minilm_dir, smollm2_dir, smollm2_tokenizer_dir
    from palimpsest.pipelines.ab import ab_summary, log_ab, summary_markdown
    from palimpsest.pipelines.live_ab import drive
    from palimpsest.platform import Ledger
    from palimpsest.serving.config import load_serve_config
    from palimpsest.serving.local import LocalServer

    t_all = time.perf_counter()
    if not data.is_file():
        raise PalimpsestError(f"no trajectories at {data}; pass --data FILE")
    cfg = load_serve_config(serve_config)
    out.rule("1. models")
    out.print(f"actor: {smollm2_dir()}\ntokenizer: {smollm2_tokenizer_dir()}\nembedder: {minilm_dir()}")
    out.rule("2. memory")
    ensure_memory(out, train_config, data)
    out.rule("3. serve")
    t0 = time.perf_counter()
    server = LocalServer(cfg, port=port).start()
    timings = {"serve_start_s": time.perf_counter() - t0}
    info = server.info
    out.print(f"composed app ready at {server.url} in {timings['serve_start_s']:.0f} s: actor {info['actor']}, "
              f"embedder {info['embedder']}, summarizer {info['summarizer']['name']}, "
              f"memory {info['memory']['models']['default']['model'] or 'off'}; arms {info['arms']}")
    try:
        out.rule("4. live A/B traffic")
        prefix = f"demo-{time.strftime('%Y%m%d-%H%M%S')}/"

        def progress(sid, res):
            out.print(f"  {sid}: arm {res.sessions.get(sid, '?')}, next-action F1 {res.f1.get(sid, float('nan')):.3f}",
                      highlight=False)

        arms = [a.name for a in cfg.arms]
        res = drive(server.url, data, prefix=prefix, every=every, max_turns=max_turns, concurrency=concurrency,
                    limit=limit, on_session=progress, arms=arms)
        timings["traffic_s"] = res.wall_s
        out.print(f"{len(res.sessions)} sessions (each trajectory once per arm), {res.turns} turns in {res.wall_s:.0f} s; "
                  f"{len(res.errors)} errors")
        for e in res.errors[:5]:
            out.print(f"  [red]{e}[/]", highlight=False)
        t0 = time.perf_counter()
        shadow = wait_shadow(server.url, timeout_s=1800)
        timings["shadow_s"] = time.perf_counter() - t0
        out.print(f"shadow fidelity: {shadow.get('scored', 0)} turns scored, {shadow.get('skipped', 0)} skipped "
                  f"({timings['shadow_s']:.0f} s after the traffic)")
    finally:
        server.stop()
    if res.turns == 0:
        raise PalimpsestError(f"no turn was served ({len(res.errors)} errors; first: {res.errors[:1]})")
    out.rule("5. per-arm report")
    ledger = Ledger(cfg.ledger)
    served = [r for r in ledger.served(res.started) if r["session_id"].startswith(prefix)]
    outcomes = [o for o in ledger.outcomes(res.started) if o["session_id"].startswith(prefix)]
    shadows = [r for r in ledger.shadows(res.started) if r["session_id"].startswith(prefix)]
    summary = ab_summary(served, outcomes, [a.name for a in cfg.arms], shadows)
    md = summary_markdown(summary)
    out.print(Markdown(md))
    if track:
        run_id, uri = log_ab(summary, cfg.tracking.experiment, {"serve_config": str(serve_config), "data": str(data),
                                                              "every": every, "max_turns": max_turns}, md)
        out.print(f"MLflow: experiment {cfg.tracking.experiment!r}, run {run_id} at {uri}")
    timings["total_s"] = time.perf_counter() - t_all
    out.print(f"demo finished in {timings['total_s']:.0f} s (serve start {timings['serve_start_s']:.0f} s, "
              f"traffic {timings['traffic_s']:.0f} s); everything is shut down")
    return {"summary": summary, "timings": timings, "errors": res.errors}
