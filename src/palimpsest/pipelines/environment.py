"""The runtime the command line works with: a ledger, the real key embedder and the actor's tokenizer.

The platform's own defaults (hashing embedder, approximate token counts) keep its core free of torch
and its unit tests fast; every user-facing command uses the real parts unless told otherwise.
"""

from __future__ import annotations

from pathlib import Path

from palimpsest.models.assets import smollm2_tokenizer_dir
from palimpsest.models.relevance_head import RelevanceResolver
from palimpsest.platform import HashingEmbedder, Ledger, Runtime
from palimpsest.platform.embedding import Embedder
from palimpsest.platform.types import PalimpsestError

EMBEDDERS = ("minilm", "hashing")


def make_embedder(name: str) -> Embedder:
    if name == "minilm":
        # deferred: loads torch
        from palimpsest.models.embedder import MiniLMEmbedder

        return MiniLMEmbedder()
    if name == "hashing":
        return HashingEmbedder()
    raise PalimpsestError(f"unknown embedder {name!r}; expected one of {', '.join(EMBEDDERS)}")


def tokenizer_spec(name: str) -> str:
    """``smollm2`` (the actor's tokenizer, extracted offline), ``approx``, or a tokenizer.json path."""
    if name == "smollm2":

        return str(smollm2_tokenizer_dir())
    if name == "approx":
        return "approx"
    if not Path(name).exists():
        raise PalimpsestError(f"unknown tokenizer {name!r}: expected smollm2, approx or a path to tokenizer.json")
    return name


def open_runtime(ledger: str | Path, embedder: str = "minilm", tokenizer: str = "smollm2", wrap=None) -> Runtime:
    """A runtime over ``ledger``; ``wrap`` (e.g. a timing wrapper) is applied to the embedder. A policy that names a
    relevance predictor finds it in MLflow (or a bundle directory), else scores by the cosine."""
    emb = make_embedder(embedder)
    return Runtime(Ledger(ledger, tokenizer=tokenizer_spec(tokenizer)), embedder=wrap(emb) if wrap else emb,
                   relevance=RelevanceResolver())
