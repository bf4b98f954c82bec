"""The `palimpsest` command line.

    palimpsest import FILE                      trajectories (JSONL) into the ledger, enriched
    palimpsest render --session ID --policy P --budget N [--at T]
    palimpsest glimpse --session ID STEP_ID     the raw text of one step
    palimpsest audit --session ID               every audited turn of a session
    palimpsest policies                         names and default configs
    palimpsest view                             PACE and ACE side by side on a real trajectory
    palimpsest serve [--config F]               the composed HTTP app (Ray Serve + vLLM) on this machine
    palimpsest ab report                        per-arm A/B comparison with confidence intervals
    palimpsest demo                             the main job: memory, serving, live A/B traffic, report

The ledger is ``--ledger PATH``, else ``$PALIMPSEST_LEDGER``, else ``.palimpsest/ledger.db``.
Every refused input ends with one line on stderr naming the problem and exit status 2.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path
from typing import Optional

import typer
import yaml
from rich.console import Console
from rich.table import Table

from palimpsest.platform import Ledger, Runtime
from palimpsest.platform.budget import Budget
from palimpsest.platform.policies import default_configs, load_policy_file, parse_policy_config
from palimpsest.platform.types import BudgetError, PalimpsestError

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False, help="Palimpsest: compress the view, never the source.")
out = Console()
err = Console(stderr=True)

DEFAULT_LEDGER = ".palimpsest/ledger.db"


def _budget(budget: int, max_tokens: int = 0) -> Budget:
    """``--budget`` and ``--max-tokens`` as one Budget, the error naming the flag."""
    try:
        return Budget(budget, max_tokens)
    except BudgetError as e:
        flag = "--budget" if "token budget" in str(e) else "--max-tokens"
        raise PalimpsestError(f"{flag}: {e}") from None

def shared_dev_file() -> Path:
    """The dev trajectories of the shared folder beside the project ($PALIMPSEST_SHARED overrides)."""
    rel = Path("data") / "trajectories" / "dev.jsonl"
    roots = [os.environ.get("PALIMPSEST_SHARED"), Path.cwd().parent / "shared",
             Path(__file__).resolve().parents[2].parent / "shared"]
    for root in roots:
        if root and (Path(root) / rel).is_file():
            return Path(root) / rel
    return Path.cwd().parent / "shared" / rel


LedgerOpt = typer.Option(None, "--ledger", help="ledger file or postgresql:// URL "
                                                  "(default $PALIMPSEST_LEDGER or .palimpsest/ledger.db)")
EmbedderOpt = typer.Option("minilm", "--embedder", help="key embedder: minilm (all-MiniLM-L6-v2) or hashing")
TokenizerOpt = typer.Option("smollm2", "--tokenizer",
                            help="token counting: smollm2 (the actor's), approx, or a tokenizer.json path")


def _ledger_path(path: Optional[str]) -> str:
    """A ledger file or a database URL (kept as text: a URL is not a path)."""
    return str(path or os.environ.get("PALIMPSEST_LEDGER") or DEFAULT_LEDGER)


def _existing(path: str | Path) -> str:
    """A ledger that must exist already: a file is checked here, a database when it is opened."""
    if "://" not in str(path) and not Path(path).is_file():
        raise PalimpsestError(f"no ledger at {path}; `palimpsest import FILE` creates one")
    return str(path)


@contextlib.contextmanager
def _json_stdout(active: bool):
    """With --json, stdout carries the JSON object and nothing else: whatever libraries print while the work
    runs (DeepSpeed's accelerator notice, progress lines) goes to stderr, at the file-descriptor level."""
    if not active:
        yield
        return
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def _fail(message: str) -> None:
    err.print(f"[bold red]error:[/] {message}", highlight=False)
    sys.exit(2)


def _policy_config(policy: str, config_file: Optional[Path]):
    cfg = load_policy_file(config_file) if config_file else parse_policy_config(policy)
    if cfg.type != policy:
        raise PalimpsestError(f"--policy {policy} does not match the type {cfg.type!r} in {config_file}")
    return cfg


@app.command("import")
def import_cmd(
    file: Path = typer.Argument(..., help="trajectories, one JSON object per line"),
    ledger: Optional[str] = LedgerOpt,
    enrich: bool = typer.Option(True, help="write summaries and keys now (otherwise on first use)"),
    embedder: str = EmbedderOpt,
    tokenizer: str = TokenizerOpt,
) -> None:
    """Import agent trajectories into the ledger (each becomes a session named by its id)."""
    from rich.progress import Progress

    from palimpsest.pipelines.environment import open_runtime
    from palimpsest.pipelines.trajectories import import_file

    if not file.is_file():
        raise PalimpsestError(f"trajectory file not found: {file}")
    rt = open_runtime(_ledger_path(ledger), embedder, tokenizer)
    with rt.ledger as led:
        with Progress(console=err, transient=True) as bar:
            task = bar.add_task("importing", total=None)

            def done(traj) -> None:
                if enrich and led.count(traj.id):
                    rt.enrich(traj.id)
                bar.advance(task)

            report = import_file(led, file, on_trajectory=done)
        table = Table("session", "steps", title=f"imported into {led.path}")
        for sid, n in report.imported:
            table.add_row(sid, str(n))
        out.print(table)
    for e in report.errors:
        err.print(f"[red]refused:[/] {e}", highlight=False)
    if report.errors:
        raise typer.Exit(1 if report.imported else 2)


@app.command()
def render(
    session: str = typer.Option(..., "--session", help="session id"),
    policy: str = typer.Option(..., "--policy", help="policy name (see `palimpsest policies`)"),
    budget: int = typer.Option(..., "--budget", help="token budget of what the actor receives (prompt + max_tokens)"),
    at: Optional[int] = typer.Option(None, "--at", help="compile the context before step T (default: next step)"),
    max_tokens: Optional[int] = typer.Option(None, "--max-tokens",
                                             help="tokens kept for the reply (default: the serve config's actor.max_tokens)"),
    policy_config: Optional[Path] = typer.Option(None, "--policy-config", help="YAML config of the policy"),
    show_prompt: bool = typer.Option(True, "--prompt/--no-prompt", help="print the compiled context"),
    cached_rate: float = typer.Option(0.1, "--cached-rate", min=0.0, max=1.0,
                                      help="price of a cached input token against an uncached one (the cost block)"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object (ids, text, messages, plan) and nothing else"),
    ledger: Optional[str] = LedgerOpt,
    embedder: str = EmbedderOpt,
    tokenizer: str = TokenizerOpt,
) -> None:
    """Compile one turn's prompt exactly as the actor would receive it, and show it with its plan."""
    from palimpsest.pipelines.environment import open_runtime
    from palimpsest.serving.config import ActorConfig

    if at is not None and at < 0:
        raise PalimpsestError(f"--at must be >= 0, got {at}")
    reserve = ActorConfig().max_tokens if max_tokens is None else max_tokens
    limit = _budget(budget, reserve)  # --budget, --max-tokens: checked here, once
    cfg = _policy_config(policy, policy_config)
    rt = open_runtime(_existing(_ledger_path(ledger)), embedder, tokenizer)
    with rt.ledger as led:
        sess = led.session(session)  # unknown session -> a clear error before any work
        rt.enrich(session)
        turn = rt.turn(session, cfg, limit, at=at, record=False)
        if as_json:
            from palimpsest.pipelines.replay import session_cost

            cost = session_cost(rt, session, cfg, limit, turn.t, cached_rate)
    p = turn.prompt
    if as_json:
        spans = {s.t: s for s in p.segments if s.t is not None and s.kind == "step"}
        prefix = sum(1 for s in p.segments if s.kind in ("system", "task"))
        from palimpsest.platform.chat import tool_tokens

        history = p.tokens - p.prefix_tokens
        tools = tool_tokens(rt.ledger.tokenizer, sess)
        print(json.dumps({
            "session": session, "t": turn.t, "policy": turn.plan.policy, "config_hash": turn.plan.config_hash,
            "tokenizer": rt.ledger.tokenizer.name, "budget": budget, "max_tokens": reserve,
            "prompt_token_ids": p.ids, "prompt_text": p.text, "messages": list(p.messages),
            "soft_slot": len(p.context_ids),
            "tokens": {"prompt": p.tokens, "prefix": p.prefix_tokens, "history": history, "tools": tools, "soft": 0,
                       "max_tokens": reserve, "total": p.tokens + reserve},
            "prefix_messages": prefix, "parts": "prompt = prefix + history; prefix is the system message and the task "
                                                 "(tools: what the tool declarations add to it); soft is 0 here: a "
                                                 "memory arm adds its soft positions when serving", "prompt_hash": p.prompt_hash, "prefix_hash": p.prefix_hash,
            "elided": turn.plan.info.get("elided", []),
            "compaction": turn.plan.info.get("compaction"), "epoch": turn.plan.info.get("epoch"),
            "cost": cost,
            "plan": [{"t": e.t, "step_id": e.step_id, "resolution": e.resolution.label, "reason": e.reason,
                      "score": e.score, "messages": list(spans[e.t].messages) if e.t in spans else None}
                     for e in turn.plan.entries()],
        }))
        return
    table = Table("t", "step", "resolution", "score", "reason", title=f"{policy} plan at t={turn.t}")
    for e in turn.plan.entries():
        table.add_row(str(e.t), f"#{e.step_id}", e.resolution.label, f"{e.score:.3g}", e.reason)
    out.print(table)
    if turn.plan.degradations:
        out.print(f"degraded to fit the budget: {len(turn.plan.degradations)} level steps")
    for e in turn.plan.info.get("elided", []):
        out.print(f"step #{e['step_id']} (t={e['t']}, {e['chars']} characters) shown head and tail to fit")
    if show_prompt:
        out.rule("compiled prompt (the actor's ids, decoded)")
        out.print(p.text, markup=False, highlight=False)
    out.print(f"tokens: {p.tokens} + max_tokens {reserve} / budget {budget} (prefix {p.prefix_tokens}); "
              + ", ".join(f"{k} {v}" for k, v in turn.plan.counts().items()))


@app.command()
def glimpse(
    step_id: str = typer.Argument(..., help="the step id a placeholder shows, e.g. 42 or #42"),
    session: str = typer.Option(..., "--session"),
    ledger: Optional[str] = LedgerOpt,
) -> None:
    """Print the raw text of one step of a session (counts against the turn's glimpse limit)."""
    with Ledger(_existing(_ledger_path(ledger))) as led:
        out.print(Runtime(led).glimpse(session, step_id), markup=False, highlight=False)


@app.command()
def audit(session: str = typer.Option(..., "--session"), ledger: Optional[str] = LedgerOpt) -> None:
    """Show every audited turn of a session."""
    with Ledger(_existing(_ledger_path(ledger))) as led:
        rows = led.audit(session)
    table = Table("t", "policy", "config", "budget", "tokens", "prompt hash", "resolutions", "degraded")
    for r in rows:
        table.add_row(str(r["t"]), r["policy"], r["config_hash"], str(r["budget"]), str(r["tokens"]),
                      r["prompt_hash"][:12], " ".join(f"{k}={v}" for k, v in r["counts"].items() if v),
                      str(len(r["degradations"])))
    out.print(table)


@app.command()
def policies() -> None:
    """List the policies and their default configs."""
    for name, cfg in default_configs().items():
        out.rule(name)
        out.print((cfg.__doc__ or "").strip(), highlight=False)
        out.print(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False).rstrip(), markup=False)


def _policy_set(names: str, config_file: Optional[Path]) -> dict:
    """Labels -> configs. A YAML file holds one config (it replaces that type's defaults) or a mapping
    of labels to configs (variants such as `window_k20: {type: window, k: 20}`)."""
    from palimpsest.platform.policies import PolicyConfigBase

    variants: dict[str, PolicyConfigBase] = {}
    if config_file:
        data = yaml.safe_load(config_file.read_text()) if config_file.is_file() else None
        if not isinstance(data, dict):
            raise PalimpsestError(f"{config_file}: expected a policy config or a mapping of labels to configs")
        if "type" in data:
            cfg = load_policy_file(config_file)
            variants[cfg.type] = cfg
        else:
            for label, body in data.items():
                try:
                    variants[str(label)] = parse_policy_config(body)
                except PalimpsestError as e:
                    raise PalimpsestError(f"{config_file}: {label}: {e}") from None
    labels = [n.strip() for n in names.split(",") if n.strip()]
    if not labels:
        raise PalimpsestError("--policy needs at least one policy name")
    if len(set(labels)) != len(labels):
        raise PalimpsestError(f"--policy lists a policy twice: {names}")
    return {label: variants[label] if label in variants else parse_policy_config(label) for label in labels}


# Options the evaluation commands share.
IncludeTrainOpt = typer.Option(False, "--include-train", help="also score trajectories the memory trained on")
MaxTargetOpt = typer.Option(48, "--max-target-tokens", min=1)
WindowOpt = typer.Option(None, "--window", help="the actor's window (default: the serve config's)")
SeedOpt = typer.Option(0, "--seed")
TeacherCacheOpt = typer.Option(None, "--cache", help="teacher cache (Parquet; default .palimpsest/teachers.parquet)")
ReplayLedgerOpt = typer.Option(None, "--ledger", help="cache ledger (default .palimpsest/replay-<tokenizer>.db)")
EvalMlflowOpt = typer.Option(True, "--mlflow/--no-mlflow", help="log the evaluation as an MLflow run")
DeviceOpt = typer.Option("cpu", "--device", help="where the actor and the memory run (cpu, cuda, cuda:1)")


@app.command()
def replay(
    data: Path = typer.Option(..., "--data", help="trajectories (JSONL, the shared schema)"),
    policy: str = typer.Option(..., "--policy", help="comma-separated policy names or labels from --policy-config"),
    budget: int = typer.Option(..., "--budget", help="token budget of every compiled context"),
    out_dir: Path = typer.Option(..., "--out", help="output folder (steps.parquet, summary.json, summary.md)"),
    policy_config: Optional[Path] = typer.Option(None, "--policy-config", help="YAML: one config, or labels -> configs"),
    concat: bool = typer.Option(False, "--concat", help="replay all trajectories as one continuous session"),
    repeat: int = typer.Option(1, "--repeat", min=1, max=1000,
                               help="with --concat: the trajectories N times over, one session N times as long"),
    as_json: bool = typer.Option(False, "--json", help="print the summary JSON to stdout and nothing else"),
    cached_rate: float = typer.Option(0.1, "--cached-rate", min=0.0, max=1.0,
                                      help="price of a cached input token against an uncached one (billed per turn)"),
    max_tokens: Optional[int] = typer.Option(None, "--max-tokens", min=0,
                                             help="tokens each prompt keeps free for the reply (default: the serve "
                                                  "config's actor.max_tokens, as serving reserves it)"),
    ledger: Optional[Path] = ReplayLedgerOpt,
    embedder: str = EmbedderOpt,
    tokenizer: str = TokenizerOpt,
    mlflow: bool = typer.Option(True, "--mlflow/--no-mlflow", help="log the replay as an MLflow run"),
) -> None:
    """Replay trajectories under several policies: need recall, token cost, longevity."""
    import json as _json

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from palimpsest.pipelines.environment import open_runtime
    from palimpsest.pipelines.replay import TimedEmbedder, run_replay, summary_markdown, write_outputs

    if repeat > 1 and not concat:
        raise PalimpsestError("--repeat needs --concat (it repeats the trajectories inside one session)")
    from palimpsest.serving.config import ActorConfig

    reserve = _budget(budget, ActorConfig().max_tokens if max_tokens is None else max_tokens).reply
    policies = _policy_set(policy, policy_config)
    if not data.is_file():
        raise PalimpsestError(f"trajectory file not found: {data}")
    cache = ledger or Path(f".palimpsest/replay-{Path(tokenizer).name}.db")
    rt = open_runtime(cache, embedder, tokenizer, wrap=TimedEmbedder)
    timer = rt.embedder
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=err, transient=True) as bar:
        result = run_replay(rt, data, policies, budget, concat=concat, timer=timer, progress=bar, reserve=reserve,
                            repeat=repeat, cached_rate=cached_rate)
    rt.ledger.close()
    write_outputs(result, out_dir)
    if mlflow:
        from palimpsest.pipelines.tracking import log_replay

        result.summary["mlflow_run_id"] = log_replay(result.summary, out_dir)
        (out_dir / "summary.json").write_text(_json.dumps(result.summary, indent=2) + "\n")
    for s in result.summary["skipped"]:
        err.print(f"[yellow]skipped:[/] {s['trajectory']}: {s['reason']}", highlight=False)
    if as_json:
        sys.stdout.write(_json.dumps(result.summary) + "\n")
    else:
        out.print(summary_markdown(result.summary), markup=False, highlight=False)
        out.print(f"written to {out_dir}")


