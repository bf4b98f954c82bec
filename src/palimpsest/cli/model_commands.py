"""The memory network: training, the evaluations of actions and memory, the offline assets."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.table import Table

from palimpsest.cli.common import (
    DeviceOpt,
    EmbedderOpt,
    EvalMlflowOpt,
    IncludeTrainOpt,
    MaxTargetOpt,
    ReplayLedgerOpt,
    SeedOpt,
    TeacherCacheOpt,
    TokenizerOpt,
    WindowOpt,
    _json_stdout,
    err,
    out,
    print_json,
)
from palimpsest.cli.replay_commands import _policy_set
from palimpsest.models.assets import smollm2_dir, smollm2_tokenizer_dir
from palimpsest.models.registry import load_memory, read_bundle, resolve_actor_path, resolve_memory_ref
from palimpsest.pipelines.environment import open_runtime
from palimpsest.pipelines.replay_sessions import TimedEmbedder, prepare_sessions
from palimpsest.pipelines.tracking import log_actions
from palimpsest.pipelines.trajectories import file_sha256, files_sha256, read_files, read_trajectories
from palimpsest.platform.compile.budget import Budget
from palimpsest.platform.policies import (
    parse_policy_config,
)
from palimpsest.platform.prompt.tokens import get_tokenizer
from palimpsest.platform.types import PalimpsestError
from palimpsest.serving.serve_config import ActorConfig
from palimpsest.training.launcher import launch
from palimpsest.training.train_config import load_train_config


def train(config: Path = typer.Option(..., "--config", help="configs/train/<name>.yaml"),
          track: bool = typer.Option(True, "--mlflow/--no-mlflow", help="log and register in MLflow")) -> None:
    """Train the REMORY memory network on Ray Train + DeepSpeed (resumes a run of the same name)."""

    with _json_stdout(True):  # what Ray, DeepSpeed and the workers print goes to stderr
        summary = launch(load_train_config(config), track=track)
    # plain JSON on stdout: a console would wrap long lines (the checkpoint path) inside strings
    print_json(summary, indent=2, default=str)


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
    policy_config: Optional[Path] = typer.Option(None, "--policy-config",
                                                 help="YAML: labels -> configs "
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
        print_json(out_json)
        return
    _actions_table(result)


def _actions_table(result) -> None:
    table = Table("policy", "KL (95% CI)", "NLL", "top-1", "positions", "boundaries", "gap closed")
    for label, p in result.policies.items():
        g = result.gap_closed.get(label)
        table.add_row(label, f"{p['kl']:.4f} ({p['kl_ci'][0]:.4f}-{p['kl_ci'][1]:.4f})", f"{p['nll']:.3f}",
                      f"{p['top1']:.3f}", f"{p['positions']:.0f}", str(p["boundaries"]),
                      "-" if g is None else f"{g:.3f}")
    out.print(table)
    out.print(f"gap closed relative to {result.reference}, on the boundaries each row was scored on")
    for label, p in result.policies.items():  # an epoch policy's boundary and append turns, apart
        kinds = p.get("by_turn") or {}
        if len(kinds) > 1 or "boundary" in kinds:
            out.print(f"{label} by served turn: " + "; ".join(
                f"{k} {v['boundaries']}: KL {v['kl']:.4f}, top-1 {v['top1']:.3f}, {v['positions']:.0f} positions"
                for k, v in kinds.items()), highlight=False)
    for label, p in result.policies.items():
        if p.get("in_sample"):
            out.print(f"{label}: {p['in_sample']} boundaries left out, on trajectories its constants were fitted on")


def _memory_base(label: str) -> str:
    """The text policy of a label: NAME+memory (soft memory at its slot), NAME+empty (NAME+memory's text, no soft
    span) and NAME+other (another trajectory's memory in the slot) are NAME underneath."""
    for suffix in ("+memory", "+empty", "+other"):
        if label.endswith(suffix):
            return label[: -len(suffix)]
    return label


def _memory_model(model: str):
    """``--model`` as (its reference, its bundle record): not a memory model, or a bundle of an old architecture,
    is a clear error before anything else loads."""
    ref = resolve_memory_ref(model)
    if ref is None:
        raise PalimpsestError(f"--model {model!r} names no memory model")
    return ref, read_bundle(ref)


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
                      ledger, embedder, tokenizer, mlflow, max_boundaries, reference, device="cpu", paired_base=None):
    """``paired_base``: NAME of eval-memory's rows, whose NAME+memory is tested against each control (the result's
    ``paired``, logged with the run)."""
    # deferred: loads torch
    from palimpsest.evaluation.actions import Arm, TeacherCache, evaluate_actions, memory_arm, paired_against
    from palimpsest.models.actor import FrozenActor
    from palimpsest.training.teachers import actor_key

    ref, trained_on = None, None
    if any(n != _memory_base(n) for n in names):
        ref = resolve_memory_ref(memory or "auto")
        if ref is None:
            raise PalimpsestError("NAME+memory needs a memory model: --memory, or a registered palimpsest-memory")
        bundle = read_bundle(ref)
        trained_on = bundle.train_trajectories
        if trained_on is None and not include_train:
            raise PalimpsestError(f"memory model {ref} records no training split, so its held-out trajectories are "
                                  "unknown: pass --include-train to score every trajectory")
    actor_path = str(resolve_actor_path("smollm2" if tokenizer == "smollm2" else tokenizer))
    act = FrozenActor.from_pretrained(actor_path, device=device)
    # read as the memory was trained to read: its bundle says what (MemoryBundle.read), as serving reads it
    mem_arm = None if ref is None else memory_arm(ref, act)
    arms = [Arm(n, configs[_memory_base(n)], mem_arm if n != _memory_base(n) else None, inject=not n.endswith("+empty"),
                donor=n.endswith("+other")) for n in names]

    def allowed(trajectory: str) -> bool:
        return mem_arm is None or include_train or trajectory not in (trained_on or set())

    files = [data] if isinstance(data, Path) else list(data)
    read = read_files(files)
    data_sha = files_sha256(files)

    rt = open_runtime(ledger or Path(f".palimpsest/replay-{Path(tokenizer).name}.db"), embedder, tokenizer,
                      wrap=TimedEmbedder)
    skipped: list = []
    sessions = prepare_sessions(rt, read.trajectories, False, data_sha, skipped)
    teacher_cache = TeacherCache(cache or Path(".palimpsest/teachers.parquet"))
    ref_label = reference or ("pace" if "pace" in names else names[0])
    if ref_label not in names:
        raise PalimpsestError(f"--reference {ref_label!r} is not among --policy {names}")
    result = evaluate_actions(rt, sessions, arms, budget, act, data_sha=data_sha,
                              actor_key=actor_key(actor_path),
                              window=window or ActorConfig().max_model_len, max_boundaries=max_boundaries,
                              max_target_tokens=max_target_tokens, seed=seed, reference=ref_label,
                              cache=teacher_cache, allowed=allowed,
                              on_progress=lambda sid: err.print(f"scored {sid}", highlight=False))
    rt.ledger.close()
    out_json = result.to_json() | {"budget": budget, "device": str(act.device),
                                   "data": {"file": ", ".join(map(str, files)), "sha256": data_sha,
                                            **({"files": {str(f): file_sha256(f) for f in files}}
                                               if len(files) > 1 else {})},
                                   "teacher_cache": {"hits": teacher_cache.hits, "misses": teacher_cache.misses},
                                   "held_out_only": mem_arm is not None and not include_train,
                                   "skipped": [{"trajectory": s.trajectory, "reason": s.reason} for s in skipped]}
    if paired_base is not None:
        # the primary comparison, named before the run: the memory's KL against each control, per trajectory
        controls = [paired_base, f"{paired_base}+empty", f"{paired_base}+other"]
        out_json["paired"] = {"arm": f"{paired_base}+memory", "metric": "kl",
                              "controls": paired_against(result.boundaries, f"{paired_base}+memory", controls,
                                                         seed=seed)}
    if mlflow:
        out_json["mlflow_run_id"] = log_actions(out_json, {k: v.model_dump(mode="json") for k, v in configs.items()})
    return out_json, result


