"""Compaction epochs against per-turn planning: recall beside what a turn really costs, for every policy.

    python benchmarks/compaction_epochs.py                         # ../shared dev split, 8K and 16K
    python benchmarks/compaction_epochs.py --data FILE --budgets 16384 --out benchmarks/results/epochs

Every policy runs twice in one replay per budget: in compaction epochs (`compaction.mode: epochs`, the
prompt rebuilt only past the high watermark, append-only between) and planning every turn anew
(`per_turn`, the seeds' behaviour), beside the `full` and `last2` reference rows. Cost per turn is measured
on the prompt's exact ids against the previous turn's: a prefix cache (vLLM's, 16-token blocks) holds their
common prefix; billed = uncached + r x cached (r = --cached-rate, 0.1 by default). Each reserves 128 tokens
for the reply, as serving does. Writes the summary per budget, `epochs.md` (the tables) and
`cost_recall.png` (recall against billed cost) under --out.

The watermarks are the configs' defaults (high 0.9, low 0.6): chosen before measuring, not fitted on dev.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from replay_dev import RESERVE, default_data, runtime  # noqa: E402

from palimpsest.evaluation.replay import run_replay, write_outputs  # noqa: E402
from palimpsest.platform.policies import parse_policy_config  # noqa: E402

POLICIES = ["window", "rolling_summary", "pace", "ace", "pace_plus"]
# last2 is the floor by definition: only the two previous steps, on every turn (it never grows between boundaries)
REFERENCE = {"full": {"type": "full"}, "last2": {"type": "window", "k": 2, "compaction": {"mode": "per_turn"}}}


def configs(keeps: list[float] | None = None, layouts: list[str] | None = None) -> dict:
    """The reference rows, then each policy in epochs (the defaults) and per turn; with ``keeps``, each epoch
    policy again at each share of the kept prefix (``compaction.keep``); with ``layouts``, pace and pace_plus
    again in epochs at each query layout (``query``: what a boundary's plan asks for)."""
    out = {name: parse_policy_config(cfg) for name, cfg in REFERENCE.items()}
    for name in POLICIES:
        out[name] = parse_policy_config({"type": name, "compaction": {"mode": "epochs"}})
        out[f"{name}@per_turn"] = parse_policy_config({"type": name, "compaction": {"mode": "per_turn"}})
        for k in keeps or []:
            out[f"{name}@keep{k:g}"] = parse_policy_config({"type": name, "compaction": {"keep": k}})
        if name in ("pace", "pace_plus"):
            for q in layouts or []:
                out[f"{name}@{q}"] = parse_policy_config({"type": name, "query": q, "compaction": {"mode": "epochs"}})
    return out


#: The watermark sweep (--sweep): every (high, low) pair with low < high at the default keep, then every keep at
#: the default watermarks. The default (high 0.9, low 0.6, keep 0.5) is one of the points.
SWEEP_HIGH = (0.8, 0.9, 0.95)
SWEEP_LOW = (0.4, 0.5, 0.6, 0.7)
SWEEP_KEEP = (0.0, 0.25, 0.5, 0.75)
SWEEP_POLICIES = ("window", "pace", "ace")
DEFAULT = (0.9, 0.6, 0.5)


def _f(x, fmt: str = ".3f") -> str:
    """A figure, or '-' where the replay had none (a window or a half without such needs)."""
    return "-" if x is None else format(x, fmt)


def sweep_points() -> list[tuple[float, float, float]]:
    pts = [(h, lo, DEFAULT[2]) for h in SWEEP_HIGH for lo in SWEEP_LOW if lo < h]
    pts += [(DEFAULT[0], DEFAULT[1], k) for k in SWEEP_KEEP if (DEFAULT[0], DEFAULT[1], k) not in pts]
    return pts


def sweep_name(policy: str, point: tuple[float, float, float]) -> str:
    return f"{policy}@h{point[0]:g}/l{point[1]:g}/k{point[2]:g}"


def sweep_configs() -> dict:
    """The reference rows, then each swept policy in epochs at every point of ``sweep_points``."""
    out = {name: parse_policy_config(cfg) for name, cfg in REFERENCE.items()}
    for name in SWEEP_POLICIES:
        for h, lo, k in sweep_points():
            out[sweep_name(name, (h, lo, k))] = parse_policy_config(
                {"type": name, "compaction": {"mode": "epochs", "high": h, "low": lo, "keep": k}})
    return out


#: The long session (--repeat N): these policies in epochs, and `window` at several k to find the one at
#: pace's mean prompt ids (the token-matched row). `full` is left out: at thousands of steps its prompt is the
#: whole session on every turn (billed is reported in ids, not as a multiple of full).
LONG_POLICIES = ("window", "rolling_summary", "pace", "ace", "pace_plus")
LONG_WINDOW_K = (32, 64, 128, 256)


def long_configs() -> dict:
    out = {"last2": parse_policy_config(REFERENCE["last2"])}
    for name in LONG_POLICIES:
        out[name] = parse_policy_config({"type": name, "compaction": {"mode": "epochs"}})
    for k in LONG_WINDOW_K:
        out[f"window@k{k}"] = parse_policy_config({"type": "window", "k": k, "compaction": {"mode": "epochs"}})
    return out


def long_table(summary: dict) -> str:
    """Per policy: recall, far recall, recall 1-4 steps back (whole session and worst window), the worst
    window, windows below `window`, mean ids, billed; then the window row closest to pace's mean ids."""
    pols = summary["policies"]
    base = [w["need_recall_strong"] for w in pols["window"]["recall_by_window"]]

    def near(m):
        vals = [w["recall_1-4"] for w in m["recall_by_window"] if w.get("recall_1-4") is not None]
        return min(vals) if vals else None

    def wins_of(m):
        return [w["need_recall_strong"] for w in m["recall_by_window"]]

    matched = min((n for n in pols if n.startswith("window@k")),
                  key=lambda n: abs((pols[n]["mean_tokens"] or 0) - (pols["pace"]["mean_tokens"] or 0)))
    lines = [f"Budget {summary['budget']} (reserve {summary['max_tokens']}), one session of {summary['data']['steps']} "
             f"steps; billed = uncached + {summary['cached_rate']:g} x cached; `{matched}` is the window row at "
             "pace's mean ids", "",
             "| policy | strong | far | 1-4 back | 1-4 back, worst window | worst window | windows below `window` | "
             "mean ids | uncached/turn | billed/turn | compactions/100 |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, m in pols.items():
        wins = wins_of(m)
        below = sum(1 for a, b in zip(wins, base) if a is not None and b is not None and a < b)
        low = min((w for w in wins if w is not None), default=None)
        rbd = m.get("recall_by_distance", {})
        lines.append(f"| {name} | {m['need_recall_strong']} | {m['need_recall_far']} | {rbd.get('1-4')} | {near(m)} | "
                     f"{_f(low, '.2f')} | {below} of {len(wins)} | {_f(m['mean_tokens'], ',.0f')} | "
                     f"{_f(m['uncached_per_turn'], ',.0f')} | {_f(m['billed_per_turn'], ',.0f')} | "
                     f"{m['compactions_per_100']} |")
    return "\n".join(lines + lost_table(pols, ids=False)) + "\n"


def frontier(points: list[tuple[float, float]]) -> list[int]:
    """Indices of the points (billed, recall) no other point beats on both (less billed, at least the recall, or
    the same billed and more recall)."""
    return [i for i, (b, r) in enumerate(points)
            if not any((b2 <= b and r2 >= r) and (b2 < b or r2 > r) for b2, r2 in points)]


def choose(summaries: list[dict]) -> tuple[tuple[float, float, float], dict]:
    """The rule, fixed before any sweep was read: the point whose far recall summed over SWEEP_POLICIES and the
    budgets is highest among those whose billed input, summed the same way, is at most the default's.
    Applied to the fit half only; the report half shows what it gives."""
    def total(p, key):  # a figure the replay had none of (no far needs in a half) counts 0 for every point
        return sum(x["policies"][sweep_name(n, p)][key] or 0.0 for x in summaries for n in SWEEP_POLICIES)

    cap = total(DEFAULT, "billed_per_turn")
    ok = [p for p in sweep_points() if total(p, "billed_per_turn") <= cap]
    best = max(ok, key=lambda p: (total(p, "need_recall_far"), -total(p, "billed_per_turn")))
    return best, {"far_sum": total(best, "need_recall_far"), "billed_sum": total(best, "billed_per_turn"),
                  "default_far_sum": total(DEFAULT, "need_recall_far"), "default_billed_sum": cap}


def sweep_report(summaries: list[dict], out: Path, stem: str = "sweep") -> str:
    """The sweep's table per budget (far recall and billed per point, the frontier marked) and its plot."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    text = []
    fig, axes = plt.subplots(1, len(summaries), figsize=(6.5 * len(summaries), 5), squeeze=False)
    for ax, summary in zip(axes[0], summaries):
        pols = summary["policies"]
        full_billed = pols["full"]["billed_per_turn"] or 1.0
        text += [f"Budget {summary['budget']}: far recall / strong recall / billed per turn (x full); * on the "
                 "policy's frontier (no point of the same policy is cheaper and at least as good on far recall)",
                 "", "| point (high/low/keep) | " + " | ".join(SWEEP_POLICIES) + " |",
                 "|---|" + "---|" * len(SWEEP_POLICIES)]
        fronts = {}
        for name in SWEEP_POLICIES:
            pts = sweep_points()
            xy = [(pols[sweep_name(name, p)]["billed_per_turn"] or 0.0,
                   pols[sweep_name(name, p)]["need_recall_far"] or 0.0) for p in pts]
            fronts[name] = set(frontier(xy))
            line = sorted((xy[i] for i in fronts[name]))
            ax.plot([b for b, _ in line], [r for _, r in line], "-", alpha=0.5)
            ax.scatter([b for b, _ in xy], [r for _, r in xy], s=14, label=name)
            d = xy[pts.index(DEFAULT)]
            ax.scatter([d[0]], [d[1]], s=90, facecolors="none", edgecolors="black")
        for k, p in enumerate(sweep_points()):
            cells = []
            for name in SWEEP_POLICIES:
                m = pols[sweep_name(name, p)]
                star = "*" if k in fronts[name] else ""
                cells.append(f"{_f(m['need_recall_far'])}{star} / {_f(m['need_recall_strong'])} / "
                             f"{_f(m['billed_per_turn'], ',.0f')} ({(m['billed_per_turn'] or 0) / full_billed:.2f})")
            label = f"{p[0]:g}/{p[1]:g}/{p[2]:g}" + (" (default)" if p == DEFAULT else "")
            text.append(f"| {label} | " + " | ".join(cells) + " |")
        for ref in REFERENCE:
            m = pols[ref]
            text.append(f"| {ref} | {_f(m['need_recall_far'])} / {_f(m['need_recall_strong'])} / "
                        f"{_f(m['billed_per_turn'], ',.0f')} ({(m['billed_per_turn'] or 0) / full_billed:.2f}) |"
                        + " |" * (len(SWEEP_POLICIES) - 1))
        text.append("")
        ax.set_xlabel("billed ids per turn (uncached + 0.1 x cached)")
        ax.set_ylabel("far need recall")
        ax.set_title(f"budget {summary['budget']}: watermark sweep (circle: the default)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / f"{stem}_frontier.png", dpi=110)
    return "\n".join(text)


def halves(data: Path) -> dict[str, Path]:
    """The file's trajectories split in two by position (even: fit, odd: report), written to a temporary
    folder (the data stays where it is published)."""
    import tempfile

    lines = [x for x in data.read_text().splitlines() if x.strip()]
    out = Path(tempfile.mkdtemp(prefix="epochs-halves-"))
    files = {}
    for name, part in (("fit", lines[0::2]), ("report", lines[1::2])):
        files[name] = out / f"{name}.jsonl"
        files[name].write_text("\n".join(part) + "\n")
    return files


COLUMNS = ("need_recall_strong", "need_recall_far", "mean_tokens", "prefix_reuse", "uncached_per_turn",
           "billed_per_turn", "compactions_per_100")


def table(summary: dict) -> str:
    pols = summary["policies"]
    full_billed = pols["full"]["billed_per_turn"] or 1.0
    lines = [f"Budget {summary['budget']} (reserve {summary['max_tokens']}), {summary['data']['trajectories']} "
             f"trajectories, {summary['data']['steps']} turns; billed = uncached + {summary['cached_rate']:g} x cached",
             "", "| policy | strong recall | far recall | mean prompt ids | prefix kept | uncached/turn | billed/turn "
             "(x full) | compactions/100 |", "|---|---|---|---|---|---|---|---|"]
    for name, m in pols.items():
        cells = [m[c] for c in COLUMNS]
        billed = f"{cells[5]:,.0f} ({cells[5] / full_billed:.2f})"
        lines.append(f"| {name} | {cells[0]} | {cells[1]} | {cells[2]:,.0f} | {cells[3]} | {cells[4]:,.0f} | "
                     f"{billed} | {cells[6]} |")
    lines += ["", "Lost far needs by the resolution their source step got (ids spent on those steps)."]
    if summary.get("concat"):
        lines += ["", "One session: strong recall per 250-step window; longevity = steps until a window's recall "
                  "1-4 steps back falls below 0.95:", "", "| policy | windows | longevity |", "|---|---|---|"]
        for name, m in pols.items():
            wins = " ".join(str(w["need_recall_strong"]) for w in m["recall_by_window"])
            lines.append(f"| {name} | {wins} | {m['longevity_steps']} |")
    return "\n".join(lines + lost_table(pols)) + "\n"


def lost_table(pols: dict, ids: bool = True) -> list[str]:
    """Lost far needs per policy by the resolution their source step got (and the ids spent on those steps)."""
    out = ["", "| policy | far needs | lost | full | detailed | brief | placeholder | hidden |"
           + (" ids on their sources |" if ids else ""), "|---|---|---|---|---|---|---|---|" + ("---|" if ids else "")]
    for name, m in pols.items():
        lost = m["far_lost"]
        out.append(f"| {name} | {m['far_needs']} | {sum(lost.values())} | {lost['full']} | {lost['detailed']} | "
                   f"{lost['brief']} | {lost['placeholder']} | {lost['drop']} |"
                   + (f" {m['far_lost_ids']:,} |" if ids else ""))
    return out


def plot(summaries: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(summaries), figsize=(6.5 * len(summaries), 5), squeeze=False)
    for ax, summary in zip(axes[0], summaries):
        for name, m in summary["policies"].items():
            per_turn = name.endswith("@per_turn")
            ax.scatter(m["billed_per_turn"], m["need_recall_strong"], marker="x" if per_turn else "o",
                       color="grey" if name in REFERENCE else ("tab:red" if per_turn else "tab:blue"))
            ax.annotate(name, (m["billed_per_turn"], m["need_recall_strong"]), fontsize=7,
                        xytext=(3, 3), textcoords="offset points")
        ax.set_xlabel(f"billed ids per turn (uncached + {summary['cached_rate']:g} x cached)")
        ax.set_ylabel("strong need recall")
        ax.set_title(f"budget {summary['budget']}: epochs (o) vs per turn (x)")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, default=default_data())
    ap.add_argument("--budgets", default="8192,16384")
    ap.add_argument("--cached-rate", type=float, default=0.1)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/epochs"))
    ap.add_argument("--ledger", type=Path, default=Path(".palimpsest/replay-smollm2.db"))
    ap.add_argument("--keep", default="", help="comma-separated shares of the kept prefix to add as rows "
                    "(e.g. 0,0.25,0.5); with --halves, measured on each half of the file")
    ap.add_argument("--query", default="", help="comma-separated query layouts to add as pace / pace_plus rows "
                    "(e.g. epoch,task_first)")
    ap.add_argument("--concat", action="store_true", help="the whole file as one session (per-window recall, "
                    "longevity: steps until a window's recall 1-4 steps back falls below 0.95)")
    ap.add_argument("--halves", action="store_true", help="replay the even (fit) and odd (report) trajectories "
                    "apart: choose on one, report the other")
    ap.add_argument("--sweep", action="store_true", help="the watermark sweep: window, pace and ace in epochs at "
                    "every (high, low) and keep of SWEEP_*, per budget; writes sweep.md, sweep.json and "
                    "sweep_frontier.png (far recall against billed, the default circled)")
    ap.add_argument("--repeat", type=int, default=0, help="the long session: the file N times over as one session "
                    "(e.g. 6 at --budgets 32768), LONG_POLICIES in epochs and window at LONG_WINDOW_K; writes "
                    "long.md and long.json")
    args = ap.parse_args()
    if args.sweep and args.repeat:
        ap.error("--sweep and --repeat are separate runs")
    if (args.sweep or args.repeat) and (args.keep or args.query or args.concat):
        ap.error("--keep, --query and --concat add rows to the default run, not to --sweep or --repeat")
    if args.repeat and args.halves:
        ap.error("--repeat is one session of the whole file: no --halves")
    if not args.data.is_file():
        sys.exit(f"no trajectories at {args.data}; pass --data FILE")
    rt, timer = runtime(args.ledger)
    if args.repeat:
        text, summaries = [], []
        for budget in [int(b) for b in args.budgets.split(",")]:
            t0 = time.perf_counter()
            res = run_replay(rt, args.data, long_configs(), budget, timer=timer, reserve=RESERVE,
                             cached_rate=args.cached_rate, concat=True, repeat=args.repeat)
            write_outputs(res, args.out / f"long{args.repeat}-b{budget}")
            res.summary["seconds"] = round(time.perf_counter() - t0, 1)
            summaries.append(res.summary)
            text.append(long_table(res.summary))
            print(text[-1], flush=True)
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "long.md").write_text("\n".join(text))
        (args.out / "long.json").write_text(json.dumps(summaries, indent=2) + "\n")
        print(f"written to {args.out}")
        return
    if args.sweep:
        parts = halves(args.data) if args.halves else {"all": args.data}
        by_part: dict[str, list[dict]] = {}
        for part, data in parts.items():
            for budget in [int(b) for b in args.budgets.split(",")]:
                t0 = time.perf_counter()
                res = run_replay(rt, data, sweep_configs(), budget, timer=timer, reserve=RESERVE,
                                 cached_rate=args.cached_rate)
                stem = "sweep" if part == "all" else f"sweep-{part}"
                write_outputs(res, args.out / f"{stem}-b{budget}")
                res.summary["seconds"] = round(time.perf_counter() - t0, 1)
                res.summary["part"] = part
                by_part.setdefault(part, []).append(res.summary)
                print(f"{part}, budget {budget}: {res.summary['seconds']} s", flush=True)
        args.out.mkdir(parents=True, exist_ok=True)
        text = []
        for part, summaries in by_part.items():
            stem = "sweep" if part == "all" else f"sweep-{part}"
            text.append(("" if part == "all" else f"**{part} half**\n\n") + sweep_report(summaries, args.out, stem))
        if args.halves:
            point, detail = choose(by_part["fit"])
            report = {"fit": detail, "report": dict(zip(("far_sum", "billed_sum"), (
                sum(x["policies"][sweep_name(n, point)][k] for x in by_part["report"] for n in SWEEP_POLICIES)
                for k in ("need_recall_far", "billed_per_turn")))) | {
                "default_far_sum": sum(x["policies"][sweep_name(n, DEFAULT)]["need_recall_far"]
                                       for x in by_part["report"] for n in SWEEP_POLICIES),
                "default_billed_sum": sum(x["policies"][sweep_name(n, DEFAULT)]["billed_per_turn"]
                                          for x in by_part["report"] for n in SWEEP_POLICIES)}}
            text.append(f"Chosen on the fit half (choose()): high/low/keep {point}; {json.dumps(report)}")
            by_part["choice"] = [{"point": point, **report}]
        (args.out / "sweep.md").write_text("\n".join(text) + "\n")
        (args.out / "sweep.json").write_text(json.dumps(by_part, indent=2) + "\n")
        print("\n".join(text))
        print(f"written to {args.out}")
        return
    keeps = [float(k) for k in args.keep.split(",") if k.strip()]
    parts = halves(args.data) if args.halves else {"all": args.data}
    summaries, text = [], []
    for part, data in parts.items():
        for budget in [int(b) for b in args.budgets.split(",")]:
            t0 = time.perf_counter()
            layouts = [q for q in args.query.split(",") if q.strip()]
            res = run_replay(rt, data, configs(keeps, layouts), budget, timer=timer, reserve=RESERVE,
                             cached_rate=args.cached_rate, concat=args.concat)
            name = ("concat-" if args.concat else "") + (f"b{budget}" if part == "all" else f"{part}-b{budget}")
            write_outputs(res, args.out / name)
            res.summary["seconds"] = round(time.perf_counter() - t0, 1)
            res.summary["part"] = part
            summaries.append(res.summary)
            text.append(("" if part == "all" else f"**{part} half** — ") + table(res.summary))
            print(text[-1], flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = "epochs-concat" if args.concat else "epochs"
    (args.out / f"{stem}.md").write_text("\n".join(text))
    (args.out / f"{stem}.json").write_text(json.dumps(summaries, indent=2) + "\n")
    if args.concat:
        print(f"written to {args.out}")
        return
    plot([x for x in summaries if x["part"] in ("all", "report")], args.out / "cost_recall.png")
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
