"""`clear_tool_uses`: Anthropic's ``clear_tool_uses_20250919`` context edit, as a policy.

Once the input (the prompt with nothing cleared, every step raw, its ids counted under the actor's chat template)
passes ``trigger`` tokens (or, with ``trigger_type: tool_uses``, that many tool uses), the results of the oldest
tool uses are cleared: every tool use but the latest ``keep`` (counted per call), never one of ``exclude_tools``,
and with ``clear_tool_inputs`` (all tools, or the named ones) the calls' inputs too. When clearing them would free
fewer than ``clear_at_least`` tokens, nothing is cleared. A cleared result is one line naming the step (``glimpse``
shows it whole); the call and its result stay in place, in their roles (``platform/prompt/masking.py``).
The defaults are the API's: trigger 100,000 input tokens, keep 3 tool uses, clear_at_least 0, no excluded tool,
inputs kept.

Like the API, the edit is computed from the whole history on every plan (stateless), so a result once cleared
stays cleared while the history grows. Departures (docs/methods.md, Baselines): the latest step is never cleared
(every policy shows it raw), a step's calls are cleared together (a step with a kept or excluded call keeps its
results), and the compiler still enforces the budget, degrading the oldest steps first, as for every policy.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar, Literal

import numpy as np
from pydantic import Field

from palimpsest.platform.compile.retain import tool_names
from palimpsest.platform.policies.base import PolicyConfigBase, PolicyDeps, Reasons, new_plan, recency
from palimpsest.platform.prompt import toolcalls
from palimpsest.platform.prompt.chat import chat_ids, history_messages, prefix_messages
from palimpsest.platform.prompt.masking import masked_costs
from palimpsest.platform.prompt.render import INPUT_MASKED, RESULT_MASKED
from palimpsest.platform.types import Authority, RenderPlan, Resolution

if TYPE_CHECKING:
    from palimpsest.platform.ledger import SessionSnapshot


class ClearToolUsesConfig(PolicyConfigBase):
    """Anthropic's ``clear_tool_uses_20250919``: past a trigger, clear all but the latest tool results."""

    type: Literal["clear_tool_uses"] = "clear_tool_uses"
    name: ClassVar[str] = "clear_tool_uses"
    trigger: int = Field(100_000, ge=1, description="clear once the input (the prompt with nothing cleared) passes "
                         "this many tokens (or tool uses, with trigger_type: tool_uses)")
    trigger_type: Literal["input_tokens", "tool_uses"] = Field("input_tokens", description="what trigger counts")
    keep: int = Field(3, ge=0, le=1_000_000, description="the latest K tool uses (counted per call) are never cleared")
    clear_at_least: int = Field(0, ge=0, description="when clearing would free fewer tokens than this, nothing is "
                                "cleared (so a cleared prefix is worth the cache it breaks)")
    exclude_tools: tuple[str, ...] = Field((), description="tools whose uses and results are never cleared")
    clear_tool_inputs: bool | tuple[str, ...] = Field(False, description="clear the calls' inputs with their results: "
                                                      "every tool's (true) or the named tools'")

    def build(self, deps: PolicyDeps | None = None) -> "ClearToolUsesPolicy":
        return ClearToolUsesPolicy(self, deps or PolicyDeps())


def tool_uses(snap: "SessionSnapshot") -> list[tuple[int, int, set[str]]]:
    """(index, calls, tool names) of each step that used a tool: a tool's result answered its action (the user's
    own words are no tool result), a structured step counting each of its calls."""
    out = []
    for i, s in enumerate(snap.steps):
        if s.observation is None or s.authority is Authority.USER or not (s.action or s.calls):
            continue
        sc = toolcalls.decode(s)
        out.append((i, max(len(sc.tool_calls) if sc else 1, 1), tool_names(s)))
    return out


class ClearToolUsesPolicy:
    name = "clear_tool_uses"

    def __init__(self, cfg: ClearToolUsesConfig, deps: PolicyDeps):
        self.cfg = cfg
        self.deps = deps
        self.config_hash = cfg.config_hash()

    def _tokens(self, snap: "SessionSnapshot", masked: np.ndarray | None) -> int:
        """The prompt's ids with ``masked`` (None: nothing cleared), counted under the actor's chat template (from
        the stored per-step counts where the tokenizer has no template)."""
        tok = self.deps.tokenizer
        if hasattr(tok, "template") and hasattr(tok, "encode"):
            msgs, _ = history_messages(snap, np.zeros(snap.t, dtype=np.int8), None, False, None, masked)
            return len(chat_ids(tok, prefix_messages(snap.session) + msgs))
        full = np.maximum(snap.tokens[:, Resolution.FULL], 0)
        return snap.prefix_tokens + int((full if masked is None else masked_costs(snap, masked, 0, full)).sum())

    def plan(self, snap: "SessionSnapshot", budget: int) -> RenderPlan:
        cfg, n = self.cfg, snap.t
        reasons = Reasons()
        res = np.full(n, Resolution.FULL, dtype=np.int8)
        masked = np.zeros(n, dtype=np.int8)
        uses = tool_uses(snap)
        codes = np.full(n, reasons("not a tool use: shown as it is"), dtype=np.int16)
        if cfg.trigger_type == "tool_uses":
            size, unit = sum(k for _, k, _ in uses), "tool uses"
        else:
            size, unit = self._tokens(snap, None), "input tokens"
        info = {"input": size, "unit": unit, "trigger": cfg.trigger, "cleared": 0}
        if size <= cfg.trigger:
            codes[[i for i, _, _ in uses]] = reasons(f"{size} {unit} <= trigger {cfg.trigger}: nothing cleared")
            return self._plan(snap, res, codes, reasons, masked, info)
        kept, seen = set(), 0
        for i, k, _ in reversed(uses):  # the latest `keep` tool uses, counted per call
            if seen >= cfg.keep:
                break
            kept.add(i)
            seen += k
        excluded = set(cfg.exclude_tools)
        inputs = cfg.clear_tool_inputs
        for i, _, names in uses:
            if i in kept or i == n - 1:
                codes[i] = reasons(f"one of the last {cfg.keep} tool uses (or the latest step): kept")
            elif names & excluded:
                codes[i] = reasons(f"an excluded tool ({', '.join(sorted(names & excluded))}): never cleared")
            else:
                clear_input = inputs is True or (not isinstance(inputs, bool) and bool(names & set(inputs)))
                masked[i] = INPUT_MASKED if clear_input else RESULT_MASKED
                codes[i] = reasons(f"{size} {unit} > trigger {cfg.trigger}: tool "
                                   f"{'input and result' if clear_input else 'result'} cleared")
        if cfg.clear_at_least and masked.any():
            freed = (size if unit == "input tokens" else self._tokens(snap, None)) - self._tokens(snap, masked)
            info["freed"] = int(freed)
            if freed < cfg.clear_at_least:
                codes[masked > 0] = reasons(f"clearing would free {freed} < clear_at_least {cfg.clear_at_least} "
                                            "tokens: nothing cleared")
                masked[:] = 0
        info["cleared"] = int(np.count_nonzero(masked))
        return self._plan(snap, res, codes, reasons, masked, info)

    def _plan(self, snap, res, codes, reasons, masked, info) -> RenderPlan:
        return new_plan(self.name, self.config_hash, snap, res, recency(snap.t), codes, reasons,
                        history=self.cfg.history, masked=masked, info={"clear_tool_uses": info})
