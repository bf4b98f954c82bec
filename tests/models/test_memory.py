import re

import pytest
import torch

from palimpsest.models.memory import MemoryConfig
from palimpsest.models.memory_network import MemoryNetwork
from tests.models.tiny import tiny_actor

VOCAB = 256


@pytest.fixture(scope="module")
def actor():
    return tiny_actor(seed=3)


def net(actor, **kw):
    cfg = MemoryConfig(**{"block_size": 16, "queries": 4, "max_slots": 12, "lora_rank": 4, "summary_layers": 1, **kw})
    torch.manual_seed(0)
    return MemoryNetwork(cfg, actor)


def ids(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (n,), generator=g)


def test_the_source_is_the_actors_own_prefill(actor):
    """The memory reads the actor's own keys and values: the network's prefill (``source``) of a history holds,
    per block of B ids (each from position 0), the keys and values the actor's own forward caches for that block
    alone."""
    m = net(actor)
    x = ids(40)  # three blocks of 16: 16, 16, 8
    src = m.source(x)
    assert src.lengths == [16, 16, 8] and len(src.keys) == m.n_layers
    with torch.no_grad():
        for b, n in enumerate(src.lengths):
            cache = actor.model(input_ids=x[None, 16 * b: 16 * b + n], use_cache=True).past_key_values
            for i in range(m.n_layers):
                k, v = _cached(cache, i)
                assert torch.allclose(src.keys[i][b, :, :n], k[0], atol=1e-5)
                assert torch.allclose(src.values[i][b, :, :n], v[0], atol=1e-5)


def _cached(cache, layer: int):
    """(keys, values) of one layer of a transformers cache, whichever its version's layout."""
    if hasattr(cache, "layers"):
        return cache.layers[layer].keys, cache.layers[layer].values
    return cache[layer]


def test_the_network_holds_only_its_own_parameters_and_the_actor_stays_frozen(actor):
    m = net(actor)
    names = set(m.state_dict())
    assert names and not any(n.startswith(("_actor", "model.")) for n in names)
    assert sum(p.numel() for p in m.parameters()) == m.num_parameters() < m.actor_parameters()
    assert set(m.parameter_groups()) == {"lora", "slots", "readout", "summary", "span_gate"}
    m(ids(20)).sum().backward()
    assert all(p.grad is None for p in actor.parameters())
    m.train()
    assert not actor.model.training


def test_blocks_become_queries_in_order_and_merge_beyond_max_slots(actor):
    m = net(actor)
    assert m(ids(16)).shape == (4, 64)  # one block -> Q tokens
    assert m(ids(40)).shape == (12, 64)  # 3 blocks -> 12 slots = m
    assert m(ids(64)).shape == (m.slots_for(64), 64) == (12, 64) and m.merges(16) == [8]


def test_soft_tokens_never_decrease_as_the_history_grows_and_stay_within_max_slots(actor):
    """The paper's sizes: 1,024-position blocks to 64 soft tokens, at most 4,096 (no cliff past 64 blocks)."""
    import math

    m = net(actor, block_size=1024, queries=64, max_slots=4096)
    lengths = sorted({*range(1, 70 * 1024, 97), 64 * 1024, 64 * 1024 + 1, 10**6, 10**7})
    curve = [m.slots_for(t) for t in lengths]
    assert all(a <= b for a, b in zip(curve, curve[1:])) and max(curve) == 4096
    assert curve[lengths.index(64 * 1024)] == curve[lengths.index(64 * 1024 + 1)] == 4096
    for t in (64 * 1024 + 1, 10**6, 10**7):  # the merges the forward pass makes land exactly on the curve
        n = math.ceil(t / 1024) * 64
        for oldest in m.merges(n):
            n = n - oldest + math.ceil(oldest / 1024) * 64
        assert n == m.slots_for(t) == 4096


def test_a_merge_compresses_the_oldest_history_and_keeps_the_newest_as_it_was(actor):
    m = net(actor)  # B=16, Q=4, max 12: 64 positions = 16 first-level tokens, the oldest 8 merged into 4
    with torch.no_grad():
        x = ids(64)
        y = x.clone()
        y[-8:] = (y[-8:] + 1) % VOCAB  # the newest positions change
        a, b = m(x), m(y)
        assert torch.allclose(a[:4], b[:4], atol=1e-5)  # the merged oldest tokens do not see newer history
        assert not torch.allclose(a[-4:], b[-4:], atol=1e-3)
        z = x.clone()
        z[:8] = (z[:8] + 1) % VOCAB  # the oldest positions change: only the merged head moves
        c = m(z)
        assert torch.allclose(a[4:], c[4:], atol=1e-5) and not torch.allclose(a[:4], c[:4], atol=1e-3)


def test_output_is_in_the_actor_embedding_scale(actor):
    out = net(actor)(ids(20))
    norm = actor.embed_norm()
    assert torch.allclose(out.norm(dim=-1), torch.full((out.shape[0],), norm), atol=1e-4)


