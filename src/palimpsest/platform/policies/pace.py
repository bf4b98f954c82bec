"""`pace`: Predictive Adaptive Context Extraction: the paper's formulas and parameters.

Per turn (all numpy over the cached key matrix, O(M)):

    q_t   = Enc(query text)                                        recent steps first by default (below)
    s_i   = cos(q_t, k_i)                                          keys: a head+tail view of the full text
    w_i   = softmax(s_i / tau);  w~_i = M · w_i                    mean 1 over the M old steps
    P_t   = max(min(t / T_max, 1), |C_{t-1}| / B_max)              pressure (length term capped: methods.md)
    (α, β, γ) = (0.4, 0.8, 1.5) · (1 + λ · P_t)
    w~ > γ: full;  β < w~ ≤ γ: detailed;  α < w~ ≤ β: brief;  else placeholder

The last N steps are planned full (only the latest is pinned against the budget). A summary that is not
written yet falls back to full if the budget allows, else to placeholder, without waiting. B_max defaults
to the turn's budget (the paper runs with a 128K budget and B_max = 128K); T_max is a config default (the
paper: the 95th percentile of task length). Every departure from the paper, with its reason, is listed in
docs/methods.md (the query layout, the key view, the hard budget, ...).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar, Literal

import numpy as np
from pydantic import Field, model_validator

from palimpsest.platform.policies.base import (
    PolicyConfigBase,
    PolicyDeps,
    QueryLayout,
    fallback_missing,
    new_plan,
    query_relevance,
    query_text,
    relative_softmax,
    scored_plan_start,
)
from palimpsest.platform.policies.relevance import RelevanceSection, predicted
from palimpsest.platform.types import RenderPlan, Resolution

if TYPE_CHECKING:
    from palimpsest.platform.ledger import SessionSnapshot


class PaceConfig(PolicyConfigBase):
    """PACE: the paper's formulas and parameters (the query layout is listed in docs/methods.md)."""

    type: Literal["pace"] = "pace"
    name: ClassVar[str] = "pace"
    recent: int = Field(2, ge=1, le=64, description="N: the most recent steps, always full")
    query: QueryLayout = Field("recent_first", description="query text: recent_first (the last N steps are never "
                               "cut by the embedder's window), task_first (the paper's order) or epoch (the task, "
                               "each of the last 8 steps and their identifiers, a step scored by its best cosine)")
    tau: float = Field(0.3, gt=0.0, le=10.0, description="softmax temperature over cosine scores")
    alpha: float = Field(0.4, gt=0.0, description="brief threshold on the relative weight M*w")
    beta: float = Field(0.8, gt=0.0, description="detailed threshold")
    gamma: float = Field(1.5, gt=0.0, description="full threshold")
    lam: float = Field(0.5, ge=0.0, le=10.0, description="lambda: how strongly pressure raises the thresholds")
    t_max: int = Field(150, ge=1, description="T_max in steps (the paper: the 95th percentile of task length; "
                                              "set per deployment)")
    b_max: int | None = Field(None, ge=1, description="B_max in tokens; None = the turn's budget")
    length_pressure_max: float | None = Field(
        1.0, gt=0.0, description="the most the length term t/T_max adds to pressure (None: unbounded, the paper). "
        "Old history's cost is bounded by the fold, so past T_max the budget term |C|/B_max measures pressure")
    relevance: RelevanceSection | None = Field(None, description="a learned relevance predictor scoring old steps "
                                               "in place of the cosine (platform.policies.relevance); None: the cosine")

    @model_validator(mode="after")
    def _ordered(self) -> "PaceConfig":
        if not self.alpha < self.beta < self.gamma:
            raise ValueError(f"thresholds must satisfy alpha < beta < gamma, got {self.alpha}, {self.beta}, "
                             f"{self.gamma}")
        return self

    def build(self, deps: PolicyDeps | None = None) -> "PacePolicy":
        return PacePolicy(self, deps or PolicyDeps())


class PacePolicy:
    name = "pace"

    def __init__(self, cfg: PaceConfig, deps: PolicyDeps):
        self.cfg = cfg
        self.deps = deps
        self.config_hash = cfg.config_hash()

    def pressure(self, snap: "SessionSnapshot", budget: int) -> float:
        b_max = self.cfg.b_max or budget
        last = snap.last_context_tokens.get(self.name, 0)
        length = snap.t / self.cfg.t_max
        if self.cfg.length_pressure_max is not None:
            length = min(length, self.cfg.length_pressure_max)
        return max(length, last / b_max)

    def thresholds(self, pressure: float) -> tuple[float, float, float]:
        scale = 1.0 + self.cfg.lam * pressure
        return self.cfg.alpha * scale, self.cfg.beta * scale, self.cfg.gamma * scale

    def query_text(self, snap: "SessionSnapshot") -> str:
        return query_text(snap, self.cfg.recent, self.cfg.query)

    def relative_weights(self, snap: "SessionSnapshot", old: np.ndarray) -> np.ndarray:
        """w~ = M · softmax(cos(q, k) / tau) over the old steps that have a key (with a ``relevance`` predictor
        found, its probabilities in place of the cosine)."""
        return self.weighted(snap, old)[0]

    def weighted(self, snap: "SessionSnapshot", old: np.ndarray) -> tuple[np.ndarray, str]:
        """(w~, what scored the steps: the predictor's reference or "cosine")."""
        s, tau, source = predicted(snap, old, self.cfg.relevance, self.deps,
                                   lambda n: query_text(snap, n, "recent_first"))
        if s is None:
            s = query_relevance(snap, self.cfg.recent, self.cfg.query, self.deps.embedder)[old]  # (M,) cosine
        return relative_softmax(s, tau or self.cfg.tau), source

    def plan(self, snap: "SessionSnapshot", budget: int) -> RenderPlan:
        m, n = snap.t, self.cfg.recent
        res, score, codes, reasons, _ = scored_plan_start(snap, n, self.deps.embedder, self.name)

        p = self.pressure(snap, budget)
        alpha, beta, gamma = self.thresholds(p)
        old = np.flatnonzero(snap.has_key[: max(0, m - n)])
        source = "cosine"
        if old.size:
            wt, source = self.weighted(snap, old)
            score[old] = wt
            level = np.full(old.size, Resolution.PLACEHOLDER, dtype=np.int8)
            level[wt > alpha] = Resolution.BRIEF
            level[wt > beta] = Resolution.DETAILED
            level[wt > gamma] = Resolution.FULL
            res[old] = level
            names = {Resolution.FULL: f"w~ > gamma={gamma:.3f}",
                     Resolution.DETAILED: f"beta={beta:.3f} < w~ <= gamma",
                     Resolution.BRIEF: f"alpha={alpha:.3f} < w~ <= beta",
                     Resolution.PLACEHOLDER: f"w~ <= alpha={alpha:.3f}"}
            for r, text in names.items():
                codes[old[level == r]] = reasons(text)
        fallback_missing(snap, budget, res, score, codes, reasons, Resolution.PLACEHOLDER)
        return new_plan(self.name, self.config_hash, snap, res, score, codes, reasons,
                        info={"pressure": p, "thresholds": [alpha, beta, gamma], "scored": int(old.size),
                              "relevance": source},
                        history=self.cfg.history)
