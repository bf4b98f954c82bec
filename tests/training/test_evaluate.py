import json
import subprocess
import sys

import pytest
import torch

from palimpsest.models.encoder import MemoryEncoder, load_bundle, load_memory
from palimpsest.platform.types import ConfigError
from palimpsest.training.evaluate import boundaries_from_file, evaluate
from tests.models.tiny import tiny_actor
from tests.models.tiny_tokenizer import tiny_tokenizer
from tests.pipelines.test_remory_data import traj
from tests.training.test_losses import memnet


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("eval")
    actor = tiny_actor()
    actor.model.save_pretrained(str(d / "actor"))
    tiny_tokenizer().save_pretrained(str(d / "actor"))
    net = memnet(actor)
    bundle = d / "ckpt"
    bundle.mkdir()
    torch.save(net.state_dict(), bundle / "memory.pt")
    (bundle / "memory.json").write_text(json.dumps({"memory": net.cfg.to_dict(), "embed_norm": actor.embed_norm(),
                                                    "actor": {"path": str(d / "actor")}}))
    data = d / "d.jsonl"
    data.write_text("\n".join(json.dumps(traj(f"tr/{i}", n=6, obs=10)) for i in range(3)) + "\n")
    return d, actor, net, bundle, data


def test_evaluate_compares_the_three_students_at_their_positions(setup):
    d, actor, net, bundle, data = setup
    rows = boundaries_from_file(data, tiny_tokenizer(), 3000, 800, 16)
    res = evaluate(load_bundle(bundle), actor, rows, max_boundaries=5)
    assert res["boundaries"] == 5
    assert set(res["kl"]) == {"summary", "summary_plus_text", "summary_memory"}
    pos = res["positions"]
    assert pos["summary_plus_text"] == pos["summary_memory"] > pos["summary"]  # equal budget for text and memory
    assert all(v >= 0 for v in res["kl"].values()) and 0 <= res["top1"]["summary"] <= 1
    assert res == evaluate(load_bundle(bundle), actor, rows, max_boundaries=5)  # the sample is deterministic


def test_gap_closed_is_measured_against_the_summary_and_averaged_over_boundaries(setup, monkeypatch):
    """Known per-boundary figures in, a known gap out (not the formula recomputed): boundary KLs of 0.4 and
    0.8 for the summary and 0.1 and 0.5 with memory average to 0.6 and 0.3, so half the gap is closed."""
    from palimpsest.training import evaluate as ev

    d, actor, net, bundle, data = setup
    rows = boundaries_from_file(data, tiny_tokenizer(), 3000, 800, 16)[:2]
    figures = iter([(0.4, 0.1), (0.8, 0.5)])

    def fake(memory, actor, sample):
        s, m = next(figures)
        return {"teacher_positions": 10, "summary": {"kl": s, "top1": 0.5, "positions": 4},
                "summary_plus_text": {"kl": s, "top1": 0.5, "positions": 6},
                "summary_memory": {"kl": m, "top1": 0.5, "positions": 6}}

    monkeypatch.setattr(ev, "evaluate_boundary", fake)
    res = ev.evaluate(net, actor, rows)
    assert res["kl"] == {"summary": 0.6, "summary_plus_text": 0.6, "summary_memory": 0.3}
    assert res["gap_closed"] == 0.5


def test_encoder_turns_history_and_summary_into_the_soft_span(setup):
    d, actor, net, bundle, data = setup
    enc = MemoryEncoder.load(bundle, actor)
    span = enc.encode(torch.arange(40), torch.arange(5))
    assert span.shape == (enc.slots_for(40), actor.hidden_size)
    assert torch.allclose(span.norm(dim=-1), torch.full((span.shape[0],), actor.embed_norm()), atol=1e-4)
    with pytest.raises(ValueError, match="non-empty 1-D"):
        enc.encode(torch.zeros(0, dtype=torch.long))


def test_a_checkpoint_of_another_architecture_is_refused(setup, tmp_path):
    d, actor, net, bundle, data = setup
    bad = tmp_path / "bad"
    bad.mkdir()
    torch.save(net.state_dict(), bad / "memory.pt")
    cfg = {**net.cfg.to_dict(), "d_model": 64}
    (bad / "memory.json").write_text(json.dumps({"memory": cfg, "embed_norm": 1.0}))
    with pytest.raises(ConfigError, match="does not match a memory network"):
        load_bundle(bad)
    with pytest.raises(ConfigError, match="neither a checkpoint directory nor an MLflow model URI"):
        load_memory(tmp_path / "nothing-here")


def test_eval_memory_command_prints_json_only(setup):
    d, actor, net, bundle, data = setup
    r = subprocess.run([sys.executable, "-m", "palimpsest.cli", "eval-memory", "--model", str(bundle), "--data",
                        str(data), "--max-boundaries", "3", "--max-history-tokens", "3000", "--json"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    assert res["boundaries"] == 3 and {"kl", "top1", "positions", "gap_closed"} <= set(res)
