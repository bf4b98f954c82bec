"""Each arm's fidelity against its cost, as a figure logged to MLflow beside the A/B report."""

from __future__ import annotations

from typing import Any

from palimpsest.platform.ledger.experiments import REFERENCE_KINDS as KINDS


def fidelity_cost_points(summary: dict) -> list[dict[str, Any]]:
    """Per arm and reference kind with scored turns: billed input ids per turn, every model call included (mean:
    turns, LLM summaries, the LLM elasticizer), and fidelity KL (session mean, its 95% interval). An arm with no
    scored turn against a kind, or whose turns' cost is unknown, has no point for it."""
    points = []
    for arm, a in summary["arms"].items():
        billed = (a.get("cost") or {}).get("total", a["metrics"]["billed"]["mean"])  # every model call included
        for kind in KINDS:
            kl = a["fidelity"]["by_reference"][kind]["kl"]
            if kl["n"] and billed == billed:
                points.append({"arm": arm, "kind": kind, "billed": billed, "kl": kl["mean"], "lo": kl["lo"],
                               "hi": kl["hi"], "sessions": kl["n"]})
    return points


def fidelity_cost_figure(summary: dict):
    """A matplotlib figure (Agg, no display): x billed ids per turn, y fidelity KL (lower is closer to the
    reference), one marker per reference kind, the interval as a bar; None when no arm has a point."""
    points = fidelity_cost_points(summary)
    if not points:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for kind, marker in zip(KINDS, ("o", "s")):
        mine = [p for p in points if p["kind"] == kind]
        if not mine:
            continue
        ax.errorbar([p["billed"] for p in mine], [p["kl"] for p in mine],
                    yerr=[[max(0.0, p["kl"] - p["lo"]) if p["lo"] == p["lo"] else 0.0 for p in mine],
                          [max(0.0, p["hi"] - p["kl"]) if p["hi"] == p["hi"] else 0.0 for p in mine]],
                    fmt=marker, capsize=3, label=f"vs `{kind}`")
        for p in mine:
            ax.annotate(p["arm"], (p["billed"], p["kl"]), textcoords="offset points", xytext=(5, 4), fontsize=8)
    ax.set_xlabel("billed input ids per turn (uncached + cached at the cached rate; summary calls included)")
    ax.set_ylabel("fidelity KL, non-identical turns (session mean)")
    ax.set_title("fidelity against cost per arm (lower left is better)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def close_figure(fig) -> None:
    """Release a figure made here (pyplot keeps every open figure until it is closed)."""
    import matplotlib.pyplot as plt

    plt.close(fig)


__all__ = ["close_figure", "fidelity_cost_figure", "fidelity_cost_points"]