@app.command()
def report(dirs: list[Path] = typer.Argument(..., help="replay output folders (several budgets plot together)"),
           out_dir: Optional[Path] = typer.Option(None, "--out", help="where to write (default: the first DIR)")) -> None:
    """Write report.md and PNG plots from one or more replay outputs."""
    from palimpsest.pipelines.report import write_report

    path = write_report(dirs, out_dir or dirs[0])
    out.print(f"report written to {path}")


@app.command()
def train(config: Path = typer.Option(..., "--config", help="configs/train/<name>.yaml"),
          track: bool = typer.Option(True, "--mlflow/--no-mlflow", help="log and register in MLflow")) -> None:
    """Train the REMORY memory network on Ray Train + DeepSpeed (resumes a run of the same name)."""
    import json as _json

    from palimpsest.training.config import load_train_config
    from palimpsest.training.launcher import launch

    with _json_stdout(True):  # what Ray, DeepSpeed and the workers print goes to stderr
        summary = launch(load_train_config(config), track=track)
    # plain JSON on stdout: a console would wrap long lines (the checkpoint path) inside strings
    sys.stdout.write(_json.dumps(summary, indent=2, default=str) + "\n")


@app.command("eval-actions")
def eval_actions(
    data: Path = typer.Option(..., "--data", help="trajectories (JSONL, the shared schema)"),
    policy: str = typer.Option(..., "--policy", help="comma-separated policies or labels; NAME+memory adds the "
                                                     "soft memory of --memory to NAME (e.g. pace+memory), "
                                                     "NAME+empty keeps its room but sends no soft span"),
    budget: int = typer.Option(..., "--budget", help="token budget of every student prompt"),
    max_boundaries: Optional[int] = typer.Option(None, "--max-boundaries", min=1, help="a deterministic sample of N"),
    reference: Optional[str] = typer.Option(None, "--reference", help="gap_closed = 1 - KL(policy) / KL(reference) "
                                                                      "(default: pace when listed, else the first)"),
    memory: Optional[str] = typer.Option(None, "--memory", help="memory bundle or MLflow URI for NAME+memory "
                                                                "(default: the latest registered)"),
    policy_config: Optional[Path] = typer.Option(None, "--policy-config", help="YAML: labels -> configs "
                                                                              "(configs/replay/reference.yaml has last2)"),
    include_train: bool = IncludeTrainOpt,
    max_target_tokens: int = MaxTargetOpt,
    window: Optional[int] = WindowOpt,
    seed: int = SeedOpt,
    cache: Optional[Path] = TeacherCacheOpt,
    ledger: Optional[Path] = ReplayLedgerOpt,
    embedder: str = EmbedderOpt,
    tokenizer: str = TokenizerOpt,
    mlflow: bool = EvalMlflowOpt,
    device: str = DeviceOpt,
    as_json: bool = typer.Option(False, "--json", help="print the result JSON to stdout and nothing else"),
) -> None:
    """Action fidelity: KL to the actor given the whole history, NLL of the recorded action, top-1 agreement."""
    import json as _json

    Budget(budget)
    _check_device(device)
    if not data.is_file():
        raise PalimpsestError(f"trajectory file not found: {data}")
    names = [n.strip() for n in policy.split(",") if n.strip()]
    base = {_memory_base(n) for n in names}
    configs = _policy_set(",".join(sorted(base)), policy_config)
    with _json_stdout(as_json):
        out_json, result = _eval_actions_run(
            data, names, configs, budget, memory, include_train, max_target_tokens, window, seed, cache, ledger,
            embedder, tokenizer, mlflow, max_boundaries, reference, device)
    if as_json:
        sys.stdout.write(_json.dumps(out_json) + "\n")
        return
    _actions_table(result)


