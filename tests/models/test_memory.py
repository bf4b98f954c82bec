import re

import pytest
import torch

from palimpsest.models.memory import MemoryConfig, MemoryNetwork
from tests.models.tiny import tiny_actor


def net(**kw):
    cfg = MemoryConfig(**{"d_actor": 64, "d_model": 32, "n_heads": 4, "n_layers": 1, "block_size": 16,
                          "queries": 4, "max_slots": 12, **kw})
    torch.manual_seed(0)
    return MemoryNetwork(cfg, embed_norm=2.5)


def test_blocks_become_queries_in_order_and_merge_beyond_max_slots():
    m = net()
    assert m(torch.randn(16, 64)).shape == (4, 64)  # one block -> Q tokens
    assert m(torch.randn(40, 64)).shape == (12, 64)  # 3 blocks -> 12 slots = m
    long = m(torch.randn(64, 64))  # 4 blocks = 16 slots > m=12: the oldest 8 merged into 4
    assert long.shape == (m.slots_for(64), 64) == (12, 64) and m.merges(16) == [8]


def test_soft_tokens_never_decrease_as_the_history_grows_and_stay_within_max_slots():
    """The paper's sizes: 1,024-position blocks to 64 soft tokens, at most 4,096 (no cliff past 64 blocks)."""
    import math

    m = net(block_size=1024, queries=64, max_slots=4096, d_actor=8, d_model=8, n_heads=2)
    lengths = sorted({*range(1, 70 * 1024, 97), 64 * 1024, 64 * 1024 + 1, 10**6, 10**7})
    curve = [m.slots_for(t) for t in lengths]
    assert all(a <= b for a, b in zip(curve, curve[1:])) and max(curve) == 4096
    assert curve[lengths.index(64 * 1024)] == curve[lengths.index(64 * 1024 + 1)] == 4096
    for t in (64 * 1024 + 1, 10**6, 10**7):  # the merges the forward pass makes land exactly on the curve
        n = math.ceil(t / 1024) * 64
        for oldest in m.merges(n):
            n = n - oldest + math.ceil(oldest / 1024) * 64
        assert n == m.slots_for(t) == 4096
    with torch.no_grad():
        assert m(torch.randn(64 * 1024 + 1, 8)).shape == (4096, 8)


def test_a_merge_compresses_the_oldest_history_and_keeps_the_newest_as_it_was():
    m = net()  # B=16, Q=4, max 12: 64 positions = 16 first-level tokens, the oldest 8 merged into 4
    with torch.no_grad():
        x = torch.randn(64, 64)
        y = x.clone()
        y[-8:] += 1.0  # the newest positions change
        a, b = m(x), m(y)
        assert torch.allclose(a[:4], b[:4], atol=1e-6)  # the merged oldest tokens do not see newer history
        assert not torch.allclose(a[-4:], b[-4:], atol=1e-3)
        z = x.clone()
        z[:8] += 1.0  # the oldest positions change: only the merged head moves
        c = m(z)
        assert torch.allclose(a[4:], c[4:], atol=1e-6) and not torch.allclose(a[:4], c[:4], atol=1e-3)


def test_output_is_in_the_actor_embedding_scale():
    out = net()(torch.randn(20, 64) * 7)
    assert torch.allclose(out.norm(dim=-1), torch.full((out.shape[0],), 2.5), atol=1e-4)


def test_order_of_blocks_is_preserved():
    m = net()
    a, b = torch.randn(16, 64), torch.randn(16, 64)
    ab, ba = m(torch.cat([a, b])), m(torch.cat([b, a]))
    assert torch.allclose(ab[:4], ba[4:], atol=1e-5) and torch.allclose(ab[4:], ba[:4], atol=1e-5)


def test_summary_gate_starts_closed():
    m = net()
    feats, summary = torch.randn(20, 64), torch.randn(7, 64)
    assert torch.equal(m(feats, summary), m(feats, None))
    with torch.no_grad():
        m.summary_attn.gate.fill_(1.0)
    assert not torch.allclose(m(feats, summary), m(feats, None))


