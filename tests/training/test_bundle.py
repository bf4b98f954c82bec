import json
import subprocess
import sys

import pytest
import torch

from palimpsest.models.encoder import MemoryEncoder
from palimpsest.models.registry import bundle_record, load_memory, read_bundle
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
    (bundle / "memory.json").write_text(json.dumps(bundle_record(
        net.cfg.to_dict(), {"path": str(d / "actor"), "hidden_size": actor.hidden_size, "layers": 2,
                            **actor.fingerprint()})))  # as training records its actor
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


def test_a_bundle_recorded_before_the_span_gate_loads_without_one(setup, tmp_path):
    """A bundle whose memory record has no ``span_gate`` was trained without the gate: it loads as it was trained
    (strictly, and sending its span), not as a gated network missing its gate's weights."""
    d, actor, net, bundle, data = setup
    old = tmp_path / "before-gate"
    old.mkdir()
    meta = json.loads((bundle / "memory.json").read_text())
    meta["memory"] = {k: v for k, v in meta["memory"].items() if k not in ("span_gate", "gate_bias")}
    (old / "memory.json").write_text(json.dumps(meta))
    (old / "memory.pt").write_bytes((bundle / "memory.pt").read_bytes())
    loaded = load_memory(old, actor)
    assert not loaded.cfg.span_gate and not hasattr(loaded, "span_gate")
    assert MemoryEncoder.load(old, actor).encode(torch.arange(40)).shape[0] == loaded.slots_for(40)


def test_a_bundle_of_the_old_architecture_is_refused_by_name(setup, tmp_path):
    """A bundle the resampler network wrote (its record has no architecture, its config d_model and friends) is
    refused when it is read, when it is loaded, and by the encoder: by name, with what to do."""
    d, actor, net, bundle, data = setup
    old = tmp_path / "old"
    old.mkdir()
    torch.save({"in_proj.weight": torch.zeros(32, 64)}, old / "memory.pt")
    (old / "memory.json").write_text(json.dumps({
        "memory": {"d_actor": 64, "d_model": 32, "n_heads": 4, "n_layers": 1, "block_size": 16, "queries": 4,
                   "max_slots": 16, "feature_layer": -1}, "embed_norm": 1.0, "actor": {"path": "smollm2"}}))
    for load in (read_bundle, lambda ref: load_memory(ref, actor), lambda ref: MemoryEncoder.load(ref, actor)):
        with pytest.raises(ConfigError, match=r"architecture 'resampler.*this version serves 'actor-lora/1'.*"
                                              r"palimpsest train"):
            load(old)


def test_a_checkpoint_that_does_not_match_its_config_or_its_actor_is_refused(setup, tmp_path):
    d, actor, net, bundle, data = setup
    bad = tmp_path / "bad"
    bad.mkdir()
    torch.save(net.state_dict(), bad / "memory.pt")
    record = json.loads((bundle / "memory.json").read_text())
    (bad / "memory.json").write_text(json.dumps({**record, "memory": {**record["memory"], "lora_rank": 8}}))
    with pytest.raises(ConfigError, match="does not match a memory network"):
        load_memory(bad, actor)
    (bad / "memory.json").write_text(json.dumps({**record, "actor": {**record["actor"], "hidden_size": 576}}))
    with pytest.raises(ConfigError, match="trained beside an actor with hidden_size 576; this actor has 64"):
        load_memory(bad, actor)
    with pytest.raises(ConfigError, match="neither a memory bundle directory nor an MLflow model URI"):
        load_memory(tmp_path / "nothing-here", actor)


