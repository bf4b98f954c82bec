import pytest
import torch

from palimpsest.models.memory import MemoryConfig
from palimpsest.models.memory_network import MemoryNetwork
from palimpsest.training.losses import (
    position_weights,
    reverse_kl,
    stage1_loss,
    stage2_loss,
    stage2_student,
    student_logits,
    teacher_logits,
)
from palimpsest.training.step import LocalBackend, TrainStep, init_stage2_from_stage1
from tests.models.tiny import tiny_actor


def memnet(actor, seed=0, **kw):
    """A tiny memory network; without the span gate unless asked (the loss's other parts are under test)."""
    torch.manual_seed(seed)
    cfg = MemoryConfig(**{"block_size": 16, "queries": 4, "max_slots": 16, "lora_rank": 4, "summary_layers": 1,
                          "span_gate": False, **kw})
    return MemoryNetwork(cfg, actor)


def sample2(seed=1):
    g = torch.Generator().manual_seed(seed)
    teacher = torch.randint(0, 256, (40,), generator=g)
    context = torch.cat([teacher[:4], torch.randint(0, 256, (3,), generator=g)])  # the prefix, a summary line
    return {"teacher": teacher, "memory": teacher[4:30], "summary": context, "context": context,
            "bridge": teacher[30:], "target": torch.randint(0, 256, (8,), generator=g)}


def test_gradient_reaches_the_memory_network_and_not_the_actor():
    actor = tiny_actor()
    net = memnet(actor)
    before = {k: v.clone() for k, v in actor.state_dict().items()}
    loss = stage2_loss(net, actor, sample2())
    loss.backward()
    assert all(p.grad is None for p in actor.parameters())
    grads = [p.grad for p in net.parameters() if p.grad is not None]
    assert grads and sum(float(g.abs().sum()) for g in grads) > 0
    assert net.slots.grad is not None and net.readout.weight.grad.abs().sum() > 0
    assert all(lora.B.grad.abs().sum() > 0 for d in net.lora for lora in d.values())
    TrainStep(LocalBackend(net, lr=1e-3), actor)(sample2(), stage=2)
    assert all(torch.equal(before[k], v) for k, v in actor.state_dict().items())


def test_kl_is_zero_when_the_student_sees_the_teachers_input():
    actor = tiny_actor()
    s = sample2()
    p = teacher_logits(actor, s)
    q = student_logits(actor, actor.embed(s["teacher"]), s["target"])
    w = position_weights(s["target"].shape[0])
    assert float(reverse_kl(q, p, w)) < 1e-6
    other = student_logits(actor, actor.embed(s["summary"]), s["target"])
    assert float(reverse_kl(other, p, w)) > 1e-3


def test_stage2_on_a_cached_teacher_is_the_full_loss_when_the_cache_keeps_every_token():
    """The cached teacher (top-k + tail) gives the full-vocabulary loss when k is the vocabulary, a lower
    bound below it, and its gradient reaches the memory network."""
    from palimpsest.training.teachers import compute_teacher

    actor = tiny_actor()
    net = memnet(actor)
    s = sample2()
    full = stage2_loss(net, actor, s)
    vocab = int(actor.model.config.vocab_size)
    every = stage2_loss(net, actor, s,
                        teacher=compute_teacher(actor, s["teacher"].tolist(), s["target"].tolist(), vocab))
    assert float(every) == pytest.approx(float(full), rel=1e-4)
    coarse = stage2_loss(net, actor, s, teacher=compute_teacher(actor, s["teacher"].tolist(), s["target"].tolist(), 4))
    assert 0 < float(coarse) <= float(full) + 1e-6
    coarse.backward()
    assert net.readout.weight.grad is not None and float(net.readout.weight.grad.abs().sum()) > 0


def test_the_loss_is_the_reverse_kl_of_the_student_from_the_teacher():
    """KL(q || p) with q the student: for p = (0.9, 0.1) and q = (0.5, 0.5) it is 0.5108 nats, where the
    forward direction KL(p || q) would be 0.3681 (figures computed by hand, not by the code under test)."""
    p = torch.log(torch.tensor([[0.9, 0.1]]))
    q = torch.log(torch.tensor([[0.5, 0.5]]))
    w = torch.ones(1)
    assert float(reverse_kl(q, p, w)) == pytest.approx(0.5108, abs=1e-3)
    assert float(reverse_kl(p, q, w)) == pytest.approx(0.3681, abs=1e-3)
    # weights weigh positions: two positions, the second identical in both, weighted 0.25 / 0.75
    two_q, two_p = torch.cat([q, p]), torch.cat([p, p])
    assert float(reverse_kl(two_q, two_p, torch.tensor([0.25, 0.75]))) == pytest.approx(0.25 * 0.5108, abs=1e-3)


