"""`make demo`, the main job end to end on embedded defaults (top layer, beside the command line), sized for the
machine it runs on (2 CPU cores: about ten minutes after the install, BENCHMARKS.md):

1. prepare the offline models (SmolLM2-135M actor folder and tokenizer, all-MiniLM-L6-v2);
2. train a small REMORY memory network with Ray Train + DeepSpeed if none fitting the actor is registered;
3. start the composed Serve app on 127.0.0.1 (actor on vLLM with prompt embeds, embedder, summarizer,
   memory encoder, ingress);
4. replay the dev trajectories through the HTTP endpoint as live A/B traffic, each trajectory once per arm
   (paired), posting each session's outcome: `pace` against `window`, two policies that differ at the demo's
   budget, plus `pace+memory` when the registered memory was trained at that budget; every served turn is
   scored for shadow fidelity (the exact KL against the full-history reference) off the turn path;
5. print the per-arm comparison (fidelity over the turns each arm changed, identical turns counted apart,
   bounded intervals, the paired comparison and what it could detect), what the rollout gate would decide on
   `pace+memory` as a candidate of `pace` (as `palimpsest serve` runs a registered memory: dark until promoted),
   where the models' time went, and the MLflow run that holds it;
6. shut everything down.

``--control`` runs the controls instead (pipelines/ab_controls.py): the weak `last2` against `pace` as users run
it (compaction epochs) and `pace` planned per turn (the positive controls), and `pace` against itself (the A/A
control), at budget 4,096 with an 8K reference window, one turn per session at step 8. ``--full`` is the larger run:
every trajectory, two turns per session (steps 4 and 12), LLM summaries of every step appended; as in the default
run, a session ends at its last turn (the steps after it would be summarised for no turn to read).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console
from rich.markdown import Markdown

from palimpsest.models.assets import minilm_dir, smollm2_dir, smollm2_tokenizer_dir
from palimpsest.models.registry import read_bundle, resolve_memory_ref
from palimpsest.pipelines.ab import ab_summary, log_ab, summary_markdown
from palimpsest.pipelines.ab_controls import (
    AA,
    CONTROL_ARMS,
    CONTROL_SHAPE,
    POSITIVE,
    control_verdicts,
    verdicts_markdown,
)
from palimpsest.pipelines.live_ab import drive
from palimpsest.pipelines.rollouts import gate_on_paired_arms
from palimpsest.pipelines.trajectories import read_trajectories
from palimpsest.platform import Ledger
from palimpsest.platform.chat import chat_ids
from palimpsest.platform.tokens import get_tokenizer
from palimpsest.platform.types import ConfigError, PalimpsestError
from palimpsest.serving.config import ArmConfig, load_serve_config, parse_serve_config
from palimpsest.serving.local import LocalServer
from palimpsest.training.config import load_train_config
from palimpsest.training.launcher import launch

DEMO_SERVE = Path("configs/serve/demo.yaml")
DEMO_TRAIN = Path("configs/train/remory_demo.yaml")
MEMORY_ARM = "pace+memory"
DEMO_TRAJECTORIES = 3  # the default run's share of the dev file (``--control`` and ``--full`` take every one)
@dataclass
class Progress:
    """One line per stage and per step inside it, with the elapsed time and an ETA from the rate so far."""
    out: Console
    stages: int
    t0: float = field(default_factory=time.perf_counter)
    stage_t0: float = 0.0
    n: int = 0
    title: str = ""
    seconds: dict = field(default_factory=dict)  # wall seconds per finished stage

    def stage(self, title: str, expect_s: float | None = None) -> None:
        self.close()
        self.n += 1
        self.title = title.split(":")[0]
        self.stage_t0 = time.perf_counter()
        hint = f" (about {expect_s:.0f} s on 2 CPU cores)" if expect_s else ""
        self.out.rule(f"{self.n}/{self.stages}. {title}{hint}")

    def close(self) -> None:
        if self.title:
            self.seconds[self.title] = time.perf_counter() - self.stage_t0
            self.title = ""

    def step(self, done: int, total: int, what: str) -> None:
        el = time.perf_counter() - self.stage_t0
        eta = el / done * (total - done) if done else float("nan")
        self.out.print(f"  [{self.n}/{self.stages}] {done}/{total} {what}; {el:.0f} s elapsed, "
                       f"ETA {'?' if eta != eta else f'{eta:.0f} s'} (demo at {time.perf_counter() - self.t0:.0f} s)",
                       highlight=False)


def ensure_memory(out: Console, train_config: Path, data: Path) -> str | None:
    """The registered memory model for SmolLM2, training the demo one first when there is none."""
    ref = resolve_memory_ref("auto")
    if ref is not None:
        import json

        hidden = json.loads((smollm2_dir() / "config.json").read_text())["hidden_size"]
        try:
            bundle = read_bundle(ref)
        except ConfigError as e:  # another architecture, or unreadable: a new one is trained
            out.print(f"registered memory {ref} not used: {e}")
            bundle = None
        if bundle is not None and bundle.actor.get("hidden_size") == hidden:
            out.print(f"memory model: {ref} (registered)")
            return ref

    cfg = load_train_config(train_config)
    cfg = cfg.model_copy(update={"data": cfg.data.model_copy(update={"file": str(data)})})
    out.print(f"no memory model for the actor is registered: training {cfg.name} with Ray Train + DeepSpeed "
              f"({cfg.optim.stage1_steps}+{cfg.optim.stage2_steps} steps, {cfg.distributed.num_workers} workers) ...")
    t0 = time.perf_counter()
    summary = launch(cfg)
    parts = ", ".join(f"{k.removesuffix('_s')} {v:.0f} s" for k, v in (summary.get("timings") or {}).items())
    out.print(f"trained in {time.perf_counter() - t0:.0f} s ({parts}); registered {summary.get('registered')}")
    return summary.get("registered")


def memory_fits(ref: str | None, budget: int) -> tuple[bool, str]:
    """Whether the registered memory was trained on prompts at this budget (it learned what they leave out)."""
    if ref is None:
        return False, "no memory model"
    trained = read_bundle(ref).budget
    if trained != budget:
        return False, f"{ref} was trained at budget {trained}, the demo serves {budget}"
    return True, f"{ref}, trained at budget {trained}"


def wait_shadow(url: str, timeout_s: float, progress: Progress | None = None) -> dict:
    """Wait until the ingress has scored (or skipped) every turn it sampled for shadow fidelity."""
    import httpx

    deadline = time.monotonic() + timeout_s
    state: dict = {}
    with httpx.Client(base_url=url, timeout=120) as client:
        while time.monotonic() < deadline:
            state = client.get("/v1/ab/shadow", params={"wait_s": 20}).json()
            if progress is not None:
                done = state.get("scored", 0) + state.get("identical", 0) + state.get("skipped", 0)
                progress.step(done, state.get("sampled", 0), "sampled turns scored, identical or skipped")
            if state.get("drained"):
                break
    return state


def busy_markdown(busy: dict, timings: dict) -> str:
    """Where the models' time went (``GET /v1/busy``), and the demo's stages by wall time."""
    lines = ["| load | calls | input positions (cached) | generated tokens | seconds to first token | seconds after |",
             "|---|---|---|---|---|---|"]
    for kind, b in sorted((busy.get("actor") or {}).items()):
        lines.append(f"| actor: {kind} | {b['requests']} | {b['prompt_tokens']:,} ({b['cached_tokens']:,}) | "
                     f"{b['completion_tokens']:,} | {b['prefill_s']:.1f} | {b['decode_s']:.1f} |")
    labels = {"shadow": "shadow scoring (HF forwards)", "memory": "memory encoding"}
    for kind, b in sorted((busy.get("memory") or {}).items()):
        lines.append(f"| {labels.get(kind, kind)} | {b['calls']} | {b['tokens']:,} | - | {b['seconds']:.1f} | - |")
    lines += ["", "Actor seconds are request-seconds: requests run batched, so concurrent ones overlap. Seconds to "
              "the first token are queueing plus the prefill of what the prefix cache did not hold.", "",
              "| stage | seconds |", "|---|---|"]
    lines += [f"| {k} | {v:.0f} |" for k, v in timings.items()]
    return "\n".join(lines) + "\n"


def fitting(data: Path, limit: int | None, budget: int, reply: int) -> tuple[list, list[str]]:
    """The first ``limit`` trajectories whose prompt prefix (system prompt, task, tools under the actor's template)
    leaves room for history in the budget; the others are named with why (the server would refuse their turns)."""
    tok = get_tokenizer(str(smollm2_tokenizer_dir()), None)
    keep, left = [], []
    for tr in read_trajectories(data).trajectories:
        if limit is not None and len(keep) >= limit:
            break
        prefix = len(chat_ids(tok, [{"role": "system", "content": (tr.system or "") + (tr.tools or "")},
                                    {"role": "user", "content": tr.task}]).all)
        if prefix + reply + 256 > budget:
            left.append(f"{tr.id}: its system prompt, tools and task take {prefix} tokens of the {budget} budget")
        else:
            keep.append(tr)
    if not keep:
        raise PalimpsestError(f"no trajectory of {data} fits the budget of {budget} tokens")
    return keep, left


def demo_config(serve_config: Path, control: bool, full: bool, budget: int | None = None, window: int | None = None):
    """The serve config of the run: the demo's arms, or the positive control's; LLM summaries with ``--full``;
    another budget or actor window (the reference's reach) when given."""
    cfg = load_serve_config(serve_config)
    if budget or window:  # validated together (a budget past the window is refused here)
        raw = cfg.model_dump()
        raw["budget"] = budget or raw["budget"]
        raw["actor"]["max_model_len"] = window or raw["actor"]["max_model_len"]
        cfg = parse_serve_config(raw)
    update: dict = {}
    if control:
        update["arms"] = [ArmConfig.model_validate(a) for a in CONTROL_ARMS]
    if full:
        update["summarizer"] = cfg.summarizer.model_copy(update={"mode": "llm"})
    return cfg.model_copy(update=update) if update else cfg


def identical_note(summary: dict) -> str:
    """The share of scored turns where an arm served its reference itself, said before any figure: those turns
    have no difference to measure (at the demo's first turns much of a history still fits the budget)."""
    parts, total, same = [], 0, 0
    for arm, a in summary["arms"].items():
        f = a["fidelity"]
        n = f["scored"] + f["identical"]
        total, same = total + n, same + f["identical"]
        parts.append(f"`{arm}` {f['identical']} of {n}")
    if not total:
        return "No turn was scored for shadow fidelity.\n\n"
    return (f"**{same} of {total} scored turns served their reference itself** ({', '.join(parts)}): their "
            "fidelity is exact by construction, so they are counted and left out; the figures below cover the "
            "turns where an arm changed something.\n\n")


def gate_note(shadows: list[dict], served: list[dict], arms: list[str]) -> str:
    """What the rollout gate would decide on the memory arm as a candidate of `pace` (what `palimpsest serve` makes
    of a registered memory), read on this run's paired turns."""
    if MEMORY_ARM not in arms or "pace" not in arms:
        return ""
    try:
        g = gate_on_paired_arms(shadows, served, "pace", MEMORY_ARM)
    except PalimpsestError as e:  # no gate in this checkout's statistics
        return f"\nThe rollout gate was not read: {e}.\n"
    return (f"\n**The rollout gate** on `{MEMORY_ARM}` as a candidate of `pace`, read on these {g['sessions']} paired "
            f"trajectories: **{g['decision']}** ({g['reason']}). Served by default it would stay dark until the gate "
            "promotes it (docs/serving.md, \"Candidates and rollouts\").\n")


def show_markdown(out: Console, md: str) -> None:
    """Markdown rendered on a terminal; in a log (output not a terminal) as its own text, lines whole: rich would
    wrap every table at 80 columns into fragments."""
    if out.is_terminal:
        out.print(Markdown(md))
    else:
        out.print(md, markup=False, highlight=False, soft_wrap=True)


def run_main_demo(out: Console, data: Path, serve_config: Path = DEMO_SERVE, train_config: Path = DEMO_TRAIN,
                  port: int = 8000, every: int = 8, max_turns: int | None = None, concurrency: int | None = None,
                  limit: int | None = None, track: bool = True, control: bool = False, full: bool = False,
                  first: int | None = None, budget: int | None = None, window: int | None = None) -> dict:
    """The demo (or with ``control`` the controls, in their shape, ``CONTROL_SHAPE``, where a value is not given).
    Returns the summary (the positive controls' with ``control``, and ``aa``), timings, errors, the report."""
    import httpx

    shape = CONTROL_SHAPE if control else {"first": 4, "max_turns": 1}
    first = shape["first"] if first is None else first
    max_turns = shape["max_turns"] if max_turns is None else max_turns
    budget, window = budget or shape.get("budget"), window or shape.get("window")

    if not data.is_file():
        raise PalimpsestError(f"no trajectories at {data}; pass --data FILE")
    if full:  # the previous default's shape: a turn every 8 steps from step 4, two per session
        first, max_turns = min(first, 4), max(max_turns, 2)
    if limit is None and not (control or full):
        limit = DEMO_TRAJECTORIES
    cfg = demo_config(serve_config, control, full, budget, window)
    progress = Progress(out, stages=6)
    timings: dict[str, float] = {}
    progress.stage("models")
    out.print(f"actor: {smollm2_dir()}\ntokenizer: {smollm2_tokenizer_dir()}\nembedder: {minilm_dir()}")
    progress.stage("memory", expect_s=None if control else 100)
    t0 = time.perf_counter()
    if not control:
        ref = ensure_memory(out, train_config, data)
        fits, why = memory_fits(ref, cfg.budget)
        if fits and MEMORY_ARM not in [a.name for a in cfg.arms]:
            cfg = cfg.model_copy(update={"arms": [*cfg.arms, ArmConfig(name=MEMORY_ARM, policy={"type": "pace"},
                                                                         memory=True)]})
        out.print(f"memory arm {'added' if fits else 'left out'}: {why}")
    else:
        out.print("the controls: `last2` against `pace` (compaction epochs) and `pace-per-turn`; `pace` against "
                  f"`pace-aa` (A/A); budget {cfg.budget}, reference window {cfg.actor.max_model_len}, no memory arm")
    timings["memory_s"] = time.perf_counter() - t0
    if not any(a.memory for a in cfg.arms):
        cfg = cfg.model_copy(update={"memory": cfg.memory.model_copy(update={"model": None})})
    arms = [a.name for a in cfg.arms]
    progress.stage("serve", expect_s=60)
    t0 = time.perf_counter()
    server = LocalServer(cfg, port=port).start()
    timings["serve_start_s"] = time.perf_counter() - t0
    info = server.info
    out.print(f"composed app ready at {server.url} in {timings['serve_start_s']:.0f} s: actor {info['actor']}, "
              f"embedder {info['embedder']}, summarizer {info['summarizer']['name']}, "
              f"memory {info['memory']['models']['default']['model'] or 'off'}; arms {info['arms']}; "
              f"budget {cfg.budget}")
    try:
        trajs, left_out = fitting(data, limit, cfg.budget, cfg.actor.max_tokens)
        for why in left_out:
            out.print(f"  left out: {why}", highlight=False)
        total = len(trajs) * len(arms)
        progress.stage(f"live A/B traffic: {len(trajs)} trajectories x {len(arms)} arms, up to {max_turns} turns each")
        prefix = f"demo-{time.strftime('%Y%m%d-%H%M%S')}/"
        finished: list[str] = []

        def on_session(sid, res):
            finished.append(sid)
            progress.step(len(finished), total, f"sessions ({res.turns} turns, {len(res.errors)} errors; "
                                                f"{sid.removeprefix(prefix)}: next-action F1 "
                                                f"{res.f1.get(sid, float('nan')):.3f})")

        # every session at once by default: vLLM batches their prefills and no core waits for a session's appends
        res = drive(server.url, trajs, prefix=prefix, every=every, first=first, max_turns=max_turns,
                    concurrency=concurrency or min(total, 16), on_session=on_session, arms=arms, tail=False)
        timings["traffic_s"] = res.wall_s
        out.print(f"{len(res.sessions)} sessions (each trajectory once per arm), {res.turns} turns in {res.wall_s:.0f} s; "
                  f"{len(res.errors)} errors")
        for e in res.errors[:5]:
            out.print(f"  [red]{e}[/]", highlight=False)
        progress.stage("shadow fidelity (exact KL against the reference, off the turn path)")
        t0 = time.perf_counter()
        shadow = wait_shadow(server.url, timeout_s=1800, progress=progress)
        timings["shadow_s"] = time.perf_counter() - t0
        out.print(f"shadow fidelity: {shadow.get('scored', 0)} turns scored, {shadow.get('identical', 0)} identical "
                  f"to their reference, {shadow.get('skipped', 0)} skipped ({timings['shadow_s']:.0f} s after the traffic)")
        with httpx.Client(base_url=server.url, timeout=60) as client:
            busy = client.get("/v1/busy").json()
    finally:
        server.stop()
    if res.turns == 0:
        raise PalimpsestError(f"no turn was served ({len(res.errors)} errors; first: {res.errors[:1]})")
    progress.stage("report")
    ledger = Ledger(cfg.ledger)
    served = [r for r in ledger.served(res.started) if r["session_id"].startswith(prefix)]
    calls = [r for r in ledger.served(res.started, kind="summary") if r["session_id"].startswith(prefix)]
    outcomes = [o for o in ledger.outcomes(res.started) if o["session_id"].startswith(prefix)]
    shadows = [r for r in ledger.shadows(res.started) if r["session_id"].startswith(prefix)]
    aa = verdicts = None
    if control:  # two reports from one run: the positive controls, and the A/A control
        summary = ab_summary(served, outcomes, list(POSITIVE), shadows, calls)
        aa = ab_summary(served, outcomes, list(AA), shadows, calls)
        verdicts = control_verdicts(summary, aa, served)
        md = (summary_markdown(summary) + "\n**The A/A control**\n\n" + summary_markdown(aa) + "\n"
              + verdicts_markdown(verdicts))
    else:
        summary = ab_summary(served, outcomes, arms, shadows, calls)
        md = identical_note(summary) + summary_markdown(summary) + gate_note(shadows, served, arms)
    show_markdown(out, md)
    progress.close()
    stages = {f"{k} (stage)": v for k, v in progress.seconds.items()}
    breakdown = busy_markdown(busy, {**stages, "demo to the report": time.perf_counter() - progress.t0})
    show_markdown(out, "**Where the time went**\n\n" + breakdown)
    run_id = None
    if track:
        run_id, uri = log_ab(summary, cfg.tracking.experiment,
                             {"serve_config": str(serve_config), "data": str(data), "every": every, "first": first,
                              "max_turns": max_turns, "control": control, "full": full, "budget": cfg.budget,
                              "summarizer": cfg.summarizer.mode}, md + "\n" + breakdown,
                             {"ab_aa_summary.json": aa, "ab_controls.json": verdicts} if control else None)
        out.print(f"MLflow: experiment {cfg.tracking.experiment!r}, run {run_id} at {uri}")
    out.print(f"demo finished in {time.perf_counter() - progress.t0:.0f} s (memory {timings['memory_s']:.0f} s, serve "
              f"start {timings['serve_start_s']:.0f} s, traffic {timings['traffic_s']:.0f} s, shadow "
              f"{timings['shadow_s']:.0f} s); everything is shut down")
    timings["total_s"] = time.perf_counter() - progress.t0
    return {"summary": summary, "aa": aa, "verdicts": verdicts, "timings": {**timings, "stages": progress.seconds}, "errors": res.errors, "busy": busy, "run_id": run_id,
            "markdown": md, "breakdown": breakdown}