def _actions_table(result) -> None:
    table = Table("policy", "KL (95% CI)", "NLL", "top-1", "positions", "boundaries", "gap closed")
    for label, p in result.policies.items():
        g = result.gap_closed.get(label)
        table.add_row(label, f"{p['kl']:.4f} ({p['kl_ci'][0]:.4f}-{p['kl_ci'][1]:.4f})", f"{p['nll']:.3f}",
                      f"{p['top1']:.3f}", f"{p['positions']:.0f}", str(p["boundaries"]), "-" if g is None else f"{g:.3f}")
    out.print(table)
    out.print(f"gap closed relative to {result.reference}, on the boundaries each row was scored on")
    for label, p in result.policies.items():
        if p.get("in_sample"):
            out.print(f"{label}: {p['in_sample']} boundaries left out, on trajectories its constants were fitted on")


def _memory_base(label: str) -> str:
    """The text policy of a label: NAME+memory (soft memory at its slot) and NAME+empty (NAME+memory's text,
    no soft span) are NAME underneath."""
    for suffix in ("+memory", "+empty"):
        if label.endswith(suffix):
            return label[: -len(suffix)]
    return label


def _check_device(device: str) -> None:
    """``--device``: a torch device this machine has, else a clear error before any model loads."""
    import torch

    try:
        dev = torch.device(device)
    except RuntimeError as e:
        raise PalimpsestError(f"--device {device!r} is not a device (cpu, cuda, cuda:N): {e}") from e
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise PalimpsestError(f"--device {device!r}: this machine has no CUDA device")
    if dev.type not in ("cpu", "cuda"):
        raise PalimpsestError(f"--device {device!r}: only cpu and cuda are supported")