@pytest.mark.parametrize("kw,message", [
    ({"queries": 32, "block_size": 16}, "queries (32) must not exceed block_size (16)"),
    ({"max_slots": 2}, "max_slots (2) must be at least queries (4)"),
    ({"d_model": 30}, "divisible by n_heads"),
])
def test_impossible_sizes_are_refused(kw, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        net(**kw)


def test_bad_features_are_refused():
    with pytest.raises(ValueError, match=r"expected features of shape \(T, 64\)"):
        net()(torch.randn(5, 32))
    with pytest.raises(ValueError, match="empty"):
        net()(torch.randn(0, 64))


def test_actor_takes_exactly_one_of_ids_or_embeds_and_stays_frozen():
    actor = tiny_actor()
    ids = torch.randint(0, 256, (1, 9))
    with pytest.raises(ValueError, match="exactly one"):
        actor()
    with pytest.raises(ValueError, match="exactly one"):
        actor(input_ids=ids, inputs_embeds=actor.embed(ids))
    assert torch.allclose(actor(input_ids=ids), actor(inputs_embeds=actor.embed(ids)), atol=1e-5)
    actor.train()
    assert not actor.model.training and not any(p.requires_grad for p in actor.parameters())


def test_every_parameter_gets_a_gradient_whatever_branch_runs():
    # data-parallel gradient reduction needs the same parameters on every rank
    m = net()
    for feats, summary in ((torch.randn(10, 64), None), (torch.randn(64, 64), torch.randn(3, 64))):
        m.zero_grad(set_to_none=True)
        m(feats, summary).sum().backward()
        assert all(p.grad is not None for p in m.parameters())


def test_idle_merge_passes_change_nothing():
    m = net()
    feats = torch.randn(20, 64)  # 2 blocks -> 8 slots: no merge needed
    assert m.merge_passes(20) == 0 and m.merge_passes(64) == 1
    assert torch.allclose(m(feats, None, min_passes=2), m(feats), atol=1e-6)


def test_a_shared_prefill_gives_the_logits_of_a_whole_forward_and_is_left_as_it_was():
    """The shadow lane prefills a reference once and continues several replies from it: the logits must be those
    of one forward over reference + reply, and the cache must be cut back after each continuation."""
    actor = tiny_actor(seed=5)
    ref = torch.randint(0, 256, (40,))
    past, last = actor.prefill(ref)
    for reply in (torch.randint(0, 256, (6,)), torch.randint(0, 256, (3,))):
        whole = actor(input_ids=torch.cat([ref, reply])[None], last=len(reply) + 1)[0, :len(reply)]
        shared = torch.cat([last[None], actor.continue_from(past, len(ref), reply[:-1])])
        assert torch.allclose(shared, whole, atol=1e-4), (shared - whole).abs().max()
        assert past.get_seq_length() == len(ref)


def test_a_slot_embedding_starts_as_no_change_and_tells_blocks_of_the_same_content_apart():
    """The blocks of a history share their queries, so two blocks of the same content give the same soft
    tokens; a slot embedding (zero at the start) lets each soft position have its own, and is trained with
    every other parameter (the learnability ladder's rung 1 found the shared queries a limit)."""
    block = torch.randn(16, 64)
    feats = torch.cat([block, block])  # two blocks, one content
    plain, slotted = net(), net(slot_embedding=True)
    assert torch.equal(plain(feats), slotted(feats))  # zero at the start: nothing changes
    out = plain(feats)
    assert torch.allclose(out[:4], out[4:], atol=1e-6)  # shared queries: the same tokens twice
    with torch.no_grad():
        slotted.slot_pos.normal_()
    out = slotted(feats)
    assert not torch.allclose(out[:4], out[4:], atol=1e-3)
    slotted(feats).sum().backward()
    assert slotted.slot_pos.grad is not None and slotted.slot_pos.grad[:8].abs().sum() > 0


def test_a_slot_bias_starts_as_no_change_and_is_a_free_vector_per_position():
    """The ladder's rung 1 found free vectors in the memory's positions close 97% of the gap where the network
    closed 73%; a per-position vector in the actor's input space beside the network makes that a special case."""
    feats = torch.randn(24, 64)  # 2 blocks: 8 of the 12 positions
    plain, biased = net(), net(slot_bias=True)
    assert torch.allclose(plain(feats), biased(feats), atol=1e-6)  # zero at the start
    with torch.no_grad():
        biased.slot_bias.normal_(std=100.0)  # a bias far larger than the network's output decides the direction
    out = biased(feats)
    want = biased.slot_bias[: out.shape[0]]
    cos = torch.nn.functional.cosine_similarity(out, want, dim=-1)
    assert cos.min() > 0.99
    assert torch.allclose(out.norm(dim=-1), torch.full((out.shape[0],), biased.embed_norm.item()), atol=1e-4)
    biased(feats).sum().backward()
    assert biased.slot_bias.grad[: out.shape[0]].abs().sum() > 0
    assert out.shape[0] == 8 and biased.slot_bias.grad[8:].abs().sum() == 0  # positions not used get nothing


def test_the_feature_skip_carries_each_share_of_the_source_in_order():
    """Each soft position carries the mean of its share of the source, so two sources that differ only in one
    share give soft spans that differ most where that share lands; a short source still gives no empty share."""
    n = net(feature_skip=True)
    with torch.no_grad():  # silence the network's own path: what remains is the skip
        n.out_proj.weight.zero_()
        n.out_proj.bias.zero_()
    a = torch.randn(32, 64)
    b = a.clone()
    b[-8:] = torch.randn(8, 64)  # only the last quarter differs
    out_a, out_b = n(a), n(b)
    S = out_a.shape[0]
    diff = (out_a - out_b).norm(dim=-1)
    assert diff[: S * 3 // 4].max() < 1e-5 and diff[S * 3 // 4:].min() > 1e-2
    share = a[: 32 // S].mean(0)
    assert torch.allclose(out_a[0] / out_a[0].norm(), share / share.norm(), atol=1e-5)
    short = n(torch.randn(2, 64))  # fewer positions than soft tokens
    assert torch.isfinite(short).all() and short.shape[0] == n.slots_for(2)
    n(a).sum().backward()
    assert n.skip.weight.grad is not None and n.skip.weight.grad.abs().sum() > 0


def test_a_skip_that_starts_at_zero_is_no_change_and_still_learns():
    """The ladder's rung 2 found the identity start puts the span 0.20 nats further from the teacher than the
    network alone; ``skip_init="zero"`` starts the term silent: the network's own span, and a gradient to grow."""
    feats = torch.randn(24, 64)
    plain, zero, ident = net(), net(feature_skip=True, skip_init="zero"), net(feature_skip=True)
    assert torch.allclose(plain(feats), zero(feats), atol=1e-5)  # the network's span, unchanged
    assert not torch.allclose(plain(feats), ident(feats), atol=1e-3)  # identity: the pooled states join it
    loss = (zero(feats) * torch.randn(zero.slots_for(24), 64)).sum()
    loss.backward()
    assert zero.skip.weight.grad.abs().sum() > 0
    with pytest.raises(ValueError, match="skip_init"):
        net(feature_skip=True, skip_init="eye")


def test_attention_pooling_starts_as_the_mean_and_learns_to_pick_a_state_within_its_share():
    """``skip_pool="attention"``: a learned score per state, softmax within each share; zero at the start, so
    the span is the mean pooling's; a score that prefers one state makes its share carry that state."""
    feats = torch.randn(32, 64)
    mean, att = net(feature_skip=True), net(feature_skip=True, skip_pool="attention")
    assert torch.allclose(mean(feats), att(feats), atol=1e-5)
    S = att.slots_for(32)
    pooled = att._pooled(feats, S)
    (pooled * torch.randn_like(pooled)).sum().backward()
    assert att.skip_score.grad.abs().sum() > 0
    with torch.no_grad():
        att.skip_score.copy_(feats[5] * 50.0)  # state 5 scores far above the others of its share
    share = 32 // S
    assert torch.allclose(att._pooled(feats, S)[5 // share], feats[5], atol=1e-3)
    with pytest.raises(ValueError, match="skip_pool"):
        net(feature_skip=True, skip_pool="max")