def test_position_weights_sum_to_one_and_favour_early_tokens_gently():
    w = position_weights(20)
    assert abs(float(w.sum()) - 1) < 1e-6 and (w[:-1] > w[1:]).all() and float(w[0] / w[-1]) < 2.5


def test_stage1_learns_to_reconstruct_and_stage2_starts_from_it():
    actor = tiny_actor()
    net = memnet(actor)
    g = torch.Generator().manual_seed(3)
    batch = [{"span": torch.randint(0, 256, (12,), generator=g), "instruction": torch.tensor([5, 6, 7])}]
    step = TrainStep(LocalBackend(net, lr=3e-3), actor, continuation=0.25)
    first = float(stage1_loss(net, actor, batch[0]).detach())
    for _ in range(40):
        step(batch[0], stage=1)
    # A random tiny actor barely listens to its input, yet the memory already moves it (seeded, exact)
    assert float(stage1_loss(net, actor, batch[0]).detach()) < first - 0.05
    stage2 = memnet(actor, seed=99)
    init_stage2_from_stage1(stage2, net.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(stage2.state_dict().values(), net.state_dict().values()))


def test_the_tail_mass_of_a_peaked_teacher_is_exact():
    """A confident teacher: 1 - sum(top-k) rounds to 0 in float32; the tail is a logsumexp over the rest."""
    from palimpsest.training.teachers import coarse_kl, teacher_of

    logits = torch.full((1, 1000), -20.0)
    logits[0, 0] = 20.0  # p(top) ~ 1 - 1e-15: the other 999 tokens carry ~4.2e-15 in all
    t = teacher_of(logits, 4)
    exact = torch.log_softmax(logits.double(), -1)[0, 4:].logsumexp(-1)
    assert float(t.tail[0]) == pytest.approx(float(exact), abs=1e-3)
    # a student that agrees pays (almost) nothing; one that puts mass on the tail pays for it
    assert float(coarse_kl(logits, t)[0]) == pytest.approx(0.0, abs=1e-6)
    flat = torch.zeros((1, 1000))
    assert float(coarse_kl(flat, t)[0]) > 5.0


def _whole_prefix_loss(net, actor, s):
    """The Stage II loss with the student's whole input in one forward: [context; memory; bridge; target]."""
    from palimpsest.training.losses import memory_of

    mem = memory_of(net, actor, s["memory"], s["summary"])
    q = student_logits(actor, torch.cat([actor.embed(s["context"]), mem, actor.embed(s["bridge"])]), s["target"])
    return reverse_kl(q, teacher_logits(actor, s), position_weights(s["target"].shape[0]))


def test_the_prefilled_context_gives_the_whole_forwards_loss_and_gradient():
    """Stage II prefills the context without a graph (kept per row by a PrefixCache): the loss and every
    gradient of the memory network equal those of one forward over the whole student input."""
    from palimpsest.training.step import PrefixCache

    actor = tiny_actor()
    net = memnet(actor)
    s = sample2()
    whole = _whole_prefix_loss(net, actor, s)
    whole.backward()
    expected = {k: p.grad.clone() for k, p in net.named_parameters() if p.grad is not None}
    cache = PrefixCache(rows=1)  # one row: its context and the actor's prefill of what the memory reads
    for visit in range(2):  # the second visit reads the cached context and features
        net.zero_grad(set_to_none=True)
        loss = stage2_loss(net, actor, s, prefix=cache)
        loss.backward()
        # float noise of two orders of summation
        assert float(loss.detach()) == pytest.approx(float(whole.detach()), rel=1e-5, abs=1e-7)
        for k, g in expected.items():
            assert torch.allclose(net.get_parameter(k).grad, g, atol=1e-7, rtol=1e-4), (visit, k)
    assert (cache.hits, cache.misses) == (2, 2)


