"""The one validation path for every embeddings tensor that may reach the actor.

Soft memory enters the actor only as input embeddings (vLLM's ``prompt_embeds``), and an embeddings
tensor from the wire is untrusted bytes: it is loaded with ``weights_only=True`` (no pickled code), and
then it must be one dense, finite, floating 2-D tensor (a batch of one is squeezed) whose width is the
actor's hidden size and whose length is within the cap. A sparse tensor is refused before anything
touches its indices (a malicious sparse tensor was CVE-2025-62164 in vLLM's own loader).
"""

from __future__ import annotations

import base64
import binascii
import io

import torch

from palimpsest.platform.types import PalimpsestError

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class EmbedsError(PalimpsestError):
    """An embeddings tensor that must not reach the actor; the message says why."""


def validate_embeds(t: object, hidden_size: int, max_len: int, *, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``t`` as a (T, hidden_size) dense finite floating tensor with 1 <= T <= max_len, cast to ``dtype``
    if given; anything else raises :class:`EmbedsError`."""
    if not isinstance(t, torch.Tensor):
        raise EmbedsError(f"prompt embeds must be a tensor, got {type(t).__name__}")
    if t.layout != torch.strided or t.is_sparse:
        raise EmbedsError(f"prompt embeds must be a dense tensor, got layout {t.layout}")
    if t.is_quantized or t.is_meta:
        raise EmbedsError("prompt embeds must be a plain dense tensor (quantized or meta tensors are refused)")
    if t.dim() == 3 and t.shape[0] == 1:
        t = t[0]
    if t.dim() != 2:
        raise EmbedsError(f"prompt embeds must be 2-D (tokens, hidden), got shape {tuple(t.shape)}")
    if t.dtype not in FLOAT_DTYPES:
        raise EmbedsError(f"prompt embeds must be float32, bfloat16 or float16, got {t.dtype}")
    n, d = t.shape
    if d != hidden_size:
        raise EmbedsError(f"prompt embeds have width {d}; the actor's hidden size is {hidden_size}")
    if n < 1 or n > max_len:
        raise EmbedsError(f"prompt embeds have {n} rows; 1..{max_len} are accepted")
    if not bool(torch.isfinite(t).all()):
        raise EmbedsError("prompt embeds contain NaN or infinite values")
    t = t.detach().contiguous()
    return t.to(dtype) if dtype is not None and t.dtype != dtype else t


def encode_embeds(t: torch.Tensor) -> str:
    """base64 of ``torch.save(t)``: vLLM's wire format for ``prompt_embeds``."""
    buf = io.BytesIO()
    torch.save(t.detach().cpu().contiguous(), buf)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def decode_embeds(data: str | bytes, hidden_size: int, max_len: int, max_bytes: int = 64 << 20) -> torch.Tensor:
    """Wire bytes (base64 of ``torch.save``) -> a validated tensor. Only tensors load (weights_only)."""
    if isinstance(data, str):
        data = data.encode("ascii", "ignore")
    if len(data) > max_bytes * 4 // 3 + 4:
        raise EmbedsError(f"prompt embeds are larger than {max_bytes} bytes")
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise EmbedsError("prompt embeds must be base64 of torch.save(tensor)") from None
    try:
        t = torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
    except Exception as e:  # pickles of anything but tensors, truncated files, garbage
        raise EmbedsError(f"prompt embeds could not be loaded as a tensor: {type(e).__name__}") from None
    return validate_embeds(t, hidden_size, max_len)
