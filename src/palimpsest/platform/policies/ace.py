"""`ace`: the Adaptive Context Elasticizer. The latest step is always raw; an elasticizer reads the
task and every older step's structured abstraction and renders each one raw, abstract or drop.

Drop is not deletion: the ledger keeps the raw step and ``glimpse`` restores it. The elasticizer is
a small protocol so an LLM elasticizer (served with the actor) can replace the deterministic rule
one shipped here; both return the same columns.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Literal, Protocol

import numpy as np
from pydantic import Field

from palimpsest.platform.policies.base import (
    PolicyConfigBase,
    PolicyDeps,
    Reasons,
    fallback_missing,
    new_plan,
)
from palimpsest.platform.prompt.abstraction import extract_salient
from palimpsest.platform.types import ConfigError, RenderPlan, Resolution

if TYPE_CHECKING:
    from palimpsest.platform.ledger import SessionSnapshot

RAW, ABSTRACT, DROP = 0, 1, 2
_TO_RESOLUTION = {RAW: Resolution.FULL, ABSTRACT: Resolution.DETAILED}


@dataclass(frozen=True)
class ElasticDecision:
    """Per old step: RAW / ABSTRACT / DROP, a reason index, and a score (higher = keep longer)."""

    decision: np.ndarray  # (M,) int8
    reason_code: np.ndarray  # (M,) int16 into reasons
    reasons: list[str]
    score: np.ndarray  # (M,) float64


class Elasticizer(Protocol):
    name: str

    def decide(self, snap: "SessionSnapshot", old: np.ndarray) -> ElasticDecision:
        """Decide for the steps ``old`` (indices into the snapshot; all have an abstraction)."""
        ...


class RuleElasticizer:
    """Identifier, path or URL overlap with the task and the latest step -> raw; failures and
    decisions -> abstract; the rest -> drop."""

    name = "rule-elasticizer-v1"

    def __init__(self, raw_min_overlap: int = 2, abstract_recent: int = 3):
        self.raw_min_overlap = raw_min_overlap
        self.abstract_recent = abstract_recent

    def decide(self, snap: "SessionSnapshot", old: np.ndarray) -> ElasticDecision:
        m = snap.t
        latest = snap.body(m - 1, Resolution.FULL) if m else ""
        ids, paths, urls, _ = extract_salient(snap.session.task + "\n" + (latest or ""))
        index = snap.salient_index()
        overlap = index.overlap(frozenset(ids) | frozenset(paths) | frozenset(urls))[old]  # (M,)
        reasons = Reasons()
        # Rules in increasing priority: later assignments win.
        decision = np.full(old.size, DROP, dtype=np.int8)
        codes = np.full(old.size, reasons("no overlap with the task or the latest step"), dtype=np.int16)
        rules = [
            (old >= m - 1 - self.abstract_recent, ABSTRACT, f"within the last {self.abstract_recent + 1} steps"),
            (overlap >= 1, ABSTRACT, "shares an identifier with the task/latest step"),
            (index.dialogue[old] | index.plans[old], ABSTRACT, "a decision or a plan"),
            (index.failed[old], ABSTRACT, "a failure: keep what failed and why"),
            (overlap >= self.raw_min_overlap, RAW,
             f"shares >= {self.raw_min_overlap} identifiers with the task/latest step"),
        ]
        for mask, what, why in rules:
            decision[mask] = what
            codes[mask] = reasons(why)
        score = overlap + (old + 1) / (m + 1)  # ties broken by recency
        return ElasticDecision(decision, codes, reasons.items, score.astype(np.float64))


_LLM_DECISIONS = {"raw": RAW, "abstract": ABSTRACT, "summary": ABSTRACT, "drop": DROP}


def elastic_prompt(task: str, latest: str, candidate: str) -> list[dict]:
    return [{"role": "system", "content": "You manage an agent's context. Decide how an earlier step must be shown "
                                          "for the agent's next action. Answer with one word: RAW (needed verbatim), "
                                          "ABSTRACT (a summary is enough) or DROP (not needed)."},
            {"role": "user", "content": f"TASK:\n{task[:1500]}\n\nLATEST STEP:\n{latest[:2000]}\n\n"
                                        f"EARLIER STEP (summary):\n{candidate[:1500]}\n\nDecision:"}]


class LLMElasticizer:
    """The served actor judges the most recent ``window`` old steps (RAW / ABSTRACT / DROP) from their
    structured abstraction, the task and the latest step; older steps and every unusable reply keep the
    rule elasticizer's decision, so a slow or silly model can only refine, never break, a plan."""

    def __init__(self, chat, fallback: RuleElasticizer, window: int = 16):
        self.chat = chat
        self.fallback = fallback
        self.window = window
        self.name = f"llm-elasticizer(window={window}, fallback={fallback.name})"

    def decide(self, snap: "SessionSnapshot", old: np.ndarray) -> ElasticDecision:
        base = self.fallback.decide(snap, old)
        judged = old[-self.window:]
        if not judged.size:
            return base
        latest = snap.body(snap.t - 1, Resolution.FULL) or ""
        prompts = [elastic_prompt(snap.session.task, latest, snap.body(int(i), Resolution.DETAILED) or "")
                   for i in judged]
        replies = self.chat(prompts)
        decision, codes = base.decision.copy(), base.reason_code.copy()
        reasons = list(base.reasons)
        for k, reply in enumerate(replies):
            word = (reply or "").strip().split(maxsplit=1)[0].strip(".:,").lower() if (reply or "").strip() else ""
            if word in _LLM_DECISIONS:
                j = old.size - judged.size + k
                decision[j] = _LLM_DECISIONS[word]
                why = f"the model judged it {word}"
                if why not in reasons:
                    reasons.append(why)
                codes[j] = reasons.index(why)
        return ElasticDecision(decision, codes, reasons, base.score)