def test_a_step_reports_the_gradient_of_every_module_and_the_gate():
    """What a run that does not learn needs to show: each module's gradient norm and the summary gate."""
    from palimpsest.training.step import LocalBackend, TrainStep, module_groups

    actor = tiny_actor()
    net = memnet(actor)
    step = TrainStep(LocalBackend(net, lr={"lora": 1e-3, "slots": 1e-2, "readout": 1e-4, "summary": 1e-3}), actor)
    assert all(float(g) == 0.0 for g in net.gates())  # the gates start closed
    first = step(sample2(), stage=2)
    assert set(f"grad/{m}" for m in module_groups(net)) == {"grad/lora", "grad/slots", "grad/readout",
                                                             "grad/summary"} <= set(first)
    for m in ("lora", "slots", "readout", "summary"):
        assert first[f"grad/{m}"] > 0, m
    assert first["grad/gate"] > 0 and first["gate"] != 0.0  # it gets a gradient and opens (after the update)
    for _ in range(3):
        last = step(sample2(), stage=2)
    assert last["loss"] < first["loss"]


ZERO3_GATE = r"""
import os, torch, deepspeed
from tests.models.tiny import tiny_actor
from tests.training.test_losses import memnet, sample2
from palimpsest.training.step import DeepSpeedBackend, TrainStep

os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ["PORT"], RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
deepspeed.init_distributed(dist_backend="gloo")
actor = tiny_actor()
net = memnet(actor)
gate = net.gates()[0]
with torch.no_grad():
    gate.fill_(0.3)
config = {"train_micro_batch_size_per_gpu": 1, "gradient_clipping": 1.0,
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
          "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
backend = DeepSpeedBackend(net, config)
assert gate.numel() == 0  # partitioned: nothing of it is held whole here
figures = TrainStep(backend, actor)(sample2(), stage=2)
print("GATE", figures["gate"], flush=True)
# the process group's threads end here, not in the interpreter's teardown (which can abort on a joinable thread)
torch.distributed.destroy_process_group()
"""


