"""Plain data types shared by the ledger, the policies and the compiler.

Everything here is a frozen dataclass or an enum: a snapshot of a session can be handed to
any policy without fear that the policy mutates what the next one sees.
"""

from __future__ import annotations

import enum
import hashlib
import json
from dataclasses import dataclass, field
from typing import Any, Mapping

import numpy as np


class PalimpsestError(Exception):
    """Base class of every error Palimpsest raises on purpose (bad input, broken invariant)."""


class LedgerError(PalimpsestError):
    """The ledger refused an operation (duplicate with other content, unknown session, ...)."""


class LedgerUnavailableError(LedgerError):
    """The ledger's database cannot be reached (at start-up, or lost mid-operation). Retriable: the
    operation's transaction did not commit, so nothing of it is stored; re-sending an append is safe."""


class UnknownSessionError(LedgerError):
    pass


class UnknownStepError(LedgerError):
    pass


class BudgetError(PalimpsestError):
    """The token budget cannot hold what must always be shown (prefix + latest step)."""


class GlimpseLimitError(PalimpsestError):
    pass


class ConfigError(PalimpsestError):
    pass


class Resolution(enum.IntEnum):
    """How a step is shown in a compiled context, from most to least detailed.

    The order matters: the compiler degrades a step by adding one to its level. ``DROP`` is a
    rendering decision (not shown at all), never a deletion: the ledger keeps the raw step.
    """

    FULL = 0
    DETAILED = 1
    BRIEF = 2
    PLACEHOLDER = 3
    DROP = 4

    @property
    def label(self) -> str:
        return self.name.lower()

    @classmethod
    def parse(cls, name: str) -> "Resolution":
        try:
            return cls[name.upper()]
        except KeyError:
            raise ValueError(f"unknown resolution {name!r}; expected one of {[r.label for r in cls]}") from None


#: The resolutions that have a stored text (DROP has none).
STORED_RESOLUTIONS = (Resolution.FULL, Resolution.DETAILED, Resolution.BRIEF, Resolution.PLACEHOLDER)


class Authority(str, enum.Enum):
    """Who produced the content of a step's observation. It survives every representation."""

    USER = "user"
    SYSTEM = "system"
    TOOL = "tool"
    MODEL = "model"
    RETRIEVED = "retrieved"

    @property
    def trusted(self) -> bool:
        # Only the operator (system) and the model's own words are instructions; everything else
        # is data and is rendered inside a delimited untrusted block.
        return self in (Authority.SYSTEM, Authority.MODEL)


STEP_KINDS = ("bash", "tool_call", "code", "respond", "message", "format_error", "env")


@dataclass(frozen=True)
class Session:
    id: str
    task: str
    system: str = ""
    tools: str | None = None
    created: float = 0.0
    meta: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class StepRecord:
    """A raw step as an agent (or an importer) hands it to the ledger."""

    t: int
    kind: str
    action: str = ""
    thought: str = ""
    observation: str | None = None
    authority: Authority = Authority.TOOL
    tool: str | None = None  # tool or command name, for placeholders
    # The structure of a tool-calling step (``palimpsest.platform.prompt.toolcalls``): canonical JSON of the
    # assistant's tool calls and of the messages that answered them; None for a plain step.
    calls: str | None = None

    def canonical(self) -> dict[str, Any]:
        out = {
            "t": self.t,
            "kind": self.kind,
            "thought": self.thought,
            "action": self.action,
            "observation": self.observation,
            "authority": self.authority.value,
            "tool": self.tool,
        }
        if self.calls is not None:  # absent for plain steps: their hashes are what they always were
            out["calls"] = self.calls
        return out

    def sha256(self) -> str:
        blob = json.dumps(self.canonical(), sort_keys=True, ensure_ascii=False, separators=(",", ":"))
        return hashlib.sha256(blob.encode("utf-8")).hexdigest()


@dataclass(frozen=True)
class Step:
    """A step as the ledger stores it: the raw record plus its identity and bookkeeping."""

    id: int  # ledger-wide step id, what placeholders show and `glimpse` takes
    session_id: str
    t: int
    kind: str
    thought: str
    action: str
    observation: str | None
    authority: Authority
    tool: str | None
    sha256: str
    tokens: Mapping[str, int]  # thought/action/observation/full (full = the rendered full segment)
    created: float
    calls: str | None = None

    def record(self) -> StepRecord:
        return StepRecord(
            t=self.t,
            kind=self.kind,
            action=self.action,
            thought=self.thought,
            observation=self.observation,
            authority=self.authority,
            tool=self.tool,
            calls=self.calls,
        )


@dataclass(frozen=True)
class Fold:
    """A rolling summary of the steps with t < upto (the `rolling_summary` policy's state)."""

    upto: int
    text: str
    tokens: int
    producer: str


@dataclass(frozen=True)
class PlanEntry:
    t: int
    step_id: int
    resolution: Resolution
    reason: str
    score: float


@dataclass(frozen=True)
class Degradation:
    t: int
    before: Resolution
    after: Resolution


