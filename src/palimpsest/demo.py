"""`make demo`, the main job end to end on embedded defaults (top layer, beside the command line), sized for the
machine it runs on (2 CPU cores, BENCHMARKS.md "`make demo` on this machine"):

1. prepare the offline models (SmolLM2-135M actor folder and tokenizer, all-MiniLM-L6-v2);
2. train a small REMORY memory network with Ray Train + DeepSpeed if none fitting the actor is registered;
3. start the composed Serve app on 127.0.0.1 (actor on vLLM with prompt embeds, embedder, summarizer,
   memory encoder, ingress), serving `pace` with the registered memory as its dark candidate (`pace+memory`,
   as `palimpsest serve` runs a registered memory: never served until the gate promotes it; `window` when the
   memory was trained at another budget), on a ledger of the run's own;
4. replay 10 trajectories (every dev trajectory that fits the budget, then the extra dev trajectories beside the dev
   file: ``DEMO_SESSIONS``) through the HTTP endpoint as live traffic, one turn per session at step 4, posting each
   session's outcome: on every turn the shadow lane compiles what the candidate would have served for that same turn and
   scores both prompts against the full-history reference over the served reply (the exact KL), off the turn path;
5. print the rollout gate's decision first (promote, withdraw or hold, with its e-values and n; the replica reads
   the gate at every refresh, and the demo reads it once more on every pair of the run), then the pairs, the
   served arm's figures, where the models' time went, and the MLflow run that holds it;
6. shut everything down.

``--control`` runs the controls instead (experiments/controls.py): the weak `last2` against `pace` as users run
it (compaction epochs) and `pace` planned per turn (the positive controls), and `pace` against itself (the A/A
control, its prompts compared by hash), each trajectory once per arm, at budget 4,096 with an 8K reference window,
one turn per session at step 8. ``--full`` is the larger run: two turns per session (steps 4 and 12), LLM
summaries of every step appended; as in the default run, a session ends at its last turn (the steps after it
would be summarised for no turn to read).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console
from rich.markdown import Markdown

from palimpsest.experiments.ab_report import ab_summary, log_ab, summary_markdown
from palimpsest.experiments.controls import (
    AA,
    CONTROL_ARMS,
    CONTROL_SHAPE,
    POSITIVE,
    audit_rows,
    control_verdicts,
    verdicts_markdown,
)
from palimpsest.experiments.gate import decide, decisions_markdown, log_decision, pairs_markdown, status
from palimpsest.experiments.live import drive
from palimpsest.models.assets import minilm_dir, smollm2_dir, smollm2_tokenizer_dir
from palimpsest.models.registry import read_bundle, resolve_memory_ref
from palimpsest.pipelines.trajectories import read_trajectories
from palimpsest.platform import Ledger
from palimpsest.platform.prompt.chat import chat_ids
from palimpsest.platform.prompt.tokens import get_tokenizer
from palimpsest.platform.types import ConfigError, PalimpsestError
from palimpsest.serving.local import LocalServer
from palimpsest.serving.serve_config import ArmConfig, load_serve_config, parse_serve_config
from palimpsest.serving.turn.candidates import judged_candidates
from palimpsest.training.launcher import launch
from palimpsest.training.train_config import load_train_config

DEMO_SERVE = Path("configs/serve/demo.yaml")
DEMO_TRAIN = Path("configs/train/remory_demo.yaml")
MEMORY_ARM = "pace+memory"
CONTROL = "pace"  # the served arm; the demo's candidate is judged on its turns
#: the default run's sessions: every dev trajectory that fits (8 of 10), then the extra ones beside the dev file
#: (``dev_extra.jsonl``). At 8 sessions the gate can withdraw only when almost every session points one way (an
#: e-value reaches at most 53 of the 40 it needs) and cannot promote (80: 9 sessions at least); at 10 both can (170)
DEMO_SESSIONS = 10
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


def fitting(files: list[Path], limit: int | None, budget: int, reply: int) -> tuple[list, list[str]]:
    """The first ``limit`` trajectories of ``files`` (in order) whose prompt prefix (system prompt, task, tools under
    the actor's template) leaves room for history in the budget; the others are named with why (the server would
    refuse their turns)."""
    tok = get_tokenizer(str(smollm2_tokenizer_dir()), None)
    keep, left = [], []
    for tr in (tr for f in files for tr in read_trajectories(f).trajectories):
        if limit is not None and len(keep) >= limit:
            break
        prefix = len(chat_ids(tok, [{"role": "system", "content": (tr.system or "") + (tr.tools or "")},
                                    {"role": "user", "content": tr.task}]).all)
        if prefix + reply + 256 > budget:
            left.append(f"{tr.id}: its system prompt, tools and task take {prefix} tokens of the {budget} budget")
        else:
            keep.append(tr)
    if not keep:
        raise PalimpsestError(f"no trajectory of {', '.join(map(str, files))} fits the budget of {budget} tokens")
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


def candidate_arm(fits: bool) -> ArmConfig:
    """The demo's dark candidate of `pace`: the registered memory when it was trained at the demo's budget, else
    `window` (a policy that differs from `pace` at that budget), so a run always has a decision to show."""
    if fits:
        return ArmConfig(name=MEMORY_ARM, policy={"type": "pace"}, memory=True, candidate_of=CONTROL, stage="dark")
    return ArmConfig(name="window", policy={"type": "window"}, candidate_of=CONTROL, stage="dark")


def decide_candidates(ledger: Ledger, cfg, info: dict, track: bool) -> tuple[list, list[dict]]:
    """(the judged candidates, the gate's answer on each): the rollout gate read once more on every pair of the
    run (the replica reads it at each refresh, and the last pairs may come after its last one), with the function
    the replicas call (``rollouts.decide``: a decision that moves a stage is appended to the ledger, and with
    ``track`` logged to MLflow)."""
    judged, _ = judged_candidates(cfg, info.get("memory") or {}, info.get("prompt_embeds", True))
    results = []
    for c in judged:
        r = decide(ledger, c, cfg.ab.gate_alpha, cfg.ab.gate_margin, cfg.ab.gate_min_pairs, len(judged))
        if track and r.get("recorded") is not None:
            log_decision(r, c, cfg.tracking.experiment)
        results.append({"candidate": c.name, "control": c.control, "subject": c.subject, **r})
    return judged, results


def control_report(ledger: Ledger, served: list[dict], outcomes: list[dict], shadows: list[dict],
                   calls: list[dict]) -> tuple[dict, dict, dict, str]:
    """The controls' two reports from one run (the positive controls, the A/A control) and their verdicts; the
    A/A's served prompts are compared by the audit's prompt hashes, not by their sizes."""
    summary = ab_summary(served, outcomes, list(POSITIVE), shadows, calls)
    aa = ab_summary(served, outcomes, list(AA), shadows, calls)
    sessions = {r["session_id"] for r in served if r["session_id"].endswith(tuple("@" + a for a in AA))}
    verdicts = control_verdicts(summary, aa, served, audit=audit_rows(ledger, sessions))
    md = (summary_markdown(summary) + "\n**The A/A control**\n\n" + summary_markdown(aa) + "\n"
          + verdicts_markdown(verdicts))
    return summary, aa, verdicts, md


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
    cfg = demo_config(serve_config, control, full, budget, window)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    if "://" not in cfg.ledger:  # a ledger of the run's own: no candidate's decision of an earlier run carries over
        path = Path(cfg.ledger)
        cfg = cfg.model_copy(update={"ledger": str(path.with_name(f"{path.stem}-{stamp}{path.suffix}"))})
    progress = Progress(out, stages=6)
    timings: dict[str, float] = {}
    progress.stage("models")
    out.print(f"actor: {smollm2_dir()}\ntokenizer: {smollm2_tokenizer_dir()}\nembedder: {minilm_dir()}")
    progress.stage("memory", expect_s=None if control else 100)
    t0 = time.perf_counter()
    if not control:
        ref = ensure_memory(out, train_config, data)
        fits, why = memory_fits(ref, cfg.budget)
        candidate = candidate_arm(fits)
        if all(a.candidate_of is None for a in cfg.arms):
            cfg = cfg.model_copy(update={"arms": [*cfg.arms, candidate]})
        out.print(f"dark candidate of `{CONTROL}`: `{candidate.name}` ({why})")
    else:
        out.print("the controls: `last2` against `pace` (compaction epochs) and `pace-per-turn`; `pace` against "
                  f"`pace-aa` (A/A); budget {cfg.budget}, reference window {cfg.actor.max_model_len}, no memory arm")
    timings["memory_s"] = time.perf_counter() - t0
    if not any(a.memory for a in cfg.arms):
        cfg = cfg.model_copy(update={"memory": cfg.memory.model_copy(update={"model": None})})
    arms = [a.name for a in cfg.arms if a.candidate_of is None]  # the served arms (candidates are judged dark)
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
        extra = data.with_name("dev_extra.jsonl")
        files = [data, extra] if not (control or full) and extra.is_file() else [data]
        trajs, left_out = fitting(files, limit or (None if control or full else DEMO_SESSIONS), cfg.budget,
                                  cfg.actor.max_tokens)
        for why in left_out:
            out.print(f"  left out: {why}", highlight=False)
        total = len(trajs) * len(arms)
        judging = "" if control else f", `{cfg.arms[-1].name}` judged dark on every turn"
        progress.stage(f"live traffic: {len(trajs)} trajectories x {len(arms)} arms ({', '.join(arms)}{judging}), "
                       f"up to {max_turns} turns each")
        prefix = f"demo-{stamp}/"
        finished: list[str] = []

        def on_session(sid, res):
            finished.append(sid)
            progress.step(len(finished), total, f"sessions ({res.turns} turns, {len(res.errors)} errors; "
                                                f"{sid.removeprefix(prefix)}: next-action F1 "
                                                f"{res.f1.get(sid, float('nan')):.3f})")

        # every session at once by default: vLLM batches their prefills and no core waits for a session's appends
        res = drive(server.url, trajs, prefix=prefix, every=every, first=first, max_turns=max_turns,
                    max_tokens=cfg.actor.max_tokens, concurrency=concurrency or min(total, 16), on_session=on_session,
                    arms=arms, tail=False)
        timings["traffic_s"] = res.wall_s
        out.print(f"{len(res.sessions)} sessions (each trajectory once per arm), {res.turns} turns in "
                  f"{res.wall_s:.0f} s; {len(res.errors)} errors")
        for e in res.errors[:5]:
            out.print(f"  [red]{e}[/]", highlight=False)
        progress.stage("shadow fidelity (exact KL against the reference, off the turn path)")
        t0 = time.perf_counter()
        shadow = wait_shadow(server.url, timeout_s=1800, progress=progress)
        timings["shadow_s"] = time.perf_counter() - t0
        out.print(f"shadow fidelity: {shadow.get('scored', 0)} turns scored, {shadow.get('identical', 0)} identical "
                  f"to their reference, {shadow.get('skipped', 0)} skipped "
                  f"({timings['shadow_s']:.0f} s after the traffic)")
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
    aa = verdicts = decisions = None
    if control:  # two reports from one run: the positive controls, and the A/A control
        summary, aa, verdicts, md = control_report(ledger, served, outcomes, shadows, calls)
    else:  # the decisions first, then their pairs, then the served arm's figures
        judged, decisions = decide_candidates(ledger, cfg, info, track)
        summary = ab_summary(served, outcomes, arms, shadows, calls)
        md = (decisions_markdown(decisions, status(ledger)) + pairs_markdown(ledger, judged)
              + identical_note(summary) + summary_markdown(summary))
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
                             {"ab_aa_summary.json": aa, "ab_controls.json": verdicts} if control
                             else {"rollout_decisions.json": decisions})
        out.print(f"MLflow: experiment {cfg.tracking.experiment!r}, run {run_id} at {uri}")
    out.print(f"demo finished in {time.perf_counter() - progress.t0:.0f} s (memory {timings['memory_s']:.0f} s, serve "
              f"start {timings['serve_start_s']:.0f} s, traffic {timings['traffic_s']:.0f} s, shadow "
              f"{timings['shadow_s']:.0f} s); everything is shut down; the run's ledger: {cfg.ledger}")
    timings["total_s"] = time.perf_counter() - progress.t0
    return {"summary": summary, "aa": aa, "verdicts": verdicts, "decisions": decisions, "ledger": cfg.ledger,
            "timings": {**timings, "stages": progress.seconds}, "errors": res.errors, "busy": busy, "run_id": run_id,
            "markdown": md, "breakdown": breakdown}
