"""REMORY's memory network: what the summary left out, as soft tokens in the actor's input space.

Reads the frozen actor's hidden states of the history, compresses every block of <= B source
positions into Q soft tokens with learnable queries (a Perceiver-style resampler), lets those tokens
look at the summary's token embeddings through a gated cross-attention whose gate starts closed (so
training starts from "memory knows nothing the summary does not"), and merges hierarchically when the
history needs more than m slots. The output lives in the actor's input-embedding space, each vector
scaled to the mean norm of the actor's token embeddings, and reaches the actor only via inputs_embeds.

Everything is sized by :class:`MemoryConfig`: the same file trains a few-million-parameter network on
CPUs and a billion-parameter one on GPUs.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class MemoryConfig:
    d_actor: int  # the actor's hidden size: the features' width and the output embedding width
    d_model: int = 256  # the memory network's own width
    n_heads: int = 4
    n_layers: int = 2  # resampler blocks (cross-attention to the source, then self-attention + MLP)
    block_size: int = 1024  # B: source positions per block
    queries: int = 64  # Q: soft tokens per block
    max_slots: int = 4096  # m: most soft tokens for one history; more blocks are merged hierarchically
    feature_layer: int = -1  # which hidden state of the actor to read (-1 = last)
    mlp_ratio: int = 4
    dropout: float = 0.0
    learn_scale: bool = False  # a learned gain on the soft vectors' norm (starts at the token embeddings' mean norm)
    slot_embedding: bool = False  # a learned embedding of each soft position's index (starts at 0: no change)
    slot_bias: bool = False  # a learned vector per soft position in the actor's input space (starts at 0: no change)
    feature_skip: bool = False  # each soft position also carries the mean of the features of its share of the source
    skip_init: str = "identity"  # the skip's map at the start: "identity" (the pooled states as they are) or "zero"
    skip_pool: str = "mean"  # how a share is pooled: "mean", or "attention" (a learned score per state, 0 at start)

    def __post_init__(self) -> None:
        problems = []
        if self.queries > self.block_size:
            problems.append(f"queries ({self.queries}) must not exceed block_size ({self.block_size})")
        elif self.queries == self.block_size:
            problems.append(f"queries ({self.queries}) must be fewer than block_size ({self.block_size}): "
                            "a merge must shrink the memory")
        if self.max_slots < self.queries:
            problems.append(f"max_slots ({self.max_slots}) must be at least queries ({self.queries})")
        if self.d_model % self.n_heads:
            problems.append(f"d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads})")
        for name in ("d_actor", "d_model", "n_heads", "n_layers", "block_size", "queries", "max_slots", "mlp_ratio"):
            if getattr(self, name) < 1:
                problems.append(f"{name} must be >= 1")
        if self.skip_pool not in ("mean", "attention"):
            problems.append(f"skip_pool must be 'mean' or 'attention', got {self.skip_pool!r}")
        if self.skip_init not in ("identity", "zero"):
            problems.append(f"skip_init must be 'identity' or 'zero', got {self.skip_init!r}")
        if problems:
            raise ValueError("invalid memory config: " + "; ".join(problems))

    def to_dict(self) -> dict:
        return asdict(self)


def _unit(x: torch.Tensor) -> torch.Tensor:
    return x / x.norm(dim=-1, keepdim=True).clamp(min=1e-6)


class _Block(nn.Module):
    """Queries attend to a source, then to each other, then an MLP (pre-norm, residual)."""

    def __init__(self, cfg: MemoryConfig):
        super().__init__()
        d = cfg.d_model
        self.norm_q, self.norm_kv = nn.LayerNorm(d), nn.LayerNorm(d)
        self.cross = nn.MultiheadAttention(d, cfg.n_heads, dropout=cfg.dropout, batch_first=True)
        self.norm_self = nn.LayerNorm(d)
        self.self_attn = nn.MultiheadAttention(d, cfg.n_heads, dropout=cfg.dropout, batch_first=True)
        self.norm_mlp = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, cfg.mlp_ratio * d), nn.GELU(), nn.Linear(cfg.mlp_ratio * d, d))

    def forward(self, q: torch.Tensor, src: torch.Tensor, src_pad: torch.Tensor | None) -> torch.Tensor:
        # q: (N, Q, d); src: (N, L, d); src_pad: (N, L) True where padding
        kv = self.norm_kv(src)
        q = q + self.cross(self.norm_q(q), kv, kv, key_padding_mask=src_pad, need_weights=False)[0]
        h = self.norm_self(q)
        q = q + self.self_attn(h, h, h, need_weights=False)[0]
        return q + self.mlp(self.norm_mlp(q))


class GatedSummaryAttention(nn.Module):
    """Soft tokens read the summary; tanh(gate) starts at 0, so at init the summary changes nothing."""

    def __init__(self, cfg: MemoryConfig):
        super().__init__()
        self.proj = nn.Linear(cfg.d_actor, cfg.d_model)
        self.norm_q, self.norm_kv = nn.LayerNorm(cfg.d_model), nn.LayerNorm(cfg.d_model)
        self.attn = nn.MultiheadAttention(cfg.d_model, cfg.n_heads, dropout=cfg.dropout, batch_first=True)
        self.gate = nn.Parameter(torch.zeros(1))

    def forward(self, q: torch.Tensor, summary: torch.Tensor | None) -> torch.Tensor:
        # q: (1, S, d); summary: (T_s, d_actor) token embeddings of the summary
        present = summary is not None and summary.shape[0] > 0
        if not present:
            if not torch.is_grad_enabled():
                return q
            # No summary: run the same modules on one zero token and add nothing. Every rank then uses
            # the same parameters in the same order, which ZeRO-3's gathering and data-parallel gradient
            # reduction require (a rank that skipped this branch would send differently sized buckets).
            summary = q.new_zeros(1, self.proj.in_features)
        kv = self.norm_kv(self.proj(summary.to(q.dtype)))[None]  # (1, T_s, d)
        read = torch.tanh(self.gate) * self.attn(self.norm_q(q), kv, kv, need_weights=False)[0]
        return q + (read if present else 0.0 * read)


class MemoryNetwork(nn.Module):
    def __init__(self, cfg: MemoryConfig, embed_norm: float = 1.0):
        super().__init__()
        self.cfg = cfg
        d = cfg.d_model
        self.in_proj = nn.Linear(cfg.d_actor, d)
        self.queries = nn.Parameter(torch.randn(cfg.queries, d) / math.sqrt(d))  # (Q, d)
        self.merge_queries = nn.Parameter(torch.randn(cfg.queries, d) / math.sqrt(d))  # for hierarchical merges
        self.pos = nn.Parameter(torch.zeros(cfg.block_size, d))  # position within a block
        self.blocks = nn.ModuleList(_Block(cfg) for _ in range(cfg.n_layers))
        self.summary_attn = GatedSummaryAttention(cfg)
        self.out_norm = nn.LayerNorm(d)
        self.out_proj = nn.Linear(d, cfg.d_actor)
        # Soft tokens land where real token embeddings live: same mean norm (a constant of the actor).
        self.register_buffer("embed_norm", torch.tensor(float(embed_norm)))
        if cfg.learn_scale:  # the log of a learned gain over embed_norm
            self.log_scale = nn.Parameter(torch.zeros(1))
        if cfg.slot_embedding:  # which soft position a token is: the blocks share their queries, not their place
            self.slot_pos = nn.Parameter(torch.zeros(cfg.max_slots, d))
        if cfg.slot_bias:  # a free vector per soft position beside the network's output: the free span is its special case
            self.slot_bias = nn.Parameter(torch.zeros(cfg.max_slots, cfg.d_actor))
        if cfg.feature_skip:  # the actor's own states of the source, pooled per soft position, through a learned map
            self.skip = nn.Linear(cfg.d_actor, cfg.d_actor, bias=False)
            with torch.no_grad():  # identity: the pooled states as they are; zero: the term starts silent
                self.skip.weight.copy_(torch.eye(cfg.d_actor) if cfg.skip_init == "identity"
                                       else torch.zeros(cfg.d_actor, cfg.d_actor))
            if cfg.skip_pool == "attention":  # a score per state within its share: 0 at the start, so the mean
                self.skip_score = nn.Parameter(torch.zeros(cfg.d_actor))

    def _resample(self, src: torch.Tensor, queries: torch.Tensor) -> torch.Tensor:
        """(L, d) source -> (ceil(L / B) * Q, d): every block of <= B positions becomes Q tokens, in order."""
        B, Q = self.cfg.block_size, queries.shape[0]
        n = math.ceil(src.shape[0] / B)
        pad = n * B - src.shape[0]
        blocks = F.pad(src, (0, 0, 0, pad)).view(n, B, -1) + self.pos[None]  # (n, B, d)
        mask = torch.zeros(n * B, dtype=torch.bool, device=src.device)
        if pad:
            mask[-pad:] = True
        mask = mask.view(n, B)  # (n, B) True = padding
        q = queries[None].expand(n, Q, -1)  # (n, Q, d)
        for block in self.blocks:
            q = block(q, blocks, mask)
        return q.reshape(n * Q, -1)  # (n*Q, d), block order kept

    def merges(self, n: int) -> list[int]:
        """The hierarchical merges that bring ``n`` first-level soft tokens within ``max_slots``: each entry is
        how many of the oldest tokens one pass resamples (blocks of B -> Q each, order kept), the rest stay.

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
            # the fewest oldest tokens whose merge saves e: within the k-th block the saving is s - k * Q
            k = math.ceil(e / (B - Q))
            s_ = e + k * Q  # in block k: s - k*Q = e, with (k-1)*B < s <= k*B
            out.append(s_)
            n = n - s_ + math.ceil(s_ / B) * Q
        return out

    def slots_for(self, positions: int) -> int:
        """How many soft tokens a history of ``positions`` source positions yields: one block of B positions
        gives Q tokens, up to ``max_slots`` (never fewer for a longer history)."""
        B, Q, m = self.cfg.block_size, self.cfg.queries, self.cfg.max_slots
        return min(math.ceil(max(positions, 1) / B) * Q, m)

    def merge_passes(self, positions: int) -> int:
        """How many hierarchical merges a history of ``positions`` source positions needs."""
        B, Q = self.cfg.block_size, self.cfg.queries
        return len(self.merges(math.ceil(max(positions, 1) / B) * Q))

    def forward(self, features: torch.Tensor, summary: torch.Tensor | None = None, min_passes: int = 0) -> torch.Tensor:
        """features: (T, d_actor) actor hidden states of the history; summary: (T_s, d_actor) token
        embeddings of the summary, or None. Returns the soft span (S, d_actor), S = slots_for(T).

        ``min_passes``: run at least this many merge passes, the extra ones on a dummy block with a
        zero contribution. Data-parallel training sets it to the largest count of any rank this step,
        because ZeRO-3 gathers a module's weights with a collective at every call: all ranks must call
        the same modules the same number of times."""
        if features.dim() != 2 or features.shape[-1] != self.cfg.d_actor:
            raise ValueError(f"expected features of shape (T, {self.cfg.d_actor}), got {tuple(features.shape)}")
        if features.shape[0] == 0:
            raise ValueError("the history is empty: there is nothing to remember")
        x = self.in_proj(features.to(self.in_proj.weight.dtype))  # (T, d)
        mem = self._resample(x, self.queries)  # (ceil(T/B)*Q, d)
        passes = 0
        for oldest in self.merges(mem.shape[0]):  # hierarchical merge of the oldest tokens, order preserved
            mem = torch.cat([self._resample(mem[:oldest], self.merge_queries), mem[oldest:]], 0)
            passes += 1
        idle = mem.new_zeros(())
        for _ in range(passes, min_passes):  # keep collective calls in step across ranks (see above)
            idle = idle + 0.0 * self._resample(mem[:1], self.merge_queries).sum()
        if getattr(self.cfg, "slot_embedding", False):  # (bundles pickled before the option lack it)
            mem = mem + self.slot_pos[: mem.shape[0]]
        mem = self.summary_attn(mem[None], summary)[0]  # (S, d)
        out = self.out_proj(self.out_norm(mem))  # (S, d_actor)
        skip, bias = getattr(self.cfg, "feature_skip", False), getattr(self.cfg, "slot_bias", False)
        if skip or bias:  # terms in the actor's input space, each of unit norm at the start (the network's too),
            out = _unit(out)  # so a per-position vector moves as fast as the ladder's free span does
            if skip:
                out = out + self.skip(_unit(self._pooled(features.to(out.dtype), out.shape[0])))
            if bias:
                out = out + self.slot_bias[: out.shape[0]]
        out = out * (self.embed_norm / out.norm(dim=-1, keepdim=True).clamp(min=1e-6))
        if self.cfg.learn_scale:
            out = out * self.log_scale.exp()
        # Data-parallel ranks reduce the gradients of the same parameters in the same buckets: a branch
        # one rank skipped (no merge here, no summary in GatedSummaryAttention) still joins the graph,
        # with a zero contribution.
        if not passes and torch.is_grad_enabled():
            out = out + 0.0 * self.merge_queries.sum()
        return out + idle

    def _pooled(self, features: torch.Tensor, slots: int) -> torch.Tensor:
        """(T, d_actor) -> (slots, d_actor): a pool of each of ``slots`` contiguous, near-equal shares of the
        source, in order: their mean (``skip_pool: mean``) or a softmax of a learned score of each state within
        its share (``attention``; the score starts at zero, which is the mean). The actor's last hidden state is what it would feed back
        as its next input (Coconut's continuous thought), so each soft position starts as its share of the source
        in the actor's own terms, and the network learns what to add."""
        dtype, features = features.dtype, features.float()  # differences of running sums: in fp32 even under bf16
        T = features.shape[0]
        k = torch.arange(slots, device=features.device)
        start = k * T // slots
        end = torch.maximum((k + 1) * T // slots, start + 1).clamp(max=T)  # a short source: shares overlap, never empty
        start = torch.minimum(start, end - 1)
        if getattr(self.cfg, "skip_pool", "mean") == "attention":  # softmax of a learned score within each share
            i = torch.arange(T, device=features.device)
            inside = (i[None] >= start[:, None]) & (i[None] < end[:, None])  # (slots, T)
            scores = (features @ self.skip_score.float()).expand(slots, T).masked_fill(~inside, float("-inf"))
            return (torch.softmax(scores, -1) @ features).to(dtype)
        sums = torch.cat([features.new_zeros(1, features.shape[1]), features.cumsum(0)])
        return ((sums[end] - sums[start]) / (end - start)[:, None].float()).to(dtype)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters() if p.requires_grad)
