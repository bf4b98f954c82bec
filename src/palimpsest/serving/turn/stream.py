"""What a streamed turn shows its client: nothing of a reply that may still be a ``glimpse(...)`` call (answered
inside the turn, never shown), everything once it cannot be."""

from __future__ import annotations

import re
from typing import AsyncIterator, Awaitable, Callable

_GLIMPSE_PREFIX = re.compile(r"^\s*#?\d{0,18}\s*(\)\s*)?$")


def could_be_glimpse(text: str) -> bool:
    """Whether a reply that begins with ``text`` may still turn out to be a glimpse call."""
    s = text.lstrip()
    if len(s) <= len("glimpse("):
        return "glimpse(".startswith(s)
    return s.startswith("glimpse(") and bool(_GLIMPSE_PREFIX.match(s[len("glimpse("):]))


class StreamGate:
    """What a streamed generation may show the client: nothing while the reply may still be a glimpse call
    (answered inside the turn, never shown), everything once it cannot be."""

    def __init__(self, emit: Callable[[str], Awaitable[None]], may_glimpse: bool):
        self.emit, self.open, self.held, self.text = emit, not may_glimpse, [], ""

    async def feed(self, delta: str, content: str | None) -> None:
        self.text += delta
        if not self.open and not could_be_glimpse(self.text):
            await self.release()
        if content:
            if self.open:
                await self.emit(content)
            else:
                self.held.append(content)

    async def release(self) -> None:
        self.open = True
        for c in self.held:
            await self.emit(c)
        self.held = []


async def streamed(events: AsyncIterator[dict], gate: StreamGate) -> dict:
    async for ev in events:
        if ev.get("done"):
            return ev
        await gate.feed(ev["delta"], ev.get("content"))
    raise RuntimeError("the actor's stream ended without a result")
