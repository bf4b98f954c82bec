"""all-MiniLM-L6-v2 as PACE's key/query encoder: mean-pooled, L2-normalised, batched, offline.

Texts are truncated to ``max_tokens`` word pieces (PACE's L_max); the model's positions allow 512,
its training used 256. Device and dtype come from the arguments, so the same code runs on a GPU.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from palimpsest.models.assets import minilm_dir


class MiniLMEmbedder:
    dim = 384

    def __init__(self, path: str | Path | None = None, device: str = "cpu", dtype: str = "float32",
                 max_tokens: int = 256, batch_size: int = 32, threads: int | None = None):
        from transformers import AutoModel, AutoTokenizer

        if not 8 <= max_tokens <= 512:
            raise ValueError(f"max_tokens must be within 8..512 for MiniLM, got {max_tokens}")
        if threads:
            torch.set_num_threads(threads)
        self.path = Path(path) if path else minilm_dir()
        self.device = torch.device(device)
        self.dtype = getattr(torch, dtype)
        self.max_tokens = max_tokens
        self.batch_size = batch_size
        self.tokenizer = AutoTokenizer.from_pretrained(str(self.path))
        self.model = AutoModel.from_pretrained(str(self.path), dtype=self.dtype).to(self.device).eval()
        self.name = f"all-MiniLM-L6-v2@{max_tokens}"

    @torch.inference_mode()
    def embed(self, texts: Sequence[str]) -> np.ndarray:
        out = np.zeros((len(texts), self.dim), dtype=np.float32)
        # Empty texts keep a zero row (the protocol's contract). Sort the rest by length so each batch
        # pads little; results go back to their original rows.
        order = sorted((i for i in range(len(texts)) if (texts[i] or "").strip()), key=lambda i: len(texts[i]))
        for start in range(0, len(order), self.batch_size):
            idx = order[start: start + self.batch_size]
            batch = self.tokenizer([texts[i] or "" for i in idx], padding=True, truncation=True,
                                   max_length=self.max_tokens, return_tensors="pt").to(self.device)
            hidden = self.model(**batch).last_hidden_state  # (B, T, 384)
            mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)  # (B, T, 1)
            pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1.0)  # (B, 384)
            pooled = torch.nn.functional.normalize(pooled.float(), dim=-1)
            out[idx] = pooled.cpu().numpy()
        return out