def test_order_of_blocks_is_preserved(actor):
    m = net(actor)
    a, b = ids(16, 1), ids(16, 2)
    with torch.no_grad():
        ab, ba = m(torch.cat([a, b])), m(torch.cat([b, a]))
    assert torch.allclose(ab[:4], ba[4:], atol=1e-5) and torch.allclose(ab[4:], ba[:4], atol=1e-5)


def test_at_initialisation_the_slots_differ_and_reversing_the_source_moves_the_memory(actor):
    """Rung 0, on a network as built: the slots of one memory are not copies of each other, and the memory
    depends on the order of what it read. A memory whose slots all start from one input (``slot_input: mean``)
    is the contrast: its slots are far more alike."""
    from palimpsest.evaluation.reconstruction import rung0_passes, slot_stats

    spans = [{"span": ids(16, s)} for s in range(6)]
    stats = slot_stats(actor, net(actor), spans)
    assert rung0_passes(stats), stats
    alike = slot_stats(actor, net(actor, slot_input="mean"), spans)
    assert alike["pairwise_cosine"] > stats["pairwise_cosine"] + 0.1

    class Constant(torch.nn.Module):  # a memory that ignores its input fails rung 0
        def forward(self, source, summary=None, min_passes=0):
            return torch.ones(4, 64) + torch.arange(4.0)[:, None] * torch.linspace(-1, 1, 64)

        def source(self, x):
            return x

    assert not rung0_passes(slot_stats(actor, Constant(), spans))


def test_summary_gate_starts_closed_and_its_gradient_is_not_zero(actor):
    m = net(actor)
    x, summary = ids(20), actor.embed(ids(7, 9)).detach()
    assert torch.equal(m(x, summary), m(x, None))
    m(x, summary).pow(2).sum().backward()
    assert all(float(g.grad.abs()) > 0 for g in m.gates())  # copied attention: a meaningful gradient at once
    with torch.no_grad():
        for g in m.gates():
            g.fill_(1.0)
    assert not torch.allclose(m(x, summary), m(x, None))


def test_lora_starts_as_no_change(actor):
    """B = 0: at initialisation the memory tokens run through the actor's own layers unchanged. Against the same
    network with no adapter at all (the base projections alone), not against itself; a non-zero B changes it."""
    m = net(actor)
    with torch.no_grad():
        adapted = m(ids(20))
        lora, m.lora = m.lora, torch.nn.ModuleList(torch.nn.ModuleDict() for _ in m.lora)
        base = m(ids(20))  # _proj adds nothing where a layer has no adapter
        m.lora = lora
        assert torch.equal(adapted, base)
        for d in m.lora:
            for layer in d.values():
                layer.B.normal_()
        assert not torch.allclose(m(ids(20)), base, atol=1e-4)


@pytest.mark.parametrize("kw,message", [
    ({"queries": 32, "block_size": 16}, "queries (32) must be fewer than block_size (16)"),
    ({"queries": 16, "block_size": 16}, "queries (16) must be fewer than block_size (16)"),
    ({"max_slots": 2}, "max_slots (2) must be at least queries (4)"),
    ({"lora_targets": ["q_proj", "wq"]}, "unknown projections ['wq']"),
])
def test_impossible_sizes_are_refused(actor, kw, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        net(actor, **kw)


def test_unknown_fields_are_refused():
    with pytest.raises(ValueError, match="d_model"):
        MemoryConfig(d_model=192)


def test_bad_input_is_refused(actor):
    m = net(actor)
    with pytest.raises(ValueError, match=r"non-empty 1-D tensor of token ids"):
        m(ids(10)[None])
    with pytest.raises(ValueError, match="non-empty"):
        m(torch.zeros(0, dtype=torch.long))
    with pytest.raises(ValueError, match=r"summary embeddings of shape \(T, 64\)"):
        m(ids(10), torch.randn(3, 32))


def test_every_parameter_gets_a_gradient_whatever_branch_runs(actor):
    # data-parallel gradient reduction needs the same parameters on every rank
    m = net(actor)
    for x, summary in ((ids(10), None), (ids(64), actor.embed(ids(3)).detach())):
        m.zero_grad(set_to_none=True)
        m(x, summary).sum().backward()
        assert all(p.grad is not None for p in m.parameters())


def test_idle_merge_passes_change_nothing(actor):
    m = net(actor)
    x = ids(20)  # 2 blocks -> 8 slots: no merge needed
    assert m.merge_passes(20) == 0 and m.merge_passes(64) == 1
    assert torch.allclose(m(x, None, min_passes=2), m(x), atol=1e-6)


def test_a_precomputed_source_gives_the_same_memory(actor):
    m = net(actor)
    x = ids(40)
    assert torch.equal(m(m.source(x)), m(x))


def test_actor_takes_exactly_one_of_ids_or_embeds_and_stays_frozen():
    actor = tiny_actor()
    x = torch.randint(0, 256, (1, 9))
    with pytest.raises(ValueError, match="exactly one"):
        actor()
    with pytest.raises(ValueError, match="exactly one"):
        actor(input_ids=x, inputs_embeds=actor.embed(x))
    assert torch.allclose(actor(input_ids=x), actor(inputs_embeds=actor.embed(x)), atol=1e-5)
    actor.train()
    assert not actor.model.training and not any(p.requires_grad for p in actor.parameters())


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