def test_a_memory_is_refused_beside_another_actor_of_the_same_shape(setup, tmp_path):
    """Hidden size and depth alike, other weights (another seed, as a fine-tune would be): refused by name. The
    same actor in another dtype, and a bundle that recorded no fingerprint, load."""
    d, actor, net, bundle, data = setup
    other = tiny_actor(seed=11)
    assert other.hidden_size == actor.hidden_size
    with pytest.raises(ConfigError, match=r"trained beside another actor .*actor\.embed_(norm|probe)"):
        load_memory(bundle, other)
    with pytest.raises(ConfigError, match="another actor"):
        MemoryEncoder.load(bundle, other)
    tuned = tiny_actor()  # the same embeddings, one layer moved by 1%: a fine-tune that left them alone
    with torch.no_grad():
        tuned.model.model.layers[0].mlp.down_proj.weight.mul_(1.01)
    with pytest.raises(ConfigError, match=r"actor\.weight_norms"):
        load_memory(bundle, tuned)
    same = tiny_actor()
    same.model.to(torch.bfloat16)
    assert same.differs_from(actor.fingerprint()) is None
    unrecorded = tmp_path / "unrecorded"
    unrecorded.mkdir()
    (unrecorded / "memory.pt").write_bytes((bundle / "memory.pt").read_bytes())
    record = json.loads((bundle / "memory.json").read_text())
    record["actor"] = {k: v for k, v in record["actor"].items() if k not in actor.fingerprint()}
    (unrecorded / "memory.json").write_text(json.dumps(record))
    load_memory(unrecorded, other)


def test_a_bundle_holds_the_memory_alone_and_loads_back_exactly(setup):
    d, actor, net, bundle, data = setup
    state = torch.load(bundle / "memory.pt", weights_only=True)
    assert set(state) == set(net.state_dict())  # no actor weight, no pickled module
    loaded = load_memory(bundle, actor)
    x = torch.arange(40)
    with torch.no_grad():
        assert torch.equal(loaded(x), net.eval()(x))
    assert read_bundle(bundle).memory == net.cfg.to_dict()


def held_bundle(bundle, tmp_path):
    """The bundle again, its record saying it trained on tr/0 and held tr/1 and tr/2 out."""
    held = tmp_path / "held"
    held.mkdir()
    (held / "memory.pt").write_bytes((bundle / "memory.pt").read_bytes())
    meta = json.loads((bundle / "memory.json").read_text())
    meta["data"] = {"train_trajectories": ["tr/0"], "val_trajectories": ["tr/1", "tr/2"], "val_fraction": 0.3}
    (held / "memory.json").write_text(json.dumps(meta))
    return held


