"""Ray Train + DeepSpeed on 2 CPU workers with a tiny actor: training, a killed worker, resume, registry."""

import json
from pathlib import Path

import pytest

from palimpsest.platform.types import ConfigError
from palimpsest.training.train_config import parse_train_config
from tests.models.tiny import tiny_actor
from tests.models.tiny_tokenizer import tiny_tokenizer
from tests.pipelines.test_remory_data import traj


@pytest.fixture(scope="module")
def actor_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("actor")
    actor = tiny_actor(vocab=256)
    actor.model.save_pretrained(str(d))
    tiny_tokenizer().save_pretrained(str(d))
    return d


POLICY = Path(__file__).resolve().parents[2] / "configs" / "policies" / "pace.yaml"


def config(tmp_path, actor_dir, **over):
    data = tmp_path / "d.jsonl"
    data.write_text("\n".join(json.dumps(traj(f"tr/{i}", n=6, obs=20)) for i in range(5)) + "\n")
    base = {"name": "tiny", "actor": {"path": str(actor_dir)},
            "data": {"file": str(data), "max_history_tokens": 3000, "val_fraction": 0.0, "span_tokens": 64,
                     "budget": 800, "memory_tokens": 200, "embedder": "hashing"},
            "tracking": {"policy_config": str(POLICY)},
            "memory": {"block_size": 64, "queries": 4, "max_slots": 16, "lora_rank": 4, "summary_layers": 1},
            "optim": {"stage1_steps": 2, "stage2_steps": 4, "checkpoint_every": 2, "prefix_cache_rows": 2},
            "distributed": {"num_workers": 2, "zero_stage": 2, "max_failures": 2},
            "storage": str(tmp_path / "runs")}
    for k, v in over.items():
        base[k] = {**base.get(k, {}), **v} if isinstance(v, dict) else v
    return parse_train_config(base)