class AceConfig(PolicyConfigBase):
    """ACE with the deterministic rule elasticizer, or the served actor as the elasticizer."""

    type: Literal["ace"] = "ace"
    name: ClassVar[str] = "ace"
    raw_min_overlap: int = Field(2, ge=1, description="shared identifiers/paths/URLs for an old step to stay raw")
    abstract_recent: int = Field(3, ge=0, description="steps just before the latest one are at least abstract")
    drop_as: Literal["drop", "placeholder"] = Field(
        "drop", description="render a dropped step as nothing (paper) or as a one-line placeholder")
    elasticizer: Literal["rule", "llm"] = Field(
        "rule", description="rule: deterministic; llm: the served actor judges recent steps (rule as fallback)")
    llm_window: int = Field(16, ge=1, le=256, description="how many of the most recent old steps the model judges")

    def build(self, deps: PolicyDeps | None = None) -> "AcePolicy":
        rule = RuleElasticizer(self.raw_min_overlap, self.abstract_recent)
        if self.elasticizer == "llm":
            if deps is None or deps.chat is None:
                raise ConfigError("the llm elasticizer needs a served actor (it runs inside `palimpsest serve`)")
            return AcePolicy(self, LLMElasticizer(deps.chat, rule, self.llm_window))
        return AcePolicy(self, rule)


class AcePolicy:
    name = "ace"

    def __init__(self, cfg: AceConfig, elasticizer: Elasticizer):
        self.cfg = cfg
        self.elasticizer = elasticizer
        self.config_hash = cfg.config_hash()

    def plan(self, snap: "SessionSnapshot", budget: int) -> RenderPlan:
        m = snap.t
        drop = Resolution.DROP if self.cfg.drop_as == "drop" else Resolution.PLACEHOLDER
        reasons = Reasons()
        res = np.full(m, drop, dtype=np.int8)
        score = np.zeros(m, dtype=np.float64)
        codes = np.zeros(m, dtype=np.int16)
        if m:
            res[m - 1], score[m - 1], codes[m - 1] = Resolution.FULL, 1e9, reasons("the latest step is always raw")
        ready = snap.salient_index().ready[: max(0, m - 1)]
        old = np.flatnonzero(ready)
        if old.size:
            d = self.elasticizer.decide(snap, old)
            res[old] = np.where(d.decision == RAW, Resolution.FULL,
                                np.where(d.decision == ABSTRACT, Resolution.DETAILED, drop))
            score[old] = d.score
            remap = np.array([reasons(r) for r in d.reasons], dtype=np.int16)
            codes[old] = remap[d.reason_code]
        pending = np.flatnonzero(~ready)
        if pending.size:
            # No abstraction yet: raw if the budget allows, else drop. Never wait for the summariser.
            res[pending] = Resolution.DETAILED  # marks them "summary missing" for the shared fallback
            score[pending] = (pending + 1) / (m + 1)
        fallback_missing(snap, budget, res, score, codes, reasons, drop)
        return new_plan(self.name, self.config_hash, snap, res, score, codes, reasons,
                        info={"elasticizer": self.elasticizer.name}, history=self.cfg.history)
