"""`pace_plus`: PACE with the improvements its paper names as open problems (`pace` keeps the paper's formulas).

1. Identifier-aware hybrid scoring. Cosine similarity misses tool-dependency links: the next action
   reuses an id, path or error string an old observation showed. The score adds the overlap of
   identifiers (ids, paths, URLs) between the query (task + recent steps) and each step, and a
   recency prior, before PACE's softmax:

       s_i = cos(q, k_i) + eta * |I_q ∩ I_i| / sqrt(|I_q| |I_i|) + kappa * 2^(-(t-1-i)/h)
       r_i = M * softmax(s_i / tau)                                      (mean 1, as PACE's w~)

2. Budget-optimal allocation instead of fixed thresholds: every old step gets the resolution that
   maximises sum_i v_i * coverage(level_i) subject to sum_i cost_i <= fill * budget, where
   v_i = r_i * (1 + |I_i|)^rho (a step holding more identifiers is likelier to hold the one needed).
   Resolutions are upgraded greedily by value per token along each step's convex hull of (cost, value)
   points, the classic near-optimal solution of a multiple-choice knapsack, vectorised over all steps;
   an upgrade worth less than ``price`` per token is not bought, so the context stays small when
   little is relevant and the budget only binds when much is. ``coverage`` is the expected share of a
   step's later-needed facts each resolution keeps.

The last N steps are always full; missing summaries fall back as in PACE (never waiting).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar, Literal

import numpy as np
from pydantic import Field, field_validator

from palimpsest.platform.policies.base import (
    PolicyConfigBase,
    PolicyDeps,
    QueryLayout,
    fallback_missing,
    new_plan,
    query_relevance,
    query_steps,
    query_text,
    query_texts,
    relative_softmax,
    scored_plan_start,
)
from palimpsest.platform.policies.relevance import RelevanceSection, predicted
from palimpsest.platform.prompt.abstraction import extract_salient
from palimpsest.platform.types import RenderPlan, Resolution

if TYPE_CHECKING:
    from palimpsest.platform.ledger import SessionSnapshot

_LEVELS = (Resolution.DROP, Resolution.PLACEHOLDER, Resolution.BRIEF, Resolution.DETAILED, Resolution.FULL)


#: The dev trajectories ``coverage``, ``fill`` and ``price`` were fitted on (``benchmarks/fit_pace_plus.py``'s fit
#: half, recorded in ``benchmarks/results/dev/pace_plus_fit.json``): eval-actions never scores this policy on them.
FITTED_ON: frozenset[str] = frozenset({
    "mswea-gemini3pro/sympy__sympy-13091", "mswea-gemini3pro/scikit-learn__scikit-learn-12682",
    "smolagents-gpt4o-code/gaia-051941bcd5", "taubench-gpt4o-airline/task3-trial0"})


class PacePlusConfig(PolicyConfigBase):
    """PACE + identifier-aware hybrid scores + knapsack allocation of resolutions."""

    type: Literal["pace_plus"] = "pace_plus"
    name: ClassVar[str] = "pace_plus"
    fitted_on: ClassVar[frozenset[str]] = FITTED_ON  # its constants' fit set: out of every evaluation of it
    recent: int = Field(2, ge=1, le=64, description="N: the most recent steps, always full")
    query: QueryLayout = Field("recent_first", description="query text: recent_first (the last N steps are never "
                               "cut by the embedder's window) or task_first (the paper's order)")
    tau: float = Field(0.3, gt=0.0, le=10.0, description="softmax temperature over the hybrid score")
    eta: float = Field(0.5, ge=0.0, le=10.0, description="weight of identifier overlap in the hybrid score")
    kappa: float = Field(0.3, ge=0.0, le=10.0, description="weight of the recency prior in the hybrid score")
    half_life: float = Field(8.0, gt=0.0, description="h: steps over which the recency prior halves")
    fill: float = Field(1.0, gt=0.0, le=1.0, description="share of the budget the allocation may spend")
    price: float = Field(0.002, ge=0.0, description="an upgrade must add at least this much value per token")
    rho: float = Field(0.5, ge=0.0, le=2.0, description="value grows as (number of identifiers a step holds)^rho")
    # coverage, fill and price are fitted without need labels on half of the dev trajectories
    # (benchmarks/fit_pace_plus.py): coverage is the share of a step's identifiers each rendering keeps;
    # fill and price the cheapest grid point within 0.005 of the best label-free action-identifier recall.
    coverage: tuple[float, float, float, float] = Field(
        (0.182, 0.62, 0.869, 1.0),
        description="expected share of a step's facts kept at placeholder, brief, detailed, full")
    relevance: RelevanceSection | None = Field(None, description="a learned relevance predictor whose probabilities "
                                               "replace the hybrid score (policies.relevance); None: the hybrid")

    @field_validator("coverage")
    @classmethod
    def _monotone(cls, v: tuple[float, float, float, float]) -> tuple[float, float, float, float]:
        if not all(0.0 <= a < b <= 1.0 for a, b in zip(v, v[1:])):
            raise ValueError("coverage must rise strictly from placeholder to full, within [0, 1]")
        return v

    def build(self, deps: PolicyDeps | None = None) -> "PacePlusPolicy":
        return PacePlusPolicy(self, deps or PolicyDeps())


def allocate(costs: np.ndarray, values: np.ndarray, capacity: float, price: float = 0.0) -> np.ndarray:
    """Greedy multiple-choice knapsack over convex hulls.

    costs, values: (M, L) per option, options ordered cheap -> rich, NaN cost = option unavailable;
    option 0 must be available. Returns the chosen option index per row (M,).
    Each row starts at option 0 (here: dropped, shown only inside a range line); upgrades (to the hull point of
    best value per extra token) are taken globally in order of efficiency while the total cost stays within
    ``capacity`` and the upgrade adds at least ``price`` value per token.
    """
    m, n_opt = costs.shape
    choice = np.zeros(m, dtype=np.int64)
    if m == 0:
        return choice
    rows = np.arange(m)
    steps_i, steps_to, steps_dc, steps_eff = [], [], [], []
    cur = np.zeros(m, dtype=np.int64)
    for _ in range(n_opt - 1):  # at most L-1 hull edges per row
        c0, v0 = costs[rows, cur], values[rows, cur]
        dc = costs - c0[:, None]  # (M, L)
        dv = values - v0[:, None]
        with np.errstate(invalid="ignore", divide="ignore"):
            ok = (np.arange(n_opt)[None, :] > cur[:, None]) & ~np.isnan(costs) & (dv > 0)
            eff = np.where(ok, dv / np.maximum(dc, 1e-9), -np.inf)
        eff = np.where(ok & (dc <= 0), np.inf, eff)  # richer and not dearer: always take it
        nxt = eff.argmax(1)
        has = eff[rows, nxt] > -np.inf
        if not has.any():
            break
        r = rows[has]
        steps_i.append(r)
        steps_to.append(nxt[has])
        steps_dc.append(np.maximum(dc[r, nxt[has]], 0.0))
        steps_eff.append(eff[r, nxt[has]])
        cur = np.where(has, nxt, cur)
    if not steps_i:
        return choice
    i_all, to_all = np.concatenate(steps_i), np.concatenate(steps_to)
    dc_all, eff_all = np.concatenate(steps_dc), np.concatenate(steps_eff)
    # Hull edges of one row have decreasing efficiency, so a stable sort keeps each row's edges in order.
    order = np.argsort(-eff_all, kind="stable")
    order = order[eff_all[order] >= price]
    budget_left = capacity - float(costs[:, 0].sum())
    spent = np.cumsum(dc_all[order])
    take = order[spent <= budget_left]
    # Apply in order; a row's later edge implies its earlier ones were taken (prefix of a sorted list).
    for i, to in zip(i_all[take].tolist(), to_all[take].tolist()):
        if to > choice[i]:
            choice[i] = to
    return choice


class PacePlusPolicy:
    name = "pace_plus"

    def __init__(self, cfg: PacePlusConfig, deps: PolicyDeps):
        self.cfg = cfg
        self.deps = deps
        self.config_hash = cfg.config_hash()

    def _query(self, snap: "SessionSnapshot") -> tuple[list[str], frozenset[str]]:
        texts = query_texts(snap.session.task, query_steps(snap, self.cfg.recent, self.cfg.query), self.cfg.query)
        ids, paths, urls, _ = extract_salient("\n".join(texts))
        return texts, frozenset(ids) | frozenset(paths) | frozenset(urls)

    def relevance(self, snap: "SessionSnapshot", old: np.ndarray) -> tuple[np.ndarray, np.ndarray, str]:
        """(r, n_ids, source): relative relevance (mean 1), the number of identifiers each step holds, and what
        scored them. With a relevance predictor found, its probabilities (which read the overlap and the step's age
        themselves) are the score, else the hybrid."""
        index = snap.salient_index()
        n_ids = index.sizes[old].astype(np.float64)
        p, tau, source = predicted(snap, old, self.cfg.relevance, self.deps,
                                   lambda n: query_text(snap, n, "recent_first"))
        if p is not None:
            return relative_softmax(p, tau or self.cfg.tau), n_ids, source
        _, q_ids = self._query(snap)
        cos = query_relevance(snap, self.cfg.recent, self.cfg.query, self.deps.embedder)[old]  # (M,)
        shared = index.overlap(q_ids)[old].astype(np.float64)
        overlap = shared / np.sqrt(np.maximum(n_ids, 1.0) * max(len(q_ids), 1))
        age = (snap.t - 1 - old).astype(np.float64)
        s = cos + self.cfg.eta * overlap + self.cfg.kappa * np.exp2(-age / self.cfg.half_life)
        return relative_softmax(s, self.cfg.tau), n_ids, "hybrid"

    def plan(self, snap: "SessionSnapshot", budget: int) -> RenderPlan:
        m, n = snap.t, self.cfg.recent
        res, score, codes, reasons, recent = scored_plan_start(snap, n, self.deps.embedder, self.name)
        old = np.flatnonzero(snap.has_key[: max(0, m - n)])
        source = "hybrid"
        capacity = self.cfg.fill * budget - snap.prefix_tokens - float(snap.tokens[recent, Resolution.FULL].sum())
        if old.size:
            r, n_ids, source = self.relevance(snap, old)
            score[old] = r
            costs = np.zeros((old.size, len(_LEVELS)))  # (M, 5); dropping costs nothing
            costs[:, 1:] = np.stack([snap.tokens[old, lv] for lv in _LEVELS[1:]], axis=1)
            costs[costs < 0] = np.nan  # summaries not written yet: not an option (PACE's fallback handles them)
            # A step's chance of holding the fact the next action needs grows with what it holds.
            coverage = np.asarray((0.0, *self.cfg.coverage))
            values = (r * (1.0 + n_ids) ** self.cfg.rho)[:, None] * coverage[None, :]
            choice = allocate(costs, values, max(capacity, 0.0), self.cfg.price)
            level = np.array(_LEVELS, dtype=np.int8)[choice]
            res[old] = level
            for lv in _LEVELS:
                codes[old[level == lv]] = reasons(f"knapsack: {lv.label} (value per token)")
        fallback_missing(snap, budget, res, score, codes, reasons, Resolution.PLACEHOLDER)
        return new_plan(self.name, self.config_hash, snap, res, score, codes, reasons, fold_ranges=True,
                        info={"capacity": capacity, "scored": int(old.size), "relevance": source},
                        history=self.cfg.history)