def test_eval_memory_is_eval_actions_on_what_the_memory_did_not_train_on(setup, tmp_path):
    """eval-memory is a view of eval-actions: the memory's text policy, the same text without the soft span,
    and with it; by default only on trajectories the bundle records as held out (tr/1 and tr/2 here), and stdout is
    the JSON alone."""
    d, actor, net, bundle, data = setup
    held = held_bundle(bundle, tmp_path)
    lines = [ln for ln in data.read_text().splitlines() if ln.strip()]  # two files: tr/2 in the second
    first, second = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    first.write_text("\n".join(ln for ln in lines if json.loads(ln)["id"] != "tr/2") + "\n")
    second.write_text("\n".join(ln for ln in lines if json.loads(ln)["id"] == "tr/2") + "\n")
    r = subprocess.run([sys.executable, "-m", "palimpsest.cli", "eval-memory", "--model", str(held), "--data",
                        str(first), "--data", str(second), "--budget", "1000", "--window", "2048",
                        "--max-target-tokens", "8",
                        "--tokenizer", str(d / "actor"), "--embedder", "hashing", "--ledger", str(tmp_path / "l.db"),
                        "--cache", str(tmp_path / "t.parquet"), "--no-mlflow", "--json"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(r.stdout)
    assert set(res["policies"]) == {"pace", "pace+empty", "pace+memory", "pace+other"} and res["reference"] == "pace"
    assert res["held_out_only"] and all(p["trajectories"] == 2 for p in res["policies"].values())
    # the input control: every boundary again, with the other held-out trajectory's memory in the slot
    other = res["policies"]["pace+other"]
    assert other["boundaries"] == res["policies"]["pace+memory"]["boundaries"]
    assert 0.0 <= other["kl"] < float("inf")  # a number (these trajectories differ by id only: the KLs agree)
    mem, empty = res["policies"]["pace+memory"], res["policies"]["pace+empty"]
    assert mem["boundaries"] == empty["boundaries"] > 0 and mem["positions"] > empty["positions"]  # the soft span
    assert res["gap_closed"]["pace"] == 0.0 and "pace+memory" in res["gap_closed"]
    assert set(res["data"]["files"]) == {str(first), str(second)}  # both files' held-out trajectories, together
    paired = res["paired"]
    assert paired["arm"] == "pace+memory" and set(paired["controls"]) == {"pace", "pace+empty", "pace+other"}
    assert all(c["n"] <= 2 and c["verdict"] == "no verdict" for c in paired["controls"].values())  # 2 trajectories


def test_eval_reconstruction_scores_the_split_asked_for(setup, tmp_path):
    """Held out by default (tr/1, tr/2), the training trajectories with --split train (tr/0: is it overfitting?),
    every one with --split all; a --split the command does not know is a usage error naming the option."""
    d, actor, net, bundle, data = setup
    held = held_bundle(bundle, tmp_path)

    def run(*extra):
        return subprocess.run([sys.executable, "-m", "palimpsest.cli", "eval-reconstruction", "--model", str(held),
                               "--data", str(data), "--tokens", "8", "--spans", "40", "--json", *extra],
                              capture_output=True, text=True, timeout=600)

    seen = {}
    for split, want in (("held-out", 2), ("train", 1), ("all", 3)):
        r = run(*(("--split", split) if split != "held-out" else ()))
        assert r.returncode == 0, r.stderr[-2000:]
        doc = json.loads(r.stdout)
        assert doc["split"] == split and doc["trajectories"] == want and doc["held_out_only"] == (split == "held-out")
        assert len(doc["differences"]["own_minus_none"]["by_trajectory"]) == want  # the spans' own trajectories
        # spans of one trajectory (train: tr/0) have no other trajectory's memory to compare: left out, and said
        assert (doc["other"]["nll"] is None) == (want == 1) and ("own_minus_other" in doc["differences"]) == (want > 1)
        seen[split] = doc["own"]["nll"]
    assert len(set(seen.values())) == 3  # three samples of spans, not one
    r = run("--split", "val")
    assert r.returncode == 2 and "--split" in r.stderr and "'val' is not one of held-out, train, all" in r.stderr


def test_a_served_boundary_and_its_evaluation_give_the_memory_the_same_soft_span(setup, tmp_path):
    """One boundary through both paths: serving's read (``turn_memory`` with the serve config's memory section)
    encoded by the memory deployment, and eval-actions' arm (``memory_arm``: the bundle as it was trained to
    read, the serve config's values where it records none) on the same compiled turn."""
    import asyncio

    from palimpsest.evaluation.actions import memory_arm
    from palimpsest.pipelines.environment import open_runtime
    from palimpsest.pipelines.replay_sessions import prepare_sessions, walk_turns
    from palimpsest.pipelines.trajectories import read_trajectories
    from palimpsest.platform.compile.budget import Budget
    from palimpsest.platform.policies import parse_policy_config
    from palimpsest.serving.models.memory_encoder import MemoryDeployment as Deployment
    from palimpsest.serving.turn.turn import turn_memory

    d, actor, net, bundle, data = setup
    trained = tmp_path / "trained"  # the bundle, its record saying how it was trained to read
    trained.mkdir()
    (trained / "memory.pt").write_bytes((bundle / "memory.pt").read_bytes())
    record = json.loads((bundle / "memory.json").read_text())
    (trained / "memory.json").write_text(json.dumps({**record, "data": {"memory_tokens": 200,
                                                                        "max_observation_chars": 150}}))
    bundle = trained
    rt = open_runtime(tmp_path / "l.db", "hashing", str(d / "actor"))
    sessions = prepare_sessions(rt, read_trajectories(data).trajectories, False, "sha", [])
    arm = memory_arm(str(bundle), actor)
    assert (arm.spec.max_history_tokens, arm.spec.max_field_chars) == (200, 150)  # as trained: its bundle says it
    deployment = Deployment.func_or_class(str(d / "actor"), {"default": str(bundle)})
    assert deployment.info()["models"]["default"]["read"] == arm.spec.model_dump()  # served from the same record
    compared = 0
    for _, _, turn, _ in walk_turns(rt, sessions[0], parse_policy_config({"type": "pace"}), Budget(700, 8, arm.slots)):
        read = turn_memory(rt, turn, arm.spec) if not isinstance(turn, Exception) else None
        if read is None:
            continue
        assert read == arm.read(rt.ledger.tokenizer, turn)
        served = asyncio.run(deployment.encode("default", sessions[0].session_id, *read))["soft"]
        assert torch.equal(served, arm.encode(read).float())
        compared += 1
    assert compared >= 3, compared