def _eval_actions_run(data, names, configs, budget, memory, include_train, max_target_tokens, window, seed, cache,
                      ledger, embedder, tokenizer, mlflow, max_boundaries, reference, device="cpu"):
    from palimpsest.models.actor import FrozenActor
    from palimpsest.models.registry import resolve_actor_path
    from palimpsest.pipelines.environment import open_runtime
    from palimpsest.pipelines.replay import prepare_sessions
    from palimpsest.pipelines.trajectories import file_sha256, read_trajectories
    from palimpsest.serving.config import ActorConfig, MemoryConfigServe
    from palimpsest.training.actions import Arm, MemoryArm, TeacherCache, evaluate_actions
    from palimpsest.training.teachers import actor_key

    serve_mem = MemoryConfigServe()
    ref, trained_on = None, None
    mem_tokens, mem_chars = serve_mem.max_history_tokens, serve_mem.max_field_chars
    if any(n != _memory_base(n) for n in names):
        from palimpsest.models.registry import memory_meta, resolve_memory_ref

        ref = resolve_memory_ref(memory or "auto")
        if ref is None:
            raise PalimpsestError("NAME+memory needs a memory model: --memory, or a registered palimpsest-memory")
        meta = memory_meta(ref).get("data") or {}
        if "train_trajectories" in meta:
            trained_on = set(meta["train_trajectories"])
        elif not include_train:
            raise PalimpsestError(f"memory model {ref} records no training split, so its held-out trajectories are "
                                  "unknown: pass --include-train to score every trajectory")
        if meta:
            # Read as the memory was trained to read (serving's memory.* should say the same).
            mem_tokens = int(meta.get("memory_tokens", mem_tokens))
            mem_chars = int(meta.get("max_observation_chars", mem_chars))
    actor_path = str(resolve_actor_path("smollm2" if tokenizer == "smollm2" else tokenizer))
    act = FrozenActor.from_pretrained(actor_path, device=device)
    mem_arm = None
    if ref is not None:
        from palimpsest.models.encoder import MemoryEncoder

        mem_arm = MemoryArm(MemoryEncoder.load(ref, act), mem_tokens, mem_chars)
    arms = [Arm(n, configs[_memory_base(n)], mem_arm if n != _memory_base(n) else None, inject=not n.endswith("+empty"))
            for n in names]

    def allowed(trajectory: str) -> bool:
        return mem_arm is None or include_train or trajectory not in (trained_on or set())

    read = read_trajectories(data)
    from palimpsest.pipelines.replay import TimedEmbedder  # memoised: policies share query embeddings

    rt = open_runtime(ledger or Path(f".palimpsest/replay-{Path(tokenizer).name}.db"), embedder, tokenizer,
                      wrap=TimedEmbedder)
    skipped: list = []
    sessions = prepare_sessions(rt, read.trajectories, False, file_sha256(data), skipped)
    teacher_cache = TeacherCache(cache or Path(".palimpsest/teachers.parquet"))
    ref_label = reference or ("pace" if "pace" in names else names[0])
    if ref_label not in names:
        raise PalimpsestError(f"--reference {ref_label!r} is not among --policy {names}")
    result = evaluate_actions(rt, sessions, arms, budget, act, data_sha=file_sha256(data), actor_key=actor_key(actor_path),
                              window=window or ActorConfig().max_model_len, max_boundaries=max_boundaries,
                              max_target_tokens=max_target_tokens, seed=seed, reference=ref_label,
                              cache=teacher_cache, allowed=allowed,
                              on_progress=lambda sid: err.print(f"scored {sid}", highlight=False))
    rt.ledger.close()
    out_json = result.to_json() | {"budget": budget, "device": str(act.device), "data": {"file": str(data), "sha256": file_sha256(data)},
                                   "teacher_cache": {"hits": teacher_cache.hits, "misses": teacher_cache.misses},
                                   "held_out_only": mem_arm is not None and not include_train,
                                   "skipped": [{"trajectory": s.trajectory, "reason": s.reason} for s in skipped]}
    if mlflow:
        from palimpsest.pipelines.tracking import log_actions

        out_json["mlflow_run_id"] = log_actions(out_json, {k: v.model_dump(mode="json") for k, v in configs.items()})
    return out_json, result