@dataclass
class RenderPlan:
    """A resolution and a reason for every step of the history, in columns.

    Columns keep a plan over 100,000 steps cheap to build; `entries()` gives rows for display.
    ``pinned`` steps (the latest step) are never degraded by the compiler. ``fold`` is a
    summary block shown after the prefix (rolling summary); ``new_fold`` says the runtime must
    store it because it extends the one in the snapshot.
    """

    policy: str
    config_hash: str
    t: np.ndarray  # (M,) int64 step index
    step_id: np.ndarray  # (M,) int64
    resolution: np.ndarray  # (M,) int8 Resolution
    score: np.ndarray  # (M,) float64, higher = more relevant; the compiler degrades low scores first
    reason_code: np.ndarray  # (M,) int16 index into reasons
    reasons: list[str]
    pinned: np.ndarray  # (M,) bool
    fold: Fold | None = None
    new_fold: bool = False
    fold_ranges: bool = False  # render each run of dropped steps as one line (ids to glimpse)
    # The policy's HistoryBound (platform.compile.folding): how much old history may cost before the compiler folds it
    history: Any = None
    # (K, 3) int64 rows of (t, before, after), in the order the compiler applied them
    degraded: np.ndarray = field(default_factory=lambda: np.zeros((0, 3), dtype=np.int64))
    # (M,) bool or None: steps the compiler keeps at their planned level (a compaction boundary keeps the
    # oldest region as the previous boundary rendered it, so the prefix cache holds it); released if nothing
    # else can give way
    frozen: Any = None
    # (M,) bool or None: hidden steps whose run keeps its range line whatever hid them (a boundary's kept
    # region, as the previous boundary drew it)
    lined: Any = None
    # (M,) int8 or None: how a step shown at full is masked (``render.RESULT_MASKED``: its result is one line naming
    # the step; ``render.INPUT_MASKED``: its tool input too); observation masking and cleared tool uses set it
    masked: Any = None
    info: dict[str, Any] = field(default_factory=dict)

    def __len__(self) -> int:
        return int(self.t.shape[0])

    @property
    def degradations(self) -> list[Degradation]:
        return [Degradation(int(t), Resolution(int(b)), Resolution(int(a))) for t, b, a in self.degraded.tolist()]

    def entries(self) -> list[PlanEntry]:
        return [
            PlanEntry(
                t=int(self.t[i]),
                step_id=int(self.step_id[i]),
                resolution=Resolution(int(self.resolution[i])),
                reason=self.reasons[int(self.reason_code[i])],
                score=float(self.score[i]),
            )
            for i in range(len(self))
        ]

    def counts(self) -> dict[str, int]:
        counts = np.bincount(self.resolution.astype(np.intp), minlength=len(Resolution)).tolist()
        return {r.label: counts[int(r)] for r in Resolution}


@dataclass(frozen=True)
class Segment:
    """One piece of a compiled prompt: the prefix, the rolling summary, a step (its messages) or a hidden
    run. ``tokens`` is the planning estimate; the prompt's exact size is ``Prompt.tokens``."""

    kind: str  # system | task | fold | step | range
    role: str  # the role of its (first) message
    text: str  # its messages' contents, joined
    tokens: int
    t: int | None = None
    step_id: int | None = None
    resolution: Resolution | None = None
    messages: tuple[int, int] = (0, 0)  # [first, first + n) in Prompt.messages


@dataclass(frozen=True)
class Prompt:
    """What the actor receives: chat ``messages`` and their exact ids under the model's chat template,
    ``context_ids`` (up to the soft-memory slot, before message ``soft_at``: the recent raw turns follow it)
    then ``bridge_ids`` (those turns and the assistant prompt).

    ``tokens`` is ``len(context_ids) + len(bridge_ids)``; ``text`` is those ids decoded (what recall is
    checked on); ``reserve`` is what the budget keeps for the reply and soft positions, so
    ``tokens + reserve <= budget``."""

    segments: tuple[Segment, ...]
    tokens: int
    prefix_tokens: int
    prefix_hash: str
    prompt_hash: str  # sha256 of ``text``
    messages: tuple[dict, ...] = ()
    context_ids: tuple[int, ...] = ()
    bridge_ids: tuple[int, ...] = ()
    text: str = ""
    reserve: int = 0
    soft_at: int = 0  # the message index of the soft-memory slot (``palimpsest.platform.prompt.chat.soft_slot``)

    @property
    def ids(self) -> list[int]:
        return list(self.context_ids) + list(self.bridge_ids)


@dataclass(frozen=True)
class CompiledTurn:
    session_id: str
    t: int  # the step the actor is about to take (history = steps with index < t)
    budget: int
    plan: RenderPlan
    prompt: Prompt
    # The snapshot the turn was compiled over (what the memory reads is chosen from its steps); not compared.
    snapshot: Any = field(default=None, compare=False, repr=False)
    # Compaction epochs (platform.compile.epochs): the boundary the prompt extends, and whether this turn made it.
    boundary: Any = field(default=None, compare=False, repr=False)
    compacted: bool = False
    epoch_key: str | None = None
    # What this turn's ids cost against the previous turn of the session and policy on this runtime
    # (platform.compile.epochs.turn_cost: cached, uncached, billed, prefix_reuse); None where it has no previous turn.
    cost: dict | None = field(default=None, compare=False)
