"""REMORY's memory network: the actor's own layers read the history and write soft tokens in its input space.

The seed's description, element by element, and how it is built here (architecture ``actor-lora/1``):

- **Frozen actor features.** The actor prefills every block of <= ``block_size`` source positions once, with
  no gradient and its own weights; its per-layer keys and values are what the memory reads (DFlash feeds the
  target's features into every drafter layer's K/V; here they are the actor's own K/V, with no projection
  in between).
- **Learnable queries, parallel prediction.** ``queries`` memory tokens per block. Slot i sits at the
  position of the end of its share of the block; its input is a per-slot vector that starts at zero, added
  to the embedding of the source token at that position (``slot_input: share_end``) or to the mean
  vocabulary embedding (``mean``: every slot starts alike, and their outputs are near copies, mean pairwise
  cosine 0.903 on 64-token spans against 0.643; docs/methods.md). The slots attend to the block's K/V (up to their own
  position, ``source_view: prefix``, or all of it, ``block``) and to each other, both ways.
- **The layers.** The actor's own decoder layers, run on the memory tokens only, with LoRA adapters on their
  projections (``lora_targets``; B starts at zero). At initialisation the memory is "the actor reading its
  history", not noise.
- **The readout.** The final state through the actor's final norm (SmolLM2's embeddings are tied, so that
  state lives in embedding space), then a map that starts at identity, rescaled to the mean norm of the
  actor's token embeddings.
- **The summary.** A gated cross-attention (tanh gate at 0) before ``summary_layers`` evenly spaced layers,
  its projections copied from that layer's self-attention, so the gate gets a meaningful gradient at once.
- **The span gate** (``span_gate``; docs/methods.md): a logistic gate on the span's mean decides whether it is
  sent. It starts closed: the network as it starts sends nothing, the actor sees the text alone; Stage II opens
  it where the memory's KL beats the text alone's (``training.losses.stage2_loss``).
- **Hierarchical merges.** When the history needs more than ``max_slots`` soft tokens, the oldest ones are read
  again by the same network (the frozen actor prefills them as a source) into ``queries`` tokens per block,
  with their own slot vectors, until they fit (``merges``).

The network holds only its own parameters (LoRA, slot vectors, readout, the summary attention): the actor is
given to it at construction and never registered as a submodule, so its state dict, its optimizer and its
DeepSpeed engine hold the memory alone. :class:`MemoryConfig` is the one config: the training YAML's
``memory:`` section and a bundle's ``memory`` record are this model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from palimpsest.models.memory import ARCHITECTURE, MemoryConfig

__all__ = ["ARCHITECTURE", "GatedSummaryAttention", "LoRA", "MemoryConfig", "MemoryNetwork", "Source"]

_ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")


class LoRA(nn.Module):
    """A low-rank update x -> (x A^T) B^T * alpha / r beside a frozen projection; B starts at zero."""

    def __init__(self, d_in: int, d_out: int, rank: int, alpha: float):
        super().__init__()
        self.A = nn.Parameter(torch.randn(rank, d_in) / math.sqrt(d_in))
        self.B = nn.Parameter(torch.zeros(d_out, rank))
        self.scale = alpha / rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ((x.to(self.A.dtype) @ self.A.T) @ self.B.T * self.scale).to(x.dtype)


class GatedSummaryAttention(nn.Module):
    """Memory tokens read the summary's token embeddings; projections copied from the layer's self-attention,
    tanh(gate) starts at 0, so at initialisation the summary changes nothing and the gate's gradient is the
    attention's (meaningful) output."""

    def __init__(self, layer: nn.Module, n_heads: int, n_kv: int, head_dim: int):
        super().__init__()
        attn = layer.self_attn
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (_copy_linear(getattr(attn, n)) for n in _ATTN)
        self.n_heads, self.n_kv, self.head_dim = n_heads, n_kv, head_dim
        self.gate = nn.Parameter(torch.zeros(1))

    def forward(self, x: torch.Tensor, summary: torch.Tensor, norm: nn.Module) -> torch.Tensor:
        # x: (N, S, d) normed memory states; summary: (T_s, d) token embeddings
        n, s, _ = x.shape
        kv = norm(summary.to(x.dtype))[None].expand(n, -1, -1)
        q = self.q_proj(x).view(n, s, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(kv).view(n, -1, self.n_kv, self.head_dim).transpose(1, 2)
        v = self.v_proj(kv).view(n, -1, self.n_kv, self.head_dim).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, enable_gqa=True).transpose(1, 2).reshape(n, s, -1)
        return torch.tanh(self.gate).to(x.dtype) * self.o_proj(out)