@app.command("eval-memory")
def eval_memory(
    model: str = typer.Option(..., "--model", help="models:/palimpsest-memory/latest, a runs:/ URI, or a checkpoint dir"),
    data: Path = typer.Option(..., "--data", help="trajectories (JSONL, the shared schema)"),
    budget: Optional[int] = typer.Option(None, "--budget", help="token budget of the student prompts (default: the "
                                                                "budget the memory was trained at)"),
    policy: Optional[str] = typer.Option(None, "--policy", help="the text policy under the memory (default: the "
                                                                "one the memory was trained with, else pace)"),
    max_boundaries: Optional[int] = typer.Option(None, "--max-boundaries", min=1, help="a deterministic sample of N"),
    include_train: bool = IncludeTrainOpt,
    max_target_tokens: Optional[int] = typer.Option(None, "--max-target-tokens", min=1,
                                                    help="default: the memory's data.max_target_tokens"),
    window: Optional[int] = WindowOpt,
    seed: int = SeedOpt,
    cache: Optional[Path] = TeacherCacheOpt,
    ledger: Optional[Path] = ReplayLedgerOpt,
    embedder: str = EmbedderOpt,
    tokenizer: str = TokenizerOpt,
    mlflow: bool = EvalMlflowOpt,
    device: str = DeviceOpt,
    as_json: bool = typer.Option(False, "--json", help="print the result JSON to stdout and nothing else"),
) -> None:
    """eval-actions for one memory: POLICY (the memory's positions as text), POLICY+empty (its text alone) and
    POLICY+memory, on held-out trajectories; gap_closed is relative to POLICY."""
    import json as _json

    if budget is not None:
        Budget(budget)
    _check_device(device)
    if not data.is_file():
        raise PalimpsestError(f"trajectory file not found: {data}")
    with _json_stdout(as_json):
        from palimpsest.models.registry import load_memory
        from palimpsest.models.registry import memory_meta, resolve_memory_ref

        ref = resolve_memory_ref(model)
        if ref is None:
            raise PalimpsestError(f"--model {model!r} names no memory model")
        load_memory(ref)  # not a memory model: a clear error before anything else
        meta = memory_meta(ref)
        trained, data_meta = meta.get("policy"), meta.get("data") or {}
        # By default, the student prompts are the ones the memory trained on: its budget and reply length.
        budget = budget if budget is not None else data_meta.get("budget")
        if not isinstance(budget, int):
            raise PalimpsestError(f"{model}: the bundle records no training budget; pass --budget")
        max_target_tokens = max_target_tokens or int(data_meta.get("max_target_tokens", 48))
        if policy is None and isinstance(trained, dict) and isinstance(trained.get("config"), dict):
            from palimpsest.platform.policies import parse_policy_config

            cfg = parse_policy_config(trained["config"])
            base, configs = cfg.type, {cfg.type: cfg}
        else:
            base = policy or "pace"
            configs = _policy_set(base, None)
        names = [base, f"{base}+empty", f"{base}+memory"]
        out_json, result = _eval_actions_run(
            data, names, configs, budget, model, include_train, max_target_tokens, window, seed, cache, ledger,
            embedder, tokenizer, mlflow, max_boundaries, base, device)
    if as_json:
        sys.stdout.write(_json.dumps(out_json) + "\n")
        return
    _actions_table(result)


