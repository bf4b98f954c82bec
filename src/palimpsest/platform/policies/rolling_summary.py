"""`rolling_summary`: the Summary agent. Past a token threshold, everything older than the last K
steps is folded into one rolling summary that later turns keep and extend.

The summary is built from what the context already shows (the old summary plus the steps being
folded), never by re-reading the ledger's older history, exactly like an LLM summary agent that
sees only its own context. The fold is stored in the ledger by the runtime (``plan.new_fold``), so
the next turn's snapshot carries it and the plan stays a pure function of the snapshot.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar, Literal

import numpy as np
from pydantic import Field

from palimpsest.platform.policies.base import PolicyConfigBase, PolicyDeps, Reasons, new_plan, recency
from palimpsest.platform.prompt.abstraction import RuleSummarizer
from palimpsest.platform.prompt.chat import fold_message
from palimpsest.platform.prompt.render import gist
from palimpsest.platform.types import Fold, RenderPlan, Resolution

if TYPE_CHECKING:
    from palimpsest.platform.ledger import SessionSnapshot


class RollingSummaryConfig(PolicyConfigBase):
    """Fold old steps into one rolling summary whenever the context passes a threshold."""
    type: Literal["rolling_summary"] = "rolling_summary"
    name: ClassVar[str] = "rolling_summary"
    keep_last: int = Field(4, ge=1, le=10_000, description="steps kept raw after a fold")
    trigger_fraction: float = Field(0.8, gt=0.0, le=1.0,
                                    description="fold when the context passes this share of the budget")
    trigger_tokens: int | None = Field(None, ge=1, description="absolute threshold; overrides trigger_fraction")
    max_summary_tokens: int = Field(1024, ge=32, description="the summary keeps its newest lines within this size")

    def build(self, deps: PolicyDeps | None = None) -> "RollingSummaryPolicy":
        return RollingSummaryPolicy(self, deps or PolicyDeps())


class RollingSummaryPolicy:
    name = "rolling_summary"
    producer = "rolling-summary-rule-v1"

    def __init__(self, cfg: RollingSummaryConfig, deps: PolicyDeps):
        self.cfg = cfg
        self.deps = deps
        self.config_hash = cfg.config_hash()
        self._writer = RuleSummarizer()

    def _line(self, snap: "SessionSnapshot", i: int) -> str:
        brief = snap.body(i, Resolution.BRIEF)
        if brief is None:  # not enriched yet: summarise the raw step the context is showing right now
            brief = self._writer.summarize(snap.steps[i].record()).brief
        step = snap.steps[i]
        return f"- t={step.t} {step.kind}: {gist(brief, 400)}"

    def _extend(self, old: Fold | None, snap: "SessionSnapshot", start: int, stop: int) -> Fold:
        """Old summary + one line per newly folded step, keeping the newest lines that fit
        ``max_summary_tokens``. Built newest first, so folding a long history costs what is kept."""
        old_lines = old.text.splitlines() if old else []
        omitted = 0
        if old_lines and old_lines[0].startswith("(") and old_lines[0].endswith("earlier steps omitted)"):
            omitted = int(old_lines[0][1:].split()[0])
            old_lines = old_lines[1:]
        candidates = ((i, None) for i in range(stop - 1, start - 1, -1))
        older = ((None, line) for line in reversed(old_lines))
        kept: list[str] = []
        total, n_all = 0, (stop - start) + len(old_lines)
        for i, line in (*candidates, *older):
            text = line if line is not None else self._line(snap, i)
            n = self.deps.tokenizer.count(text)
            if kept and total + n > self.cfg.max_summary_tokens:
                break
            kept.append(text)
            total += n
        omitted += n_all - len(kept)
        lines = ([f"({omitted} earlier steps omitted)"] if omitted else []) + kept[::-1]
        text = "\n".join(lines)

        size = self.deps.tokenizer.count(fold_message(Fold(stop, text, 0, self.producer))["content"])
        return Fold(upto=stop, text=text, tokens=size, producer=self.producer)

    def plan(self, snap: "SessionSnapshot", budget: int) -> RenderPlan:
        m, k = snap.t, self.cfg.keep_last
        fold = snap.folds.get(self.config_hash)
        upto = fold.upto if fold else 0
        size = snap.prefix_tokens + (fold.tokens if fold else 0) + int(snap.tokens[upto:, Resolution.FULL].sum())
        trigger = self.cfg.trigger_tokens or int(self.cfg.trigger_fraction * budget)
        new_fold = False
        if size > trigger and m - k > upto:
            fold, upto, new_fold = self._extend(fold, snap, upto, m - k), m - k, True
        reasons = Reasons()
        folded = np.arange(m) < upto
        res = np.where(folded, Resolution.DROP, Resolution.FULL).astype(np.int8)
        codes = np.where(folded, reasons("folded into the rolling summary"), reasons("not folded yet"))
        return new_plan(self.name, self.config_hash, snap, res, recency(m), codes, reasons, fold=fold,
                        new_fold=new_fold, info={"trigger_tokens": trigger, "context_estimate": size},
                        history=self.cfg.history)
