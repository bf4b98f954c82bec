"""`palimpsest report DIR...`: markdown and PNG plots from replay outputs.

Plots: compiled tokens per step by policy (with the budget line); strong need recall against token
ratio, one point per policy and budget (pass several replay folders to add budgets); strong need
recall by distance to the needed observation.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from palimpsest.evaluation.replay import DISTANCES, summary_markdown
from palimpsest.pipelines.replay_sessions import ReplayError


def _load(d: Path) -> tuple[dict, "object"]:
    import pyarrow.parquet as pq

    if not (d / "summary.json").is_file() or not (d / "steps.parquet").is_file():
        raise ReplayError(f"{d} is not a replay output (summary.json and steps.parquet expected)")
    return json.loads((d / "summary.json").read_text()), pq.read_table(d / "steps.parquet").to_pandas()


def write_report(dirs: list[Path], out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [(d, *_load(d)) for d in dirs]
    out.mkdir(parents=True, exist_ok=True)
    colors = {}

    def color(name: str):
        if name not in colors:
            colors[name] = plt.get_cmap("tab10")(len(colors) % 10)
        return colors[name]

    # 1. compiled tokens per step, first replay folder (mean over trajectories at each step index)
    d0, s0, df0 = runs[0]
    fig, ax = plt.subplots(figsize=(9, 4.8))
    key = "session_t" if s0.get("concat") else "t"
    for name, g in df0[df0["skipped"].isna()].groupby("policy", sort=False):
        series = g.groupby(key)["tokens"].mean()
        ax.plot(series.index, series.values, label=name, color=color(name), lw=1.4)
    full = df0[df0["policy"] == df0["policy"].iloc[0]].groupby(key)["full_tokens"].mean()
    ax.plot(full.index, full.values, label="full history (unbudgeted)", color="black", lw=1, ls=":")
    ax.axhline(s0["budget"], color="red", lw=1, ls="--", label=f"budget {s0['budget']}")
    ax.set_xlabel("step" + (" (concatenated session)" if s0.get("concat") else " index t (mean over trajectories)"))
    ax.set_ylabel("compiled context tokens")
    ax.set_yscale("log")
    ax.set_title(f"Compiled tokens per step — {Path(s0['data']['file']).name}")
    ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    fig.savefig(out / "tokens_per_step.png", dpi=120)
    plt.close(fig)

    # 2. recall vs token ratio, one point per policy and budget (colour = policy, marker = budget)
    from matplotlib.lines import Line2D

    fig, ax = plt.subplots(figsize=(7.5, 5))
    markers = "osD^vP*X"
    budgets = sorted({s["budget"] for _, s, _ in runs})
    lowest = 1.0
    for d, s, _ in runs:
        for name, m in s["policies"].items():
            if m["token_ratio"] is None or m["need_recall_strong"] is None:
                continue
            lowest = min(lowest, m["need_recall_strong"])
            ax.scatter(m["token_ratio"], m["need_recall_strong"], color=color(name), s=55, edgecolor="black",
                       linewidth=0.5, marker=markers[budgets.index(s["budget"]) % len(markers)])
    handles = [Line2D([], [], color=c, marker="o", ls="", label=n) for n, c in colors.items()]
    handles += [Line2D([], [], color="gray", marker=markers[i % len(markers)], ls="", label=f"budget {b}")
                for i, b in enumerate(budgets)]
    ax.legend(handles=handles, fontsize=8, loc="lower right")
    ax.set_xlabel("token ratio (compiled / full history, mean over steps)")
    ax.set_ylabel("strong need recall")
    ax.set_xlim(0, 1.05)
    ax.set_ylim(max(0.0, lowest - 0.05), 1.01)
    ax.grid(alpha=0.3)
    ax.set_title("Need recall against token cost (up and left is better)")
    fig.tight_layout()
    fig.savefig(out / "recall_vs_ratio.png", dpi=120)
    plt.close(fig)

    # 3. recall against what a turn is billed (uncached + r x cached against the previous turn's ids)
    fig, ax = plt.subplots(figsize=(7.5, 5))
    plotted = 0
    for d, s, _ in runs:
        for name, m in s["policies"].items():
            if m.get("billed_per_turn") is None or m["need_recall_strong"] is None:
                continue
            plotted += 1
            ax.scatter(m["billed_per_turn"], m["need_recall_strong"], color=color(name), s=55, edgecolor="black",
                       linewidth=0.5, marker=markers[budgets.index(s["budget"]) % len(markers)])
            ax.annotate(name, (m["billed_per_turn"], m["need_recall_strong"]), fontsize=7, xytext=(3, 3),
                        textcoords="offset points")
    ax.legend(handles=handles, fontsize=8, loc="lower right")
    rate = s0.get("cached_rate", 0.1)
    ax.set_xlabel(f"billed ids per turn (uncached + {rate:g} x cached, 16-token blocks)")
    ax.set_ylabel("strong need recall")
    ax.grid(alpha=0.3)
    ax.set_title("Need recall against what a turn is billed (up and left is better)")
    fig.tight_layout()
    if plotted:
        fig.savefig(out / "recall_vs_billed.png", dpi=120)
    plt.close(fig)

    # 4. recall by distance, first replay folder
    fig, ax = plt.subplots(figsize=(8, 4.5))
    names = list(s0["policies"])
    width = 0.8 / max(1, len(names))
    x = np.arange(len(DISTANCES))
    for i, name in enumerate(names):
        vals = [s0["policies"][name]["recall_by_distance"][k] or 0 for k, _, _ in DISTANCES]
        ax.bar(x + i * width - 0.4 + width / 2, vals, width, label=name, color=color(name))
    ax.set_xticks(x, [f"{k} steps back" for k, _, _ in DISTANCES])
    ax.set_ylabel("strong need recall")
    ax.set_ylim(0, 1.2)
    ax.set_yticks(np.linspace(0, 1, 6))
    ax.set_title(f"Recall by distance to the needed observation — budget {s0['budget']}")
    ax.legend(fontsize=8, ncol=min(6, len(names)), loc="upper center")
    fig.tight_layout()
    fig.savefig(out / "recall_by_distance.png", dpi=120)
    plt.close(fig)

    parts = ["# Replay report", ""]
    for d, s, _ in runs:
        parts += [summary_markdown(s).replace("# Replay:", "## Replay:"), f"(from `{d}`)", ""]
    parts += ["## Plots", "", "![compiled tokens per step](tokens_per_step.png)", "",
              "![need recall against token ratio](recall_vs_ratio.png)", "",
              *(["![need recall against billed ids per turn](recall_vs_billed.png)", ""] if plotted else []),
              "![recall by distance](recall_by_distance.png)", ""]
    path = out / "report.md"
    path.write_text("\n".join(parts))
    return path