def _copy_linear(src: nn.Linear) -> nn.Linear:
    out = nn.Linear(src.in_features, src.out_features, bias=src.bias is not None,
                    dtype=src.weight.dtype, device=src.weight.device)
    with torch.no_grad():
        out.weight.copy_(src.weight)
        if src.bias is not None:
            out.bias.copy_(src.bias)
    return out


@dataclass
class Source:
    """What the memory reads of a history: per layer, the actor's keys and values of each block (computed once,
    without gradient: a training row visited again, or a boundary encoded once, reuses it)."""

    keys: list[torch.Tensor]  # per layer (n, kv_heads, B, head_dim), after the rotary embedding
    values: list[torch.Tensor]
    inputs: torch.Tensor  # (n, B, d) the input embeddings of the blocks (zeros after a short block's end)
    lengths: list[int]  # real positions per block (the last block may be short; the rest is padding)

    @property
    def positions(self) -> int:
        return sum(self.lengths)

    @staticmethod
    def cat(sources: list["Source"]) -> "Source":
        """Several histories' blocks as one source (their blocks side by side; each block is read on its own)."""
        return Source([torch.cat(k, 0) for k in zip(*(s.keys for s in sources))],
                      [torch.cat(v, 0) for v in zip(*(s.values for s in sources))],
                      torch.cat([s.inputs for s in sources], 0), [n for s in sources for n in s.lengths])


def _actor_model(actor) -> nn.Module:
    """The HF causal LM of a ``FrozenActor`` (or the model itself)."""
    return actor.model if hasattr(actor, "model") and hasattr(actor, "hidden_size") else actor


