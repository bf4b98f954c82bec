"""The frozen actor: any HF causal LM from a local folder, frozen and in eval mode.

Soft memory reaches it only through input embeddings: :meth:`FrozenActor.forward` takes exactly one
of token ids or ``inputs_embeds`` (as ``Qwen2Model.forward`` insists), and :meth:`FrozenActor.embed`
gives the embeddings of token ids from the actor's own table, so ``[text ids + soft span]`` is built as
``cat(embed(ids), soft)``. Gradients flow through the frozen weights into whatever produced the
embeddings; the weights themselves never change (requires_grad is off).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from palimpsest.platform.types import ConfigError

PROBE_ROWS = 8  # embedding rows whose norms a memory bundle records of its actor


class FrozenActor(nn.Module):
    def __init__(self, model: nn.Module, tokenizer=None):
        super().__init__()
        self.model = model.eval()
        for p in self.model.parameters():
            p.requires_grad_(False)
        self.tokenizer = tokenizer

    @classmethod
    def from_pretrained(cls, path: str | Path, device: str = "cpu", dtype: str = "float32") -> "FrozenActor":
        from transformers import AutoModelForCausalLM, AutoTokenizer

        path = Path(path)
        if not (path / "config.json").is_file():
            raise ConfigError(f"no HF model at {path} (config.json missing); `palimpsest models prepare` makes one")
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=getattr(torch, dtype)).to(device)
        tok = AutoTokenizer.from_pretrained(str(path)) if (path / "tokenizer.json").is_file() else None
        return cls(model, tok)

    def train(self, mode: bool = True) -> "FrozenActor":
        # The actor stays in eval mode whatever its owner does (no dropout, no norm-statistics updates).
        return super().train(False)

    @property
    def hidden_size(self) -> int:
        return int(self.model.config.hidden_size)

    @property
    def vocab_size(self) -> int:
        return int(self.model.get_input_embeddings().weight.shape[0])

    @property
    def device(self) -> torch.device:
        return self.model.get_input_embeddings().weight.device

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """(T,) or (N, T) token ids -> their input embeddings (..., d)."""
        return self.model.get_input_embeddings()(ids.to(self.device))

    def embed_norm(self) -> float:
        """Mean L2 norm of the token embedding table: the scale soft tokens are given."""
        return float(self.model.get_input_embeddings().weight.detach().float().norm(dim=-1).mean())

    def fingerprint(self) -> dict:
        """What a memory bundle records of the actor it was trained beside, to be served beside that one only: the
        mean embedding norm, the norms of ``PROBE_ROWS`` rows spread over the vocabulary (another seed moves
        them; a dtype by ~1e-5), the vocabulary size, and the L2 norm of each weight tensor (a fine-tune that
        leaves the embeddings alone moves those it trained; a dtype moves each by ~1e-4 at most)."""
        weight = self.model.get_input_embeddings().weight.detach()
        rows = torch.linspace(0, weight.shape[0] - 1, PROBE_ROWS).long().to(weight.device)
        return {"embed_norm": self.embed_norm(), "embed_probe": weight[rows].float().norm(dim=-1).tolist(),
                "vocab_size": int(weight.shape[0]),
                "weight_norms": [float(p.detach().float().norm()) for p in self.model.parameters()]}

    def differs_from(self, recorded: dict, rtol: float = 1e-3) -> str | None:
        """The first recorded ``fingerprint`` field this actor does not match, with both values; None if it
        matches every field recorded (a bundle written before a field was recorded is not checked on it)."""
        here = self.fingerprint()
        for key, value in here.items():
            want = recorded.get(key)
            if want is None:
                continue
            have, want = torch.tensor(value, dtype=torch.float64), torch.tensor(want, dtype=torch.float64)
            tol = 0.0 if key == "vocab_size" else rtol  # a count: equal, or another vocabulary
            if have.shape != want.shape:
                return f"actor.{key}: {want.numel()} recorded, this actor has {have.numel()}"
            off = (~torch.isclose(have, want, rtol=tol, atol=0.0)).flatten().nonzero()
            if off.numel():
                i = int(off[0])
                was, now = want.flatten()[i].item(), have.flatten()[i].item()
                return f"actor.{key}{f'[{i}]' if have.dim() else ''}: recorded {was:.6g}, this actor's {now:.6g}"
        return None

    def forward(self, input_ids: torch.Tensor | None = None, inputs_embeds: torch.Tensor | None = None,
                last: int = 0) -> torch.Tensor:
        """Logits (N, T, V) from exactly one of ``input_ids`` (N, T) or ``inputs_embeds`` (N, T, d).
        ``last`` > 0 computes only the last ``last`` positions' logits (a full-vocabulary row per
        position is the largest tensor of a long sequence: 49,152 floats for SmolLM2)."""
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("give exactly one of input_ids or inputs_embeds")
        return self.model(input_ids=input_ids, inputs_embeds=inputs_embeds, use_cache=False, logits_to_keep=last).logits

    @torch.no_grad()
    def prefill(self, ids: torch.Tensor):
        """(T,) ids -> (their KV cache, the logits (V,) after the last one): a prefix that several continuations
        share (the shadow lane's reference, scored once for every arm of a paired trajectory)."""
        out = self.model(input_ids=ids.to(self.device)[None], use_cache=True, logits_to_keep=1)
        return out.past_key_values, out.logits[0, -1]

    @torch.no_grad()
    def continue_from(self, past, n_prefix: int, ids: torch.Tensor) -> torch.Tensor:
        """Logits (T, V) at each of ``ids`` (T,) after a prefilled prefix of ``n_prefix`` positions; the cache is cut
        back to the prefix afterwards, so the next continuation starts from it again."""
        try:
            return self.model(input_ids=ids.to(self.device)[None], past_key_values=past, use_cache=True).logits[0]
        finally:
            past.crop(n_prefix)

    def after_prefix(self, past, inputs_embeds: torch.Tensor, last: int = 0, keep: bool = True) -> torch.Tensor:
        """Logits (T, V) of ``inputs_embeds`` (T, d) continuing a prefilled prefix (``prefill``), differentiable in
        the embeddings: training's constant prefix (the context before the soft slot) is then run once without a
        graph, and the gradient goes through the suffix only. ``keep``: the prefix's cache is left as it was (the
        forward runs on a copy of it), so it serves every later step; otherwise it is used up."""
        import copy

        out = self.model(inputs_embeds=inputs_embeds[None], past_key_values=copy.deepcopy(past) if keep else past,
                         use_cache=True,
                         logits_to_keep=last)
        return out.logits[0]
