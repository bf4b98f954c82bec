"""Token counting behind a two-method protocol.

The compiler counts every segment separately and the prompt's size is the sum of its segments,
so a budget is exact in whatever tokenizer is configured: the actor's own (an HF ``tokenizers``
file, the same one vLLM loads), or a fast approximation when none is configured.
"""

from __future__ import annotations

import re
from functools import lru_cache
from pathlib import Path
from typing import Protocol, Sequence, runtime_checkable

from palimpsest.platform.types import ConfigError


@runtime_checkable
class Tokenizer(Protocol):
    name: str

    def count(self, text: str) -> int: ...

    def count_batch(self, texts: Sequence[str]) -> list[int]: ...


# Letter runs are cut every 6 characters, digits every 3, every other visible character is a token:
# close to what byte-level BPEs do on English prose and code, with no vocabulary to load.
_APPROX = re.compile(r"[A-Za-z]{1,6}|\d{1,3}|[^\sA-Za-z\d]|\n")


class ApproxTokenizer:
    """A deterministic, dependency-free approximation of a BPE token count."""

    name = "approx-v1"

    def count(self, text: str) -> int:
        return len(_APPROX.findall(text)) if text else 0

    def count_batch(self, texts: Sequence[str]) -> list[int]:
        return [self.count(t) for t in texts]


class HFTokenizer:
    """An HF ``tokenizers`` tokenizer loaded from a local ``tokenizer.json`` (or a folder holding one)."""

    def __init__(self, path: str | Path):
        try:
            from tokenizers import Tokenizer as _Tok  # light: a Rust extension, no torch
        except ImportError as e:  # pragma: no cover - tokenizers ships with the full install
            raise ConfigError("the 'tokenizers' package is needed for an HF tokenizer") from e
        p = Path(path)
        if p.is_dir():
            p = p / "tokenizer.json"
        if not p.is_file():
            raise ConfigError(f"tokenizer file not found: {p}")
        self._tok = _Tok.from_file(str(p))
        self.name = f"hf:{p.parent.name}"

    def count(self, text: str) -> int:
        return len(self._tok.encode(text, add_special_tokens=False).ids) if text else 0

    def count_batch(self, texts: Sequence[str]) -> list[int]:
        if not texts:
            return []
        return [len(e.ids) for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids


@lru_cache(maxsize=8)
def _hf(path: str) -> HFTokenizer:
    return HFTokenizer(path)


def get_tokenizer(spec: str | None = None) -> Tokenizer:
    """``None`` or ``"approx"`` gives the approximation; anything else is a path to an HF tokenizer."""
    if spec in (None, "", "approx", ApproxTokenizer.name):
        return ApproxTokenizer()
    return _hf(str(spec))