class MemoryNetwork(nn.Module):
    """(history ids, summary embeddings) -> the soft span (S, d) in the actor's input-embedding space."""

    def __init__(self, cfg: MemoryConfig, actor):
        super().__init__()
        model = _actor_model(actor)
        base = getattr(model, "model", None)
        if base is None or not hasattr(base, "layers") or not hasattr(base, "rotary_emb"):
            raise ValueError(f"the memory network runs the actor's own decoder layers: {type(model).__name__} "
                             "has no `model.layers` / `model.rotary_emb` (a Llama/Qwen/Mistral-style causal LM)")
        object.__setattr__(self, "_actor", model)  # not a submodule: the memory's state is its own parameters
        self.cfg = cfg
        c = model.config
        self.d = int(c.hidden_size)
        self.n_layers = len(base.layers)
        self.n_heads = int(c.num_attention_heads)
        self.n_kv = int(getattr(c, "num_key_value_heads", None) or self.n_heads)
        self.head_dim = int(getattr(c, "head_dim", None) or self.d // self.n_heads)
        emb = model.get_input_embeddings().weight.detach()
        self.register_buffer("mean_embed", emb.float().mean(0).to(emb.dtype), persistent=False)
        self.register_buffer("embed_norm", emb.float().norm(dim=-1).mean(), persistent=False)
        self.slots = nn.Parameter(torch.zeros(cfg.queries, self.d, dtype=emb.dtype))
        self.merge_slots = nn.Parameter(torch.zeros(cfg.queries, self.d, dtype=emb.dtype))
        self.lora = nn.ModuleList()
        for layer in base.layers:
            mods = {**{n: getattr(layer.self_attn, n) for n in _ATTN},
                    **{n: getattr(layer.mlp, n) for n in ("gate_proj", "up_proj", "down_proj")}}
            self.lora.append(nn.ModuleDict({n: LoRA(mods[n].in_features, mods[n].out_features, cfg.lora_rank,
                                                    cfg.lora_alpha).to(emb.dtype)
                                            for n in cfg.lora_targets}))
        self.readout = nn.Linear(self.d, self.d, bias=False, dtype=emb.dtype)
        with torch.no_grad():
            self.readout.weight.copy_(torch.eye(self.d, dtype=emb.dtype))
        k = min(cfg.summary_layers, self.n_layers)
        self.summary_at = sorted({round((j + 1) * self.n_layers / (k + 1)) for j in range(k)})  # distinct layers
        self.summary_attn = nn.ModuleDict({str(i): GatedSummaryAttention(base.layers[i], self.n_heads, self.n_kv,
                                                                        self.head_dim) for i in self.summary_at})
        if cfg.span_gate:
            self.span_gate = nn.Linear(self.d, 1, dtype=emb.dtype)
            with torch.no_grad():
                self.span_gate.weight.zero_()
                self.span_gate.bias.fill_(cfg.gate_bias)
        self.to(emb.device)

    # -------------------------------------------------------------------------------- the actor's layers

    @property
    def _base(self) -> nn.Module:
        return self._actor.model

    def _proj(self, i: int, name: str, linear: nn.Linear, x: torch.Tensor, adapt: bool) -> torch.Tensor:
        y = linear(x)
        if adapt and name in self.lora[i]:
            y = y + self.lora[i][name](x)
        return y

    def _layer(self, i: int, h: torch.Tensor, rope, mask: torch.Tensor | None, past: tuple | None,
               adapt: bool, summary: torch.Tensor | None = None):
        """One decoder layer of the actor on ``h`` (N, T, d) at positions ``rope`` (cos, sin), attending to
        ``past`` keys/values then its own under ``mask`` (N or 1, 1, T, P + T; True = attend). Returns the new
        states and this call's (keys, values)."""
        layer = self._base.layers[i]
        attn, mlp = layer.self_attn, layer.mlp
        if summary is not None and str(i) in self.summary_attn:
            h = h + self.summary_attn[str(i)](layer.input_layernorm(h), summary, layer.input_layernorm)
        n, t, _ = h.shape
        x = layer.input_layernorm(h)
        q = self._proj(i, "q_proj", attn.q_proj, x, adapt).view(n, t, -1, self.head_dim).transpose(1, 2)
        k = self._proj(i, "k_proj", attn.k_proj, x, adapt).view(n, t, -1, self.head_dim).transpose(1, 2)
        v = self._proj(i, "v_proj", attn.v_proj, x, adapt).view(n, t, -1, self.head_dim).transpose(1, 2)
        if hasattr(attn, "q_norm"):  # Qwen3-style per-head norms
            q, k = attn.q_norm(q), attn.k_norm(k)
        cos, sin = rope
        q, k = _rotate(q, k, cos, sin)
        keys, values = (k, v) if past is None else (torch.cat([past[0], k], 2), torch.cat([past[1], v], 2))
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=attn.scaling, enable_gqa=True)
        h = h + self._proj(i, "o_proj", attn.o_proj, out.transpose(1, 2).reshape(n, t, -1), adapt)
        x = layer.post_attention_layernorm(h)
        gate = self._proj(i, "gate_proj", mlp.gate_proj, x, adapt)
        up = self._proj(i, "up_proj", mlp.up_proj, x, adapt)
        return h + self._proj(i, "down_proj", mlp.down_proj, mlp.act_fn(gate) * up, adapt), (k, v)

    def _rope(self, h: torch.Tensor, positions: torch.Tensor):
        return self._base.rotary_emb(h, positions)

    def _prefill(self, embeds: torch.Tensor) -> Source:
        """The actor's own causal pass over ``embeds`` (S, d) in blocks of B (each from position 0): its keys
        and values per layer. Gradients flow to ``embeds`` when enabled (a merge pass reads soft tokens)."""
        B = self.cfg.block_size
        S = embeds.shape[0]
        n = math.ceil(S / B)
        lengths = [min(B, S - j * B) for j in range(n)]
        h = F.pad(embeds, (0, 0, 0, n * B - S)).view(n, B, -1)
        pos = torch.arange(B, device=h.device)
        rope = self._rope(h, pos[None].expand(n, B))
        causal = (pos[None, :] <= pos[:, None])[None, None]  # pads sit after every real position: never read
        keys, values = [], []
        for i in range(self.n_layers):
            h, (k, v) = self._layer(i, h, rope, causal, None, adapt=False)
            keys.append(k)
            values.append(v)
        return Source(keys, values, F.pad(embeds, (0, 0, 0, n * B - S)).view(n, B, -1), lengths)

    @torch.no_grad()
    def source(self, ids: torch.Tensor) -> Source:
        """What the memory reads of a history ``ids`` (T,): the actor's prefill of each block, no gradient."""
        if ids.dim() != 1 or ids.numel() == 0:
            raise ValueError(f"the history must be a non-empty 1-D tensor of token ids, got shape {tuple(ids.shape)}")
        embed = self._actor.get_input_embeddings()
        return self._prefill(embed(ids.to(embed.weight.device)))

    def _read(self, src: Source, slots: torch.Tensor, summary: torch.Tensor | None) -> torch.Tensor:
        """Q memory tokens per block of ``src`` -> (n * Q, d) final states through the readout, block order kept."""
        Q, B = slots.shape[0], self.cfg.block_size
        n = len(src.lengths)
        dev = slots.device
        lengths = torch.tensor(src.lengths, device=dev)
        i = torch.arange(Q, device=dev)
        pos = ((i[None] + 1) * lengths[:, None] + Q - 1) // Q - 1  # (n, Q): the end of slot i's share
        if self.cfg.slot_input == "share_end":  # the token at the end of the slot's share, as the actor embeds it
            base = torch.gather(src.inputs, 1, pos[:, :, None].expand(n, Q, src.inputs.shape[-1]))
        else:
            base = self.mean_embed[None, None].expand(n, Q, -1)
        h = base + slots[None]
        rope = self._rope(h, pos)
        j = torch.arange(B, device=dev)
        if self.cfg.source_view == "prefix":
            see = j[None, None] <= pos[:, :, None]  # (n, Q, B)
        else:
            see = (j[None, None] < lengths[:, None, None]).expand(n, Q, B)
        mask = torch.cat([see, see.new_ones(n, Q, Q)], -1)[:, None]  # (n, 1, Q, B + Q): slots see each other
        for layer in range(self.n_layers):
            h, _ = self._layer(layer, h, rope, mask, (src.keys[layer], src.values[layer]), adapt=True,
                               summary=summary)
        out = self.readout(self._base.norm(h)).reshape(n * Q, -1)
        return out * (self.embed_norm / out.float().norm(dim=-1, keepdim=True).clamp(min=1e-6)).to(out.dtype)

    # -------------------------------------------------------------------------------- sizes and merges

    def merges(self, n: int) -> list[int]:
        """The hierarchical merges that bring ``n`` first-level soft tokens within ``max_slots``: each entry is
        how many of the oldest tokens one pass reads again (blocks of B -> Q each, order kept), the rest stay.

        A pass merges the fewest oldest tokens that bring the count to exactly ``max_slots`` (the saving of
        merging s tokens, s - ceil(s / B) * Q, grows one by one within a block, so ``max_slots`` is hit
        exactly): the number of soft tokens never decreases as the history grows, and the newest history
        keeps the finest resolution. Only when even merging everything once is not enough is a whole pass
        made first."""
        B, Q, m = self.cfg.block_size, self.cfg.queries, self.cfg.max_slots
        out = []
        while n > m:
            e = n - m
            if n - math.ceil(n / B) * Q < e:  # one pass over everything cannot save enough
                out.append(n)
                n = math.ceil(n / B) * Q
                continue
            k = math.ceil(e / (B - Q))  # the fewest oldest tokens whose merge saves e: in block k, s - k*Q = e
            s_ = e + k * Q
            out.append(s_)
            n = n - s_ + math.ceil(s_ / B) * Q
        return out

    def slots_for(self, positions: int) -> int:
        """How many soft tokens a history of ``positions`` source positions yields (``MemoryConfig.slots_for``)."""
        return self.cfg.slots_for(positions)

    def merge_passes(self, positions: int) -> int:
        return len(self.merges(self.cfg.first_level(positions)))

    def openness(self, span: torch.Tensor) -> torch.Tensor:
        """P(``span`` (S, d) is sent): the gate on its mean / embed_norm, no gradient into the span; 1 without it."""
        if not self.cfg.span_gate:
            return span.new_ones((), dtype=torch.float32)
        x = (span.detach().float().mean(0) / self.embed_norm.float()).to(self.span_gate.weight.dtype)
        return torch.sigmoid(self.span_gate(x).float()).reshape(())

    def sent(self, span: torch.Tensor) -> torch.Tensor:
        """What is sent of ``span``: all of it where the gate is open (openness >= 0.5), else nothing (0, d)."""
        return span if float(self.openness(span)) >= 0.5 else span[:0]

    # -------------------------------------------------------------------------------- forward

    def forward(self, history: torch.Tensor | Source | list, summary: torch.Tensor | None = None,
                min_passes: int = 0) -> torch.Tensor | list[torch.Tensor]:
        """``history``: token ids (T,) or their :meth:`source`; ``summary``: (T_s, d) token embeddings of the
        summary, or None. Returns the soft span (S, d), S = slots_for(T).

        A list of histories (ids or sources, no summary, none needing a merge) is read in one batch: every
        block of every history side by side, the same result as one call each (a training batch of Stage I
        spans); returns the list of their soft spans.

        ``min_passes``: run at least this many merge passes, the extra ones with a zero contribution. Data-
        parallel training sets it to the largest count of any rank this step: ZeRO-3 gathers a module's weights
        with a collective at every call, so all ranks must call the same modules as often."""
        if isinstance(history, list):
            return self._forward_many(history, summary)
        src = history if isinstance(history, Source) else self.source(history)
        if summary is not None and (summary.dim() != 2 or summary.shape[-1] != self.d):
            raise ValueError(f"expected summary embeddings of shape (T, {self.d}), got {tuple(summary.shape)}")
        if summary is not None and summary.shape[0] == 0:
            summary = None
        mem = self._read(src, self.slots, summary)
        if summary is None and torch.is_grad_enabled() and self.summary_at:
            # The same parameters every step on every rank (DDP buckets), with a zero contribution. Through the
            # modules' own calls: under ZeRO-3 a parameter is whole only inside its module's forward.
            x, kv = mem.new_zeros(1, 1, self.d), mem.new_zeros(1, self.d)
            mem = mem + 0.0 * sum(m(x, kv, self._base.layers[int(k)].input_layernorm).sum()
                                  for k, m in self.summary_attn.items())
        passes = 0
        for oldest in self.merges(mem.shape[0]):  # the oldest soft tokens, read again; order preserved
            mem = torch.cat([self._read(self._prefill(mem[:oldest]), self.merge_slots, summary), mem[oldest:]], 0)
            passes += 1
        idle = mem.new_zeros(())
        for _ in range(passes, min_passes):
            idle = idle + 0.0 * self._read(self._prefill(mem[: self.cfg.queries + 1]), self.merge_slots, summary).sum()
        if not passes and torch.is_grad_enabled():
            idle = idle + 0.0 * self.merge_slots.sum()
        return mem + idle + self._gate_idle(mem)

    def _gate_idle(self, mem: torch.Tensor) -> torch.Tensor:
        """The span gate in every step's graph, contributing zero (DDP buckets, ZeRO-3 calls) where no loss reads it."""
        if not (self.cfg.span_gate and torch.is_grad_enabled()):
            return mem.new_zeros(())
        return 0.0 * self.span_gate(mem.new_zeros(1, self.d)).sum()

    def _forward_many(self, histories: list, summary: torch.Tensor | None) -> list[torch.Tensor]:
        if not histories:
            raise ValueError("no histories to read")
        if summary is not None:
            raise ValueError("a batch of histories is read without a summary (one call per history with one)")
        sources = [h if isinstance(h, Source) else self.source(h) for h in histories]
        counts = [len(s.lengths) * self.cfg.queries for s in sources]
        if max(counts) > self.cfg.max_slots:
            raise ValueError(f"a history of {max(counts)} first-level soft tokens needs a merge (max_slots "
                             f"{self.cfg.max_slots}): read it on its own")
        mem = self._read(Source.cat(sources), self.slots, None)
        if torch.is_grad_enabled():  # the same parameters every step (DDP buckets), with a zero contribution
            x, kv = mem.new_zeros(1, 1, self.d), mem.new_zeros(1, self.d)
            mem = mem + 0.0 * (self.merge_slots.sum() + sum(
                m(x, kv, self._base.layers[int(k)].input_layernorm).sum() for k, m in self.summary_attn.items()))
        return list((mem + self._gate_idle(mem)).split(counts, 0))

    # -------------------------------------------------------------------------------- bookkeeping

    def parameter_groups(self) -> dict[str, list[nn.Parameter]]:
        """The optimiser's groups: ``lora``, ``slots``, ``readout``, ``summary`` (gates and their attention),
        ``span_gate``."""
        groups: dict[str, list[nn.Parameter]] = {k: [] for k in ("lora", "slots", "readout", "summary", "span_gate")}
        alias = {"merge_slots": "slots", "summary_attn": "summary"}
        for name, p in self.named_parameters():
            groups[alias.get(name.split(".")[0], name.split(".")[0])].append(p)
        return {k: v for k, v in groups.items() if v}

    def gates(self) -> list[nn.Parameter]:
        return [m.gate for m in self.summary_attn.values()]

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters() if p.requires_grad)

    def actor_parameters(self) -> int:
        return sum(p.numel() for p in self._actor.parameters())

    def train(self, mode: bool = True) -> "MemoryNetwork":
        super().train(mode)
        self._actor.eval()  # the actor's layers stay in eval mode (no dropout) whatever the memory does
        return self


def _rotate(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """The rotary embedding (HF's rotate-half convention) of q, k (N, H, T, D) with cos, sin (N, T, D)."""
    cos, sin = cos[:, None], sin[:, None]

    def half(x):
        return torch.cat([-x[..., x.shape[-1] // 2:], x[..., : x.shape[-1] // 2]], -1)

    return q * cos + half(q) * sin, k * cos + half(k) * sin
