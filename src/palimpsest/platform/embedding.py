"""Key and query embeddings behind a small protocol.

Policies never embed the history themselves: keys are computed once per step at enrichment and
cached in the ledger. :class:`HashingEmbedder` is a deterministic, dependency-free stand-in for the
unit tests and the platform's pure core; the real sentence embedder lives in ``palimpsest.models``.
"""

from __future__ import annotations

import re
import zlib
from typing import Protocol, Sequence, runtime_checkable

import numpy as np


class EmbedderUnavailable(RuntimeError):
    """The key embedder failed or timed out. A turn then plans as if no step had a key yet (PACE's own
    fallback for keys still being computed): it is served, with less relevance information."""


@runtime_checkable
class Embedder(Protocol):
    name: str  # keys are stored per model name
    dim: int

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        """(n, dim) float32, rows L2-normalised (zero rows for empty texts)."""
        ...


_TOKEN = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_STOP = frozenset(
    "the and for are was were with from that this have has not but you your can will all any its into than then "
    "there their what when which who how out use used using def return self none true false".split()
)


class HashingEmbedder:
    """Signed feature hashing of words and their snake_case parts into ``dim`` bins.

    Identifier-like words (with ``_``, digits or inner capitals) weigh three times a plain word;
    stop words and words under 3 letters are ignored, so two texts about the same identifiers are
    close and texts that share only prose are not. Deterministic across processes (crc32, not
    Python's salted ``hash``). ``max_tokens`` plays PACE's L_max: only the first words count.
    """

    def __init__(self, dim: int = 256, max_tokens: int = 512):
        if dim < 8:
            raise ValueError("dim must be >= 8")
        self.dim = dim
        self.max_tokens = max_tokens
        self.name = f"hashing-{dim}-{max_tokens}"

    def _features(self, text: str) -> tuple[list[str], list[float]]:
        feats, weights = [], []
        for w in _TOKEN.findall(text)[: self.max_tokens]:
            lw = w.lower()
            if len(lw) < 3 or lw in _STOP:
                continue
            ident = "_" in w or any(c.isdigit() for c in w) or any(c.isupper() for c in w[1:])
            feats.append(lw)
            weights.append(3.0 if ident else 1.0)
            if "_" in lw:
                parts = [p for p in lw.split("_") if len(p) > 2 and p not in _STOP]
                feats.extend(parts)
                weights.extend([1.0] * len(parts))
        return feats, weights

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        out = np.zeros((len(texts), self.dim), dtype=np.float32)
        for i, text in enumerate(texts):
            feats, weights = self._features(text or "")
            if not feats:
                continue
            h = np.fromiter((zlib.crc32(f.encode("utf-8")) for f in feats), dtype=np.uint64, count=len(feats))
            idx = (h % self.dim).astype(np.int64)
            sign = np.where((h >> np.uint64(31)) & np.uint64(1), -1.0, 1.0).astype(np.float32)
            np.add.at(out[i], idx, sign * np.asarray(weights, dtype=np.float32))
            # sublinear term frequency, so one repeated word does not dominate a step
            out[i] = np.sign(out[i]) * np.log1p(np.abs(out[i]))
            n = np.linalg.norm(out[i])
            if n > 0:
                out[i] /= n
        return out