models_app = typer.Typer(help="Offline model assets.", no_args_is_help=True)
app.add_typer(models_app, name="models")


@models_app.command("prepare")
def models_prepare() -> None:
    """Convert the shipped SmolLM2-135M-Instruct GGUF into a cached HF folder (once; no download)."""
    from palimpsest.models.assets import smollm2_dir, smollm2_tokenizer_dir

    out.print(f"actor: {smollm2_dir()}")
    out.print(f"tokenizer: {smollm2_tokenizer_dir()}")


@app.command()
def view(
    data: Optional[Path] = typer.Option(None, help="trajectories (default: ../shared/data/trajectories/dev.jsonl)"),
    trajectory: Optional[str] = typer.Option(None, help="trajectory id (default: the longest)"),
    budget: int = typer.Option(16000, help="token budget"),
    ledger: Optional[Path] = typer.Option(None, help="ledger file (default: .palimpsest/demo.db)"),
    embedder: str = EmbedderOpt,
    tokenizer: str = TokenizerOpt,
) -> None:
    """Import the dev trajectories and show PACE and ACE side by side on one of them (offline, no server)."""
    from palimpsest.pipelines.demo import run_demo

    path = data or shared_dev_file()
    if not path.is_file():
        raise PalimpsestError(f"no trajectories at {path}; pass --data FILE")
    from palimpsest.pipelines.environment import open_runtime

    Budget(budget)
    run_demo(out, path, trajectory, budget, open_runtime(ledger or Path(".palimpsest/demo.db"), embedder, tokenizer))


