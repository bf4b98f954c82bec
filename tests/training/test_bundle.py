import json
import subprocess
import sys

import pytest
import torch

from palimpsest.models.encoder import MemoryEncoder
from palimpsest.models.registry import load_bundle, load_memory
from palimpsest.platform.types import ConfigError
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
    data.write_text("\n".join(json.dumps(traj(f"tr/{i}", n=8, obs=10)) for i in range(3)) + "\n")
    return d, actor, net, bundle, data


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


def test_eval_memory_is_eval_actions_on_what_the_memory_did_not_train_on(setup, tmp_path):
    """eval-memory is a view of eval-actions: the memory's text policy, the same text without the soft span,
    and with it; by default only on trajectories the bundle records as held out (tr/2 here), and stdout is
    the JSON alone."""
    d, actor, net, bundle, data = setup
    held = tmp_path / "held"
    held.mkdir()
    (held / "memory.pt").write_bytes((bundle / "memory.pt").read_bytes())
    meta = json.loads((bundle / "memory.json").read_text())
    meta["data"] = {"train_trajectories": ["tr/0", "tr/1"], "val_trajectories": ["tr/2"], "val_fraction": 0.3}
    (held / "memory.json").write_text(json.dumps(meta))
    r = subprocess.run([sys.executable, "-m", "palimpsest.cli", "eval-memory", "--model", str(held), "--data",
                        str(data), "--budget", "1000", "--window", "2048", "--max-target-tokens", "8",
                        "--tokenizer", str(d / "actor"), "--embedder", "hashing", "--ledger", str(tmp_path / "l.db"),
                        "--cache", str(tmp_path / "t.parquet"), "--no-mlflow", "--json"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(r.stdout)
    assert set(res["policies"]) == {"pace", "pace+empty", "pace+memory"} and res["reference"] == "pace"
    assert res["held_out_only"] and all(p["trajectories"] == 1 for p in res["policies"].values())
    mem, empty = res["policies"]["pace+memory"], res["policies"]["pace+empty"]
    assert mem["boundaries"] == empty["boundaries"] > 0 and mem["positions"] > empty["positions"]  # the soft span
    assert res["gap_closed"]["pace"] == 0.0 and "pace+memory" in res["gap_closed"]