@pytest.mark.deepspeed
def test_the_step_reads_the_whole_gate_under_zero3_with_every_parameter_partitioned(tmp_path):
    """ZeRO-3 keeps each rank's partition of a parameter (nothing of a one-element gate, with a persistence
    threshold of 0): the step reports the gathered value, one optimizer step away from where it started."""
    import math
    import os
    import socket
    import subprocess
    import sys
    from pathlib import Path

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PORT": str(port), "DS_ACCELERATOR": "cpu", "PYTHONPATH": str(root)}
    r = subprocess.run([sys.executable, "-c", ZERO3_GATE], capture_output=True, text=True, env=env, cwd=tmp_path,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    gate = float(next(line for line in r.stdout.splitlines() if line.startswith("GATE")).split()[1])
    assert abs(gate - math.tanh(0.3)) <= math.tanh(0.3 + 0.011) - math.tanh(0.3)  # lr 1e-2: one step moves it


def test_the_learning_rate_schedule_runs_each_stage_from_lr_to_zero_and_reaches_the_optimizer():
    from palimpsest.training.step import LocalBackend, lr_at

    assert [lr_at(i, 4, 0.1, "constant") for i in range(4)] == [0.1] * 4
    cos = [lr_at(i, 4, 0.1, "cosine") for i in range(5)]
    assert cos[0] == 0.1 and cos[2] == pytest.approx(0.05) and cos[4] == pytest.approx(0.0)
    assert all(a > b for a, b in zip(cos, cos[1:]))
    with pytest.raises(ValueError, match="linear"):
        lr_at(0, 4, 0.1, "linear")
    warm = [lr_at(i, 10, 1.0, "cosine", warmup=3) for i in range(11)]
    assert warm[:3] == pytest.approx([0.25, 0.5, 0.75]) and warm[3] == 1.0 and warm[10] == pytest.approx(0.0)
    actor = tiny_actor()
    lrs = {"lora": 0.1, "slots": 1.0, "readout": 0.01, "summary": 0.2}
    backend = LocalBackend(memnet(actor), lr=lrs)
    backend.set_lr(0.25)  # the schedule's factor: each group at its own base times it
    got = {g["name"]: g["lr"] for g in backend.optimizer.param_groups}
    assert got == {k: pytest.approx(v * 0.25) for k, v in lrs.items()} and backend.lr() == pytest.approx(0.025)
    with pytest.raises(ValueError, match="no learning rate for parameter group 'summary'"):
        LocalBackend(memnet(actor), lr={"lora": 0.1, "slots": 1.0, "readout": 0.01})


def test_gradient_accumulation_updates_every_k_rows_with_the_mean_gradient():
    actor = tiny_actor()
    g = torch.Generator().manual_seed(4)
    rows = [{"span": torch.randint(0, 256, (12,), generator=g), "instruction": torch.tensor([5, 6, 7])}
            for _ in range(2)]
    accum, whole = memnet(actor), memnet(actor)
    b2 = LocalBackend(accum, lr=1e-2, grad_accum=2)
    s2 = TrainStep(b2, actor)
    start = {k: v.clone() for k, v in accum.state_dict().items()}
    s2(rows[0], stage=1)
    assert all(torch.equal(v, start[k]) for k, v in accum.state_dict().items())  # no update after one row
    s2(rows[1], stage=1)
    # one update with the mean of the two rows' gradients
    b1 = LocalBackend(whole, lr=1e-2)
    b1.optimizer.zero_grad()
    ((stage1_loss(whole, actor, rows[0]) + stage1_loss(whole, actor, rows[1])) / 2).backward()
    torch.nn.utils.clip_grad_norm_(whole.parameters(), 1.0)
    b1.optimizer.step()
    for (k, a), b in zip(accum.state_dict().items(), whole.state_dict().values()):
        assert torch.allclose(a, b, atol=1e-6), k


def test_a_batch_of_spans_is_the_mean_of_their_losses_and_its_memories_are_each_ones_own():
    """Stage I's batch (memories read together, one actor pass) is the same loss as the rows one by one, with
    the same gradient; a list read by the network gives each history's own memory."""
    from palimpsest.training.losses import stage1_batch_loss
    from palimpsest.training.step import PrefixCache

    actor = tiny_actor()
    net = memnet(actor)
    with torch.no_grad():  # LoRA B away from zero, so that the memory depends on what each block holds
        for d in net.lora:
            for lora in d.values():
                lora.B.normal_(0, 0.05)
    g = torch.Generator().manual_seed(3)
    instr = torch.randint(0, 256, (5,), generator=g)
    rows = [{"span": torch.randint(0, 256, (n,), generator=g), "instruction": instr} for n in (16, 16, 16, 32)]
    mems = net([r["span"] for r in rows])
    for m, r in zip(mems, rows):
        assert torch.allclose(m, net(r["span"]), atol=1e-5)
    assert not torch.allclose(mems[0], mems[1], atol=1e-3)  # each reads its own span

    same = rows[:3]
    batch = stage1_batch_loss(net, actor, same, prefix=PrefixCache(rows=8))
    batch.backward()
    got = {k: p.grad.clone() for k, p in net.named_parameters()}  # every parameter gets one (DDP buckets)
    net.zero_grad()
    one_by_one = sum(stage1_loss(net, actor, r) for r in same) / len(same)
    one_by_one.backward()
    assert torch.allclose(batch, one_by_one, atol=1e-5)
    for k, p in net.named_parameters():
        assert torch.allclose(got[k], p.grad, atol=1e-6), k
    assert float(got["slots"].abs().sum()) > 0 and float(got["lora.0.q_proj.B"].abs().sum()) > 0
    mixed = rows + [{"span": torch.randint(0, 256, (7,), generator=g), "instruction": instr[:3],
                     "source": torch.randint(0, 256, (11,), generator=g)}]  # unequal lengths, a question row
    for c in (0.0, 0.25):  # right-padded rows, continuation's halves in the same batch: the same loss
        assert torch.allclose(stage1_batch_loss(net, actor, mixed, continuation=c),
                              sum(stage1_loss(net, actor, r, continuation=c) for r in mixed) / len(mixed), atol=1e-5)
    with pytest.raises(ValueError, match="summary"):
        net([r["span"] for r in rows], torch.zeros(3, actor.hidden_size))
    with pytest.raises(ValueError, match="merge"):
        net([torch.randint(0, 256, (80,), generator=g)])  # 5 blocks x 4 > max_slots 16


def test_a_step_under_autocast_updates_fp32_weights_and_an_unknown_precision_is_refused():
    actor = tiny_actor()
    net = memnet(actor)
    g = torch.Generator().manual_seed(4)
    instr = torch.randint(0, 256, (5,), generator=g)
    rows = [{"span": torch.randint(0, 256, (16,), generator=g), "instruction": instr} for _ in range(2)]
    before = net.slots.detach().clone()
    from palimpsest.training.losses import stage1_batch_loss

    full = float(stage1_batch_loss(net, actor, rows).detach())
    figures = TrainStep(LocalBackend(net, lr=1e-2), actor, autocast="bfloat16")(rows, stage=1)
    assert figures["loss"] != full and abs(figures["loss"] - full) < 0.05 * full  # bf16 ran, and agrees
    assert net.slots.dtype == torch.float32
    assert not torch.equal(before, net.slots.detach())
    for bad in ("int8", "float16"):
        with pytest.raises(ValueError, match="autocast"):
            TrainStep(LocalBackend(net, lr=1e-2), actor, autocast=bad)


def test_the_span_gate_opens_where_the_memory_beats_the_text_alone_and_closes_where_it_does_not():
    """With the span gate, Stage II's loss is KL(memory) + g KL(memory) + (1 - g) KL(text alone), the last two
    without gradient: the gate logit's gradient is g (1 - g) (KL(memory) - KL(text alone)), the memory's own
    gradient is its KL's, and the text alone's KL is computed once per row when a prefix cache keeps it."""
    from palimpsest.training.step import PrefixCache

    actor = tiny_actor()
    s = sample2()
    gated, plain = memnet(actor, span_gate=True), memnet(actor)  # the same seed: the same memory
    w = position_weights(s["target"].shape[0])
    p = teacher_logits(actor, s)
    mem = gated(s["memory"], actor.embed(s["summary"]))
    with torch.no_grad():
        kl_mem = float(reverse_kl(stage2_student(plain, actor, s), p, w))
    kl_alone = float(reverse_kl(student_logits(actor, torch.cat([actor.embed(s["context"]), actor.embed(s["bridge"])]),
                                               s["target"]), p, w))
    g = float(gated.openness(mem))
    assert g == pytest.approx(torch.sigmoid(torch.tensor(-4.0)).item(), rel=1e-5)  # closed as it starts
    assert gated.sent(mem).shape == (0, actor.hidden_size) and plain.sent(mem).shape == mem.shape
    cache = PrefixCache(rows=2)
    loss = stage2_loss(gated, actor, s, prefix=cache)
    assert float(loss) == pytest.approx(kl_mem + g * kl_mem + (1 - g) * kl_alone, rel=1e-4)
    loss.backward()
    assert float(gated.span_gate.bias.grad) == pytest.approx(g * (1 - g) * (kl_mem - kl_alone), rel=1e-3)
    assert abs(kl_mem - kl_alone) > 1e-4  # the gradient has a sign to check
    plain_loss = stage2_loss(plain, actor, s)
    plain_loss.backward()  # the memory learns from its own KL, whatever the gate says
    assert torch.allclose(gated.readout.weight.grad, plain.readout.weight.grad, rtol=1e-4, atol=1e-8)
    misses = cache.misses
    stage2_loss(gated, actor, s, prefix=cache)
    assert cache.misses == misses  # the context's cache, the memory's features and the text alone's KL: kept


def test_the_text_alone_is_scored_from_the_contexts_last_id_when_there_is_no_bridge():
    """Without a bridge, the text alone is [context; target]: the context's last position predicts the target's
    first token, as a whole forward pass would (a cached context must not shift the target by one)."""
    from palimpsest.training.step import PrefixCache

    actor = tiny_actor()
    s = {**sample2(), "bridge": torch.zeros(0, dtype=torch.long)}
    gated = memnet(actor, span_gate=True)
    w = position_weights(s["target"].shape[0])
    p = teacher_logits(actor, s)
    with torch.no_grad():
        mem = gated(s["memory"], actor.embed(s["summary"]))
        kl_mem = float(reverse_kl(stage2_student(gated, actor, s), p, w))
        kl_alone = float(reverse_kl(student_logits(actor, actor.embed(s["context"]), s["target"]), p, w))
    g = float(gated.openness(mem))
    for cache in (None, PrefixCache(rows=2)):
        loss = float(stage2_loss(gated, actor, s, prefix=cache).detach())
        assert loss == pytest.approx(kl_mem + g * kl_mem + (1 - g) * kl_alone, rel=1e-4)