@app.command()
def demo(
    data: Optional[Path] = typer.Option(None, help="trajectories (default: ../shared/data/trajectories/dev.jsonl)"),
    config: Path = typer.Option(Path("configs/serve/demo.yaml"), "--config", help="serve config of the live run"),
    train_config: Path = typer.Option(Path("configs/train/remory_demo.yaml"), "--train-config",
                                      help="memory training config used when no memory model is registered"),
    port: int = typer.Option(8000, min=1, max=65535),
    every: int = typer.Option(8, min=1, help="a turn every N steps of each trajectory"),
    first: int = typer.Option(4, min=1, help="the first turn comes after this many steps"),
    max_turns: int = typer.Option(1, min=1, help="turns per session (each trajectory runs once per arm)"),
    concurrency: Optional[int] = typer.Option(None, min=1, max=64, help="sessions driven at once (default: all, "
                                                                       "at most 16)"),
    limit: Optional[int] = typer.Option(None, min=1, help="only the first N trajectories (default: 3; every one "
                                                         "with --control or --full)"),
    control: bool = typer.Option(False, "--control", help="the positive control: `pace` against the weak `last2` "
                                                         "(the report must show a significant difference)"),
    full: bool = typer.Option(False, "--full", help="the larger run: every trajectory, two turns per session from "
                                                   "step 4, LLM summaries of every step appended (BENCHMARKS.md: "
                                                   "its time)"),
) -> None:
    """The main job: models, memory training if needed, the composed app, live A/B traffic, the report."""
    from palimpsest.demo import run_main_demo

    run_main_demo(out, data or shared_dev_file(), config, train_config, port=port, every=every, max_turns=max_turns,
                  concurrency=concurrency, limit=limit, control=control, full=full, first=first)


