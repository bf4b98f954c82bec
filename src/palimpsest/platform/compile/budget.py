"""The token budget of a turn: one value, validated once where it enters (HTTP, CLI, config, the runtime's API).

A turn may send the actor ``total`` ids. Of those, ``reply`` (the reply's ``max_tokens``) and ``soft`` (the
soft-memory positions of an arm with memory) are reserved; the prompt's exact ids get the rest
(:attr:`Budget.prompt`). Every bound in the compiler, the epochs, the runtime and the served turn reads these
fields; nothing subtracts them again.
"""

from __future__ import annotations

from dataclasses import dataclass

from palimpsest.platform.types import BudgetError


def _count(name: str, value: object, least: int) -> int:
    kind = "a positive integer" if least == 1 else "a non-negative integer"
    if isinstance(value, bool) or not hasattr(value, "__index__") or int(value.__index__()) < least:  # type: ignore
        raise BudgetError(f"{name} must be {kind}, got {value!r}")
    return int(value.__index__())  # type: ignore[attr-defined]


@dataclass(frozen=True)
class Budget:
    """``total`` ids per turn, ``reply`` + ``soft`` of them reserved. ``reserve < total`` always holds."""

    total: int
    reply: int = 0
    soft: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "total", _count("the token budget", self.total, 1))
        object.__setattr__(self, "reply", _count("max_tokens", self.reply, 0))
        object.__setattr__(self, "soft", _count("the soft positions", self.soft, 0))
        if self.reply + self.soft >= self.total:
            soft = f" (+ {self.soft} soft positions)" if self.soft else ""
            raise BudgetError(f"max_tokens: {self.reply}{soft} leaves no room in the budget of {self.total}")

    @property
    def reserve(self) -> int:
        """What the prompt may not use: the reply and the soft positions."""
        return self.reply + self.soft

    @property
    def prompt(self) -> int:
        """The most ids the prompt itself may have."""
        return self.total - self.reserve

    def without_soft(self) -> "Budget":
        """The same total and reply with no soft positions: a memory arm's turn where its memory sends nothing."""
        return Budget(self.total, self.reply)

    def of_total(self, total: int) -> "Budget":
        """The same reserve under another total (a compaction's watermark)."""
        return Budget(total, self.reply, self.soft)

    def __str__(self) -> str:
        return f"{self.total}" + (f" (reserve {self.reserve})" if self.reserve else "")