def eval_memory(
    model: str = typer.Option(..., "--model",
                              help="models:/palimpsest-memory/latest, a runs:/ URI, or a checkpoint dir"),
    data: list[Path] = typer.Option(..., "--data", help="trajectories (JSONL, the shared schema); repeat it to score "
                                    "several files' held-out trajectories together (ids disjoint)"),
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
    """eval-actions for one memory: POLICY (the memory's positions as text), POLICY+empty (its text alone),
    POLICY+memory and POLICY+other (another trajectory's memory in the same slot: a memory that ignores its input
    scores as well there), on held-out trajectories; gap_closed is relative to POLICY."""

    if budget is not None:
        Budget(budget)
    _check_device(device)
    for f in data:
        if not f.is_file():
            raise PalimpsestError(f"trajectory file not found: {f}")
    with _json_stdout(as_json):

        ref, bundle = _memory_model(model)
        trained = bundle.policy
        # By default, the student prompts are the ones the memory trained on: its budget and reply length.
        budget = budget if budget is not None else bundle.budget
        if not isinstance(budget, int):
            raise PalimpsestError(f"{model}: the bundle records no training budget; pass --budget")
        max_target_tokens = max_target_tokens or bundle.max_target_tokens or 48
        if policy is None and isinstance(trained, dict) and isinstance(trained.get("config"), dict):

            cfg = parse_policy_config(trained["config"])
            base, configs = cfg.type, {cfg.type: cfg}
        else:
            base = policy or "pace"
            configs = _policy_set(base, None)
        names = [base, f"{base}+empty", f"{base}+memory", f"{base}+other"]
        out_json, result = _eval_actions_run(
            data, names, configs, budget, model, include_train, max_target_tokens, window, seed, cache, ledger,
            embedder, tokenizer, mlflow, max_boundaries, base, device, paired_base=base)
        paired = out_json["paired"]["controls"]
    if as_json:
        print_json(out_json)
        return
    _actions_table(result)
    for control, t in paired.items():
        left = f"{t['identical']} identical by construction left out"
        if not t["n"]:  # nothing left to compare: no mean, no p-value
            out.print(f"{base}+memory - {control}: no pair differs ({left}): {t['verdict']}", highlight=False)
            continue
        out.print(f"{base}+memory - {control}: {t['mean']:+.4f} over {t['n']} trajectories ({t['boundaries']} "
                  f"boundaries, {left}), p {t['p']:.3g} at {t['alpha']:.4f}: {t['verdict']}", highlight=False)


def eval_reconstruction(
    model: str = typer.Option(..., "--model", help="models:/palimpsest-memory/latest, a runs:/ URI, or a bundle dir"),
    data: Path = typer.Option(..., "--data", help="trajectories (JSONL): the spans come from their actions and "
                                                 "observations"),
    spans: int = typer.Option(64, "--spans", min=2, help="spans scored (a seeded sample)"),
    tokens: int = typer.Option(64, "--tokens", min=8, max=4096, help="ids per span"),
    exact_tokens: int = typer.Option(32, "--exact-tokens", min=1, help="exact: the first N tokens come back greedily"),
    split: str = typer.Option("held-out", "--split", help="held-out: trajectories the memory did not train on; "
                              "train: only those it trained on (is it overfitting?); all: every one"),
    include_train: bool = typer.Option(False, "--include-train", help="the same as --split all"),
    seed: int = SeedOpt,
    device: str = DeviceOpt,
    as_json: bool = typer.Option(False, "--json", help="print the result JSON to stdout and nothing else"),
) -> None:
    """Does the memory carry its input? Spans of FILE's trajectories (none the memory trained on, unless --split
    says otherwise), each scored teacher-forced with no memory, with its own memory, and with another span's:
    NLL per token and accuracy, and the share of spans whose first tokens the actor writes back greedily."""

    _check_device(device)
    if split not in ("held-out", "train", "all"):
        raise typer.BadParameter(f"{split!r} is not one of held-out, train, all", param_hint="--split")
    if include_train:
        if split == "train":
            raise typer.BadParameter("--include-train (every trajectory) contradicts --split train",
                                     param_hint="--split")
        split = "all"
    if not data.is_file():
        raise PalimpsestError(f"trajectory file not found: {data}")
    with _json_stdout(as_json):
        ref, bundle = _memory_model(model)
        trained_on = bundle.train_trajectories
        if trained_on is None and split != "all":
            raise PalimpsestError(f"memory model {ref} records no training split, so its {split} trajectories are "
                                  "unknown: pass --split all to use every trajectory")
        # deferred: loads torch
        from palimpsest.evaluation.reconstruction import as_tensors, evaluate, trajectory_spans
        from palimpsest.models.actor import FrozenActor

        actor_path = resolve_actor_path(bundle.actor.get("path") or "smollm2")
        actor = FrozenActor.from_pretrained(actor_path, device=device, dtype=bundle.actor.get("dtype") or "float32")
        net = load_memory(ref, actor)
        skip = (None if split == "all" else set(trained_on) if split == "held-out"  # the file read once more for
                else {t.id for t in read_trajectories(data).trajectories} - set(trained_on))  # train only
        picked = trajectory_spans(data, get_tokenizer(str(actor_path)), tokens, spans, seed, skip=skip)
        if len(picked) < 2:
            where = {"all": "", "held-out": " outside the memory's training data",
                     "train": " in the memory's training data"}[split]
            raise PalimpsestError(f"{data}: fewer than 2 spans of {tokens} ids{where}")
        doc = evaluate(actor, net, as_tensors(picked, actor.device), exact_tokens,
                       groups=[p["trajectory"] for p in picked])
        doc |= {"model": ref, "architecture": bundle.architecture,
                "data": {"file": str(data), "sha256": file_sha256(data)},
                "trajectories": len({p["trajectory"] for p in picked}), "split": split,
                "held_out_only": split == "held-out", "seed": seed}
    if as_json:
        print_json(doc)
        return
    table = Table(title=f"reconstruction of {doc['spans']} spans of {tokens} ids "
                        f"({doc['slots_per_span']:.0f} soft tokens each), {ref}")
    for c in ("memory", "NLL / token", "accuracy", f"exact (first {doc['own']['exact_tokens']})"):
        table.add_column(c)
    table.add_row("none", f"{doc['none']['nll']:.3f}", f"{doc['none']['acc']:.3f}", "")
    table.add_row("own", f"{doc['own']['nll']:.3f}", f"{doc['own']['acc']:.3f}", f"{doc['own']['exact']:.2f}")
    if doc["other"]["nll"] is None:
        table.add_row("another trajectory's", doc["other"]["skipped"], "", "")
    else:
        table.add_row("another trajectory's", f"{doc['other']['nll']:.3f}", f"{doc['other']['acc']:.3f}", "")
    out.print(table)
    for name, d in doc["differences"].items():
        out.print(f"{name.replace('_minus_', ' - ')}: {d['value']:+.3f} nats per token, 95% interval "
                  f"[{d['ci95'][0]:+.3f}, {d['ci95'][1]:+.3f}] ({d['resamples']} resamples of the spans)")


def models_prepare() -> None:
    """Convert the shipped SmolLM2-135M-Instruct GGUF into a cached HF folder (once; no download)."""
    out.print(f"actor: {smollm2_dir()}")
    out.print(f"tokenizer: {smollm2_tokenizer_dir()}")