@app.command()
def serve(
    config: Optional[Path] = typer.Option(None, "--config", help="a ServeConfig YAML or a `serve run` config (default: embedded)"),
    host: str = typer.Option("127.0.0.1", "--host"),
    port: int = typer.Option(8000, "--port", min=1, max=65535),
) -> None:
    """Run the composed app locally until SIGTERM or Ctrl-C (then shut it down cleanly)."""
    import signal
    import threading

    from palimpsest.serving.config import load_serve_config
    from palimpsest.serving.local import LocalServer

    cfg = load_serve_config(config)
    stop = threading.Event()
    server = LocalServer(cfg, host=host, port=port).start()
    # After Ray's start-up: its core worker installs its own SIGTERM handler, which would end the process
    # without shutting Serve down.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        err.print(f"serving at {server.url} (OpenAPI: {server.url}/docs; OpenAI base URL: {server.url}/v1); "
                  f"arms {server.info['arms']}; memory {server.info['memory']['models']['default']['model'] or 'off'}")
        stop.wait()
    finally:
        err.print("shutting down ...")
        server.stop()


ab_app = typer.Typer(help="A/B rollouts of policies and memory models.", no_args_is_help=True)
app.add_typer(ab_app, name="ab")


@ab_app.command("report")
def ab_report(
    ledger: str = typer.Option(".palimpsest/serve-ledger.db", "--ledger", help="the serving ledger (file or URL)"),
    since: float = typer.Option(0.0, "--since", help="only turns served after this unix time"),
    prefix: str = typer.Option("", "--prefix", help="only sessions whose id starts with this"),
    arms: Optional[str] = typer.Option(None, "--arms", help="comma-separated arms, control first (default: all)"),
    as_json: bool = typer.Option(False, "--json", help="print the summary as JSON only"),
    track: bool = typer.Option(False, "--mlflow/--no-mlflow", help="also log the comparison as an MLflow run"),
    experiment: str = typer.Option("palimpsest-ab", "--experiment"),
) -> None:
    """Per-arm comparison with 95% intervals: outcomes, shadow fidelity, tokens, latency by stage, prefix-cache hit
    rate, glimpses, errors; the smallest difference detectable at 80% power, and the paired comparison of
    trajectories run once per arm (sessions named ID@ARM)."""
    import json as _json

    from palimpsest.pipelines.ab import ab_summary, log_ab, summary_markdown

    with Ledger(_existing(ledger)) as led:
        served = [r for r in led.served(since) if r["session_id"].startswith(prefix)]
        outcomes = [o for o in led.outcomes(since) if o["session_id"].startswith(prefix)]
        shadows = [r for r in led.shadows(since) if r["session_id"].startswith(prefix)]
    summary = ab_summary(served, outcomes, [a.strip() for a in arms.split(",")] if arms else None, shadows)
    md = summary_markdown(summary)
    if track:
        run_id, uri = log_ab(summary, experiment, {"ledger": str(ledger), "since": since, "prefix": prefix}, md)
        summary["mlflow"] = {"run_id": run_id, "tracking_uri": uri}
    if as_json:
        print(_json.dumps(summary, default=float))
        return
    out.print(md, markup=False, highlight=False)
    if track:
        out.print(f"MLflow run {summary['mlflow']['run_id']} at {summary['mlflow']['tracking_uri']}")


def main() -> None:
    try:
        rc = app(standalone_mode=False)  # returns the exit code of typer.Exit instead of raising
    except PalimpsestError as e:
        _fail(str(e))
    except typer.Exit as e:
        sys.exit(e.exit_code)
    except (typer.Abort, KeyboardInterrupt):
        sys.exit(130)
    except Exception as e:  # click usage errors carry their own message and exit code
        import click

        if isinstance(e, click.ClickException):
            e.show()
            sys.exit(e.exit_code)
        raise
    sys.exit(rc if isinstance(rc, int) else 0)


if __name__ == "__main__":
    main()