@pytest.mark.parametrize("section,value,message", [
    ("memory", {"queries": 128, "block_size": 64}, "queries (128) must be fewer than block_size (64)"),
    ("memory", {"d_model": 32}, "memory.d_model: Extra inputs are not permitted"),
    ("optim", {"grad_accum": 4}, "optim.grad_accum (4) must divide stage1_steps (2), checkpoint_every (2)"),
    ("memory", {"max_slots": 2}, "max_slots (2) must be at least queries"),
    ("optim", {"unknown_key": 1}, "Extra inputs are not permitted"),
    ("optim", {"schedule": "linear"}, "Input should be 'constant' or 'cosine'"),
    ("data", {"soft_slots": 8}, "data.soft_slots is derived from memory"),
    ("data", {"span_tokens": 96}, "data.span_tokens (96) must be a multiple of memory.block_size (64): Stage I must "
                                  "compress at the 16 ids per soft token"),
    ("optim", {"stage2_replay_every": 1}, "optim.stage2_replay_every (1) would make every Stage II step a "
                                          "reconstruction step"),
    ("optim", {"stage2_replay_every": 2, "grad_accum": 2}, "optim.stage2_replay_every (2) needs optim.grad_accum 1"),
    ("data", {"seed": 3}, "data.seed is derived from optim.seed"),
    ("data", {"file": None}, "data.file: the trajectories (JSONL) to train on are required"),
    ("data", {"memory_read": 0}, "memory_read 0: this code builds what the memory reads at version"),
])
def test_bad_configs_are_refused_before_any_worker(tmp_path, actor_dir, section, value, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        config(tmp_path, actor_dir, **{section: value})


def test_the_config_a_worker_receives_validates_as_the_one_parsed(tmp_path, actor_dir):
    """The launcher hands each worker ``cfg.model_dump(mode="json")``; it must validate back to the same config
    (the derived data fields it carries are refused only in a file)."""
    from palimpsest.training.prepare import data_config
    from palimpsest.training.train_config import TrainConfig

    cfg = config(tmp_path, actor_dir)
    assert TrainConfig.model_validate(cfg.model_dump(mode="json")) == cfg
    built = data_config(cfg)
    assert TrainConfig.model_validate({**cfg.model_dump(mode="json"), "data": built.to_dict()}).data == built


def test_missing_actor_and_empty_data_are_clear_errors(tmp_path, actor_dir):
    from palimpsest.training.prepare import prepare

    with pytest.raises(ConfigError, match="holds no HF model"):
        prepare(config(tmp_path, actor_dir, actor={"path": str(tmp_path / "nope")}))
    cfg = config(tmp_path, actor_dir)
    Path(cfg.data.file).write_text("")
    with pytest.raises(Exception, match="no Stage II boundary|no trajectories"):
        prepare(cfg)


@pytest.mark.slow
@pytest.mark.ray
@pytest.mark.deepspeed
def test_training_survives_a_killed_worker_resumes_and_registers(tmp_path, actor_dir, monkeypatch):
    """Against a real MLflow tracking server named in the training config (with the artifact location
    from the config too), then the serving side's model lookup and loading through the same server."""
    import ray

    from palimpsest.training.launcher import launch
    from tests.mlflow_server import mlflow_server

    monkeypatch.chdir(tmp_path)
    for var in ("MLFLOW_TRACKING_URI", "PALIMPSEST_MLFLOW_ARTIFACTS"):  # the launcher exports the config's
        monkeypatch.setenv(var, "-")
        monkeypatch.delenv(var)
    store = tmp_path / "object-store"
    with mlflow_server(tmp_path) as tracking:
        cfg = config(tmp_path, actor_dir, tracking={"uri": tracking, "artifact_location": store.as_uri()},
                     optim={"schedule": "cosine", "lr": 0.01})
        marker = tmp_path / "killed"
        try:
            summary = launch(cfg, fault={"rank": 1, "step": 5, "marker": str(marker)})
        finally:
            ray.shutdown()
        _check_run(summary, marker, tracking, store, cfg)
        _check_same_step(cfg, actor_dir, summary, tracking)


def _check_same_step(cfg, actor_dir, summary, tracking):
    """The launcher's workers run ``training.step``: its first step's loss (rank 0's row) and the gradient of
    both ranks' rows, averaged, are what the step module computes in this process from the same seed."""
    import mlflow
    import torch

    from palimpsest.models.actor import FrozenActor
    from palimpsest.training.launcher import build_memory
    from palimpsest.training.prepare import _load_rows
    from palimpsest.training.step import grad_norms, lr_at, sample_loss, sample_tensors

    client = mlflow.MlflowClient(tracking)
    # each stage's updates follow the config's schedule from its own first step (Stage I: steps 1-2, II: 3-6),
    # as the DeepSpeed optimizer held it (read back from the engine, not recomputed)
    lrs = {m.step: m.value for m in client.get_metric_history(summary["mlflow_run_id"], "lr")}
    o = cfg.optim
    want = [lr_at(i, o.stage1_steps, o.lr, "cosine") for i in range(o.stage1_steps)] + \
        [lr_at(i, o.stage2_steps, o.lr, "cosine") for i in range(o.stage2_steps)]
    assert [lrs[k] for k in sorted(lrs)] == pytest.approx(want) and want[0] == want[2] == o.lr > want[3]
    logged = {k: {m.step: m.value for m in client.get_metric_history(summary["mlflow_run_id"], k)}[1]
              for k in ("loss", "grad/lora", "grad/slots", "grad/readout", "grad_norm")}
    torch.manual_seed(cfg.optim.seed)
    actor = FrozenActor.from_pretrained(str(actor_dir))
    net = build_memory(cfg, actor)
    rows = _load_rows(str(Path(cfg.storage).resolve() / cfg.name / "data"), 1)
    losses = [sample_loss(net, actor, sample_tensors(rows[r], 1), 1) for r in (0, 1)]  # ranks 0 and 1, step 1
    assert float(losses[0]) == pytest.approx(logged["loss"], rel=1e-5)
    torch.stack(losses).mean().backward()  # data parallel: the ranks' gradients averaged
    mine = grad_norms(net, lambda p: p.grad)
    for k in ("grad/lora", "grad/slots", "grad/readout"):
        assert logged[k] > 0 and mine[k] == pytest.approx(logged[k], rel=1e-4), k
    total = torch.sqrt(sum(p.grad.pow(2).sum() for p in net.parameters() if p.grad is not None))
    assert float(total) == pytest.approx(logged["grad_norm"], rel=1e-4)


def _check_run(summary, marker, tracking, store, cfg):
    import mlflow
    import torch

    from palimpsest.models.actor import FrozenActor
    from palimpsest.models.registry import load_memory, read_bundle, resolve_memory_ref

    assert marker.exists()  # the worker was killed once ...
    assert summary["metrics"]["step"] == 6  # ... and the run still finished,
    # resumed from a checkpoint written before the kill (the controller may not have registered the
    # newest one yet when the worker died, so it is step 4 or step 2, never a restart from scratch)
    resumed = summary["metrics"]["resumed_from"]
    assert resumed in (2, 4)
    # Stage II read the teachers computed once on the driver
    teachers = summary["teachers"]  # the rows Stage II visits (4 steps x 2 workers), each computed once
    assert teachers["rows"] == summary["data"]["stage2"]["train"] > 0
    assert teachers["computed"] == teachers["visited"] == min(teachers["rows"], 4 * 2)
    assert summary["metrics"]["teacher_cached"] == 1.0
    actor = FrozenActor.from_pretrained(read_bundle(Path(summary["checkpoint"])).actor["path"])
    net = load_memory(Path(summary["checkpoint"]), actor)
    x = torch.randint(0, 256, (50,))
    soft = net(x)
    assert soft.shape == (4, 64)

    mlflow.set_tracking_uri(tracking)
    client = mlflow.MlflowClient()
    run = client.get_run(summary["mlflow_run_id"])
    # one run, kept
    assert run.data.params["zero_stage"] == "2" and run.data.tags.get("resumed_at_step") == str(resumed)
    losses = client.get_metric_history(run.info.run_id, "loss")
    assert sorted({m.step for m in losses}) == [1, 2, 3, 4, 5, 6]
    # the network as Stage I left it, logged beside the run and loadable by reference; Stage II moved it on
    assert summary["stage1_bundle"] == f"runs:/{run.info.run_id}/stage1"
    stage1 = load_memory(summary["stage1_bundle"], actor)
    assert stage1.cfg == cfg.memory and read_bundle(summary["stage1_bundle"]).architecture == "actor-lora/1"
    with torch.no_grad():
        assert not torch.allclose(stage1(x), net(x), atol=1e-6)
    name, version = summary["registered"].split("/")[-2:]
    mv = client.get_model_version(name, version)
    # the policy the samples were compiled with: its file, and its content and hash beside the checkpoint
    from palimpsest.platform.policies import load_policy_file

    assert mv.tags["policy_config"] == str(POLICY)
    assert mv.tags["policy_hash"] == load_policy_file(POLICY).config_hash()
    logged = mlflow.artifacts.load_dict(f"{run.info.artifact_uri}/policy.json")
    assert logged["hash"] == mv.tags["policy_hash"] and logged["config"]["type"] == "pace"
    bundle = read_bundle(summary["registered"])  # the registered version's bundle, read back through the server
    assert bundle.policy_hash == mv.tags["policy_hash"] and bundle.train_trajectories
    assert mv.tags["architecture"] == bundle.architecture == "actor-lora/1"
    # the one config: what the YAML's memory section said is what the bundle records and serving builds
    from palimpsest.models.memory import MemoryConfig

    assert MemoryConfig(**bundle.memory) == cfg.memory
    from palimpsest.platform.prompt.chat import MEMORY_READ_VERSION

    assert bundle.data["memory_read"] == MEMORY_READ_VERSION  # what serving compares its read with
    assert run.info.artifact_uri.startswith(store.as_uri()) and any(store.rglob("checkpoint"))  # config's location
    # Serving resolves `memory.model: auto` and loads it through the same server.
    assert resolve_memory_ref("auto") == summary["registered"]
    served = load_memory(summary["registered"], actor)  # the state dict, no pickled module
    assert served.cfg == cfg.memory
    with torch.no_grad():
        assert torch.allclose(served(x), net(x), atol=1e-6)


@pytest.mark.slow
@pytest.mark.ray
@pytest.mark.deepspeed
@pytest.mark.parametrize("dist", [{"strategy": "deepspeed", "zero_stage": 3}, {"strategy": "ddp"}],
                         ids=["zero3", "ddp"])
def test_zero3_and_ddp_train_and_export_the_same_architecture(tmp_path, actor_dir, monkeypatch, dist):
    import ray
    import torch

    from palimpsest.models.actor import FrozenActor
    from palimpsest.models.registry import load_memory
    from palimpsest.training.launcher import launch

    monkeypatch.chdir(tmp_path)
    # every parameter group partitioned, gathered and exported, with its own learning rate; Stage I in batches
    # of 2 spans per worker under bf16 autocast; Stage II's second step a reconstruction replay
    cfg = config(tmp_path, actor_dir, distributed=dist, optim={"stage1_steps": 2, "stage2_steps": 2,
                                                               "checkpoint_every": 2, "lr_slots": 0.05,
                                                               "stage1_batch": 2, "autocast": "bfloat16",
                                                               "stage2_replay_every": 2})
    try:
        summary = launch(cfg, track=False)
    finally:
        ray.shutdown()
    last = summary["metrics"]  # step 4, the replay: a reconstruction NLL on its own curve, at Stage II's rate
    assert last["step"] == 4 and last["stage"] == 2 and "loss" not in last and 0 < last["replay_loss"] < 20
    net = load_memory(Path(summary["checkpoint"]), FrozenActor.from_pretrained(actor_dir))  # without DeepSpeed
    assert net(torch.randint(0, 256, (50,))).shape == (4, 64)
    assert net.slots.abs().sum() > 0  # trained (it starts at zero)
    assert any(lora.B.abs().sum() > 0 for d in net.lora for lora in d.values())  # trained (B starts at zero)


def test_each_stage_walks_its_own_rows_from_the_shortest_history_epoch_by_epoch():
    from palimpsest.training.prepare import curriculum_row

    stage1, world, n = 7, 2, 5
    # Stage II's first step on each rank takes the first (shortest) rows, whatever the global step count.
    assert [curriculum_row(stage1, stage1, world, r, n) for r in range(world)] == [(2, 0), (2, 1)]
    walk = [curriculum_row(step, stage1, world, 0, n)[1] for step in range(stage1, stage1 + 5)]
    assert walk == [0, 2, 4, 1, 3]  # rank 0's share of epoch 1, then on into epoch 2 from the start
    both = sorted(curriculum_row(step, stage1, world, r, n)[1] for step in range(stage1, stage1 + 5)
                  for r in range(world))
    assert both == sorted(k % n for k in range(10))  # two epochs, every row once per epoch
    assert curriculum_row(0, stage1, world, 1, 3) == (1, 1)


def test_stage2_replays_reconstruction_every_nth_step_of_stage2_only():
    from palimpsest.training.prepare import replays

    assert [s for s in range(12) if replays(s, 4, 3)] == [6, 9]  # Stage II's 3rd and 6th steps
    assert not any(replays(s, 4, 0) for s in range(12))  # 0: the seed's Stage II


@pytest.mark.parametrize("n,world,every", [(24, 2, 3), (13, 2, 3), (4, 2, 2), (6, 1, 2)])
def test_a_replay_takes_no_stage2_rows_turn_every_row_is_distilled_each_epoch(n, world, every):
    from palimpsest.training.prepare import curriculum_row, replays

    stage1 = 5
    distill = [s for s in range(stage1, stage1 + 3 * n * every) if not replays(s, stage1, every)]
    epoch = distill[: -(-n // world)]  # as many distillation steps as one epoch takes
    rows = [curriculum_row(s, stage1, world, r, n, every)[1] for s in epoch for r in range(world)]
    assert sorted(set(rows)) == list(range(n))  # each row once (the last step may wrap into the next epoch)
    assert rows[:world] == list(range(world))  # from the shortest history


def test_a_run_directory_of_another_network_is_moved_aside_and_the_same_one_is_resumed(tmp_path, actor_dir):
    """A rerun of a config resumes its checkpoints; checkpoints of another network (an old architecture wrote no
    record, or the memory config changed) would fail to load, so the directory is moved aside and said."""
    from palimpsest.training.launcher import RUN_NETWORK, _claim_run_dir

    cfg = config(tmp_path, actor_dir)
    run = tmp_path / "runs" / "tiny" / "tiny"
    run.mkdir(parents=True)
    (run / "checkpoint_000001").mkdir()  # written by the old architecture: no record beside it
    _claim_run_dir(run, cfg)
    aside = [p for p in run.parent.iterdir() if p.name.startswith("tiny.replaced-")]
    assert len(aside) == 1 and (aside[0] / "checkpoint_000001").is_dir()
    assert sorted(p.name for p in run.iterdir()) == [RUN_NETWORK]
    (run / "checkpoint_000002").mkdir()
    _claim_run_dir(run, cfg)  # the same network: kept, resumed
    assert (run / "checkpoint_000002").is_dir()
    other = config(tmp_path, actor_dir, memory={"lora_rank": 8})
    _claim_run_dir(run, other)  # another memory config: moved aside too
    assert not (run / "checkpoint_000002").exists()
    assert json.loads((run / RUN_NETWORK).read_text())["memory"]["lora_rank"] == 8


def test_a_rerun_whose_optim_changed_is_refused_not_resumed(tmp_path, actor_dir):
    """The same network under another recipe (a learning rate, the steps, the batch): resuming would mix two
    recipes in one checkpoint, so it is refused naming what changed; checkpoint_every alone may change. A
    directory recorded before its optim was (network only) resumes and records it."""
    from palimpsest.platform.types import ConfigError
    from palimpsest.training.launcher import RUN_NETWORK, _claim_run_dir

    cfg = config(tmp_path, actor_dir)
    run = tmp_path / "runs" / "tiny" / "tiny"
    _claim_run_dir(run, cfg)
    _claim_run_dir(run, config(tmp_path, actor_dir, optim={"lr": 3e-4}))  # no checkpoint yet: nothing to mix
    _claim_run_dir(run, cfg)
    (run / "checkpoint_000002").mkdir()
    for change in ({"lr": 3e-4}, {"stage2_steps": 8}, {"stage1_batch": 2}):
        with pytest.raises(ConfigError, match=f"optim.{next(iter(change))}"):
            _claim_run_dir(run, config(tmp_path, actor_dir, optim=change))
        assert (run / "checkpoint_000002").is_dir()
    _claim_run_dir(run, config(tmp_path, actor_dir, optim={"checkpoint_every": 1}))
    assert (run / "checkpoint_000002").is_dir()
    record = json.loads((run / RUN_NETWORK).read_text())
    (run / RUN_NETWORK).write_text(json.dumps({k: v for k, v in record.items() if k != "optim"}))
    _claim_run_dir(run, cfg)  # recorded before the optim was: resumed, and now recorded
    assert (run / "checkpoint_000002").is_dir() and "optim" in json.loads((run / RUN_NETWORK).read_text())
    # a field this version added to optim, at its default, is no change (its default was in force)
    record = json.loads((run / RUN_NETWORK).read_text())
    del record["optim"]["kl_decay"]
    (run / RUN_NETWORK).write_text(json.dumps(record))
    _claim_run_dir(run, cfg)
    with pytest.raises(ConfigError, match="optim.kl_decay was 0.05"):
        (run / RUN_NETWORK).write_text(json.dumps(record))
        _claim_run_dir(run, config(tmp_path, actor_dir, optim={"kl_decay": 0.1}))


def test_stage1_batches_take_every_row_once_per_epoch_and_batch_one_is_the_plain_walk():
    from palimpsest.training.prepare import curriculum_row, stage1_batch_rows

    world, n, batch = 2, 12, 3
    taken = [i for step in range(2) for r in range(world) for i in stage1_batch_rows(step, world, r, n, batch)]
    assert sorted(taken) == list(range(n))  # one epoch: 2 steps x 2 ranks x 3 rows, every row once
    assert stage1_batch_rows(0, world, 1, n, batch) == [3, 4, 5]  # rank 1 after rank 0, no row shared
    assert all(stage1_batch_rows(s, world, r, 5, 1) == [curriculum_row(s, 9, world, r, 5)[1]]
               for s in range(6) for r in range(world))


def test_a_stage1_batch_of_spans_that_need_a_merge_is_refused(tmp_path, actor_dir):
    small = {"block_size": 8, "queries": 4, "max_slots": 8}  # 64-id spans: 8 blocks x 4 = 32 soft tokens > 8
    config(tmp_path, actor_dir, memory=small)  # one span a step: merges are fine
    with pytest.raises(ConfigError, match=r"optim.stage1_batch \(4\) needs spans that need no merge"):
        config(tmp_path, actor_dir, memory=small, optim={"stage1_batch": 4})
    with pytest.raises(ConfigError, match="Input should be 'none' or 'bfloat16'"):
        config(tmp_path, actor_dir, optim={"autocast": "float16"})
