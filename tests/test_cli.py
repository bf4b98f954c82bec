"""The command line, run as a user runs it (a subprocess of the installed console script)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

FAST = ["--embedder", "hashing", "--tokenizer", "approx"]  # the real models are exercised in the slow tier


def cli(*args, cwd, env=None):
    args = list(args)
    if args and args[0] in ("import", "render", "replay", "view") and "--embedder" not in args:
        args += FAST
    return subprocess.run([sys.executable, "-m", "palimpsest.cli", *args], capture_output=True, text=True, cwd=cwd,
                          env={**os.environ, "COLUMNS": "200", **(env or {})}, timeout=300)


@pytest.fixture
def data(tmp_path):
    steps = [{"t": i, "kind": "bash", "action": f"grep -n parse_config settings/mod_{i}.py",
              "observation": f"{i}: def parse_config_{i}(env): return env['database_url']", "obs_source": "user"}
             for i in range(6)]
    f = tmp_path / "traj.jsonl"
    f.write_text(json.dumps({"id": "demo/1", "task": "Fix parse_config", "system": "be careful", "steps": steps})
                 + "\n{broken\n")
    return f


def test_import_render_glimpse_audit_round_trip(tmp_path, data):
    r = cli("import", str(data), cwd=tmp_path)
    assert r.returncode == 1 and "demo/1" in r.stdout and "line 2: not a JSON object" in r.stderr
    assert (tmp_path / ".palimpsest" / "ledger.db").exists()
    r = cli("render", "--session", "demo/1", "--policy", "pace", "--budget", "400", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "pace plan at t=6" in r.stdout and "tokens:" in r.stdout and "<|im_start|>user\nFix parse_config" in r.stdout
    r = cli("glimpse", "--session", "demo/1", "1", cwd=tmp_path)
    assert r.returncode == 0 and "parse_config_0" in r.stdout
    r = cli("render", "--session", "demo/1", "--policy", "ace", "--budget", "400", "--at", "3", "--no-prompt",
            cwd=tmp_path)
    assert r.returncode == 0 and "ace plan at t=3" in r.stdout


def test_render_json_is_exactly_what_the_actor_receives(tmp_path, data):
    """With SmolLM2's tokenizer: the ids are the model's own encoding of the text shown, they fit the budget
    with max_tokens, and stdout holds the JSON object and nothing else."""
    from tokenizers import Tokenizer

    from palimpsest.models.assets import smollm2_tokenizer_dir

    cli("import", str(data), "--embedder", "hashing", cwd=tmp_path)
    r = cli("render", "--session", "demo/1", "--policy", "pace", "--budget", "300", "--max-tokens", "64", "--json",
            "--embedder", "hashing", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    raw = Tokenizer.from_file(str(smollm2_tokenizer_dir() / "tokenizer.json"))
    ids = out["prompt_token_ids"]
    assert len(ids) + out["max_tokens"] <= out["budget"] == 300 and out["max_tokens"] == 64
    assert raw.encode(out["prompt_text"], add_special_tokens=False).ids == ids  # independent re-encoding
    assert raw.decode(ids, skip_special_tokens=False) == out["prompt_text"]
    assert out["prompt_text"].startswith("<|im_start|>system\nbe careful") and "glimpse(#ID)" in out["prompt_text"]
    assert 0 < out["tokens"]["tools"] < out["tokens"]["prefix"] < out["tokens"]["prompt"] == len(ids)
    assert [m["role"] for m in out["messages"][:3]] == ["system", "user", "assistant"]
    assert [p["t"] for p in out["plan"]] == list(range(6)) and out["plan"][-1]["resolution"] == "full"


def test_the_command_line_works_on_a_postgresql_ledger_given_by_url(tmp_path, data):
    from tests import pg

    with pg.fresh_schema() as url:
        r = cli("import", str(data), "--ledger", url, cwd=tmp_path)
        assert r.returncode == 1 and "demo/1" in r.stdout, r.stderr
        r = cli("glimpse", "--session", "demo/1", "1", "--ledger", url, cwd=tmp_path, env={"PALIMPSEST_LEDGER": ""})
        assert r.returncode == 0 and "parse_config_0" in r.stdout, r.stderr
        r = cli("audit", "--session", "demo/1", cwd=tmp_path, env={"PALIMPSEST_LEDGER": url})
        assert r.returncode == 0, r.stderr
    r = cli("audit", "--session", "demo/1", "--ledger", "postgresql://agent:pw@127.0.0.1:1/x", cwd=tmp_path)
    assert r.returncode == 2 and "cannot connect to the ledger database postgresql://agent:***@127.0.0.1:1/x" \
        in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("args,message", [
    (["render", "--session", "demo/1", "--policy", "pace", "--budget", "0"], "positive integer"),
    (["render", "--session", "demo/1", "--policy", "pace", "--budget", "-3"], "positive integer"),
    (["render", "--session", "demo/1", "--policy", "magic", "--budget", "1000"], "unknown policy type 'magic'"),
    (["render", "--session", "nope", "--policy", "pace", "--budget", "1000"], "unknown session 'nope'"),
    (["render", "--session", "demo/1", "--policy", "pace", "--budget", "5", "--max-tokens", "0"],
     "cannot hold the fixed prefix"),
    (["render", "--session", "demo/1", "--policy", "pace", "--budget", "100", "--max-tokens", "100"], "--max-tokens"),
    (["glimpse", "--session", "demo/1", "#424242"], "no step #424242"),
    (["import", "missing.jsonl"], "not found"),
    (["render", "--session", "demo/1", "--policy", "pace", "--budget", "1000", "--ledger", "nope.db"], "no ledger at"),
    (["import", "traj.jsonl", "--embedder", "magic"], "unknown embedder 'magic'"),
])
def test_bad_input_gets_one_clear_line_and_exit_2(tmp_path, data, args, message):
    cli("import", str(data), cwd=tmp_path)
    r = cli(*args, cwd=tmp_path)
    assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr


def test_policies_lists_names_and_defaults(tmp_path):
    r = cli("policies", cwd=tmp_path)
    assert r.returncode == 0
    for name in ("full", "window", "rolling_summary", "pace", "ace"):
        assert f"type: {name}" in r.stdout
    assert "tau: 0.3" in r.stdout


def test_render_with_a_policy_config_file(tmp_path, data):
    cli("import", str(data), cwd=tmp_path)
    cfg = tmp_path / "w.yaml"
    cfg.write_text("type: window\nk: 2\ncompaction: {mode: per_turn}\n")
    r = cli("render", "--session", "demo/1", "--policy", "window", "--budget", "5000", "--policy-config", str(cfg),
            "--no-prompt", cwd=tmp_path)
    assert r.returncode == 0 and "drop 4" in r.stdout
    r = cli("render", "--session", "demo/1", "--policy", "pace", "--budget", "5000", "--policy-config", str(cfg),
            cwd=tmp_path)
    assert r.returncode == 2 and "does not match" in r.stderr


SHARED = Path(__file__).resolve().parents[2] / "shared" / "data" / "trajectories" / "dev.jsonl"


@pytest.mark.slow
@pytest.mark.skipif(not SHARED.is_file(), reason="the shared dev trajectories are not beside this checkout")
def test_demo_on_the_dev_trajectories_with_the_real_models(tmp_path):
    r = cli("view", "--data", str(SHARED), "--ledger", str(tmp_path / "demo.db"), "--budget", "16000",
            "--embedder", "minilm", "--tokenizer", "smollm2", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "imported 10 trajectories" in r.stdout and "PACE (" in r.stdout and "ACE (" in r.stdout
    assert "all-MiniLM-L6-v2@256" in r.stdout and "smollm2" in r.stdout


@pytest.mark.slow
def test_import_and_replay_default_to_the_real_embedder_and_tokenizer(tmp_path, data):
    r = cli("import", str(data), "--embedder", "minilm", "--tokenizer", "smollm2", cwd=tmp_path)
    assert r.returncode == 1 and "demo/1" in r.stdout  # the broken second line is refused
    r = cli("replay", "--data", str(data), "--policy", "pace,pace_plus", "--budget", "600", "--out", "out",
            "--no-mlflow", "--json", "--embedder", "minilm", "--tokenizer", "smollm2", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout)
    assert summary["embedder"] == "all-MiniLM-L6-v2@256" and "smollm2" in summary["tokenizer"]


def test_replay_and_report_from_the_command_line(tmp_path, data):
    r = cli("replay", "--data", str(data), "--policy", "full,window,pace", "--budget", "300", "--out", "out",
            "--no-mlflow", "--json", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout)  # stdout is the JSON and nothing else
    assert set(summary["policies"]) == {"full", "window", "pace"} and summary["budget"] == 300
    assert "line 2" in r.stderr  # the broken line is reported as skipped
    r = cli("report", "out", cwd=tmp_path)
    assert r.returncode == 0 and (tmp_path / "out" / "report.md").is_file()
    assert (tmp_path / "out" / "recall_vs_ratio.png").is_file()


@pytest.mark.parametrize("args,message", [
    (["--policy", "magic"], "unknown policy type 'magic'"),
    (["--policy", "pace,pace"], "lists a policy twice"),
    (["--budget", "0"], "positive integer"),
    (["--data", "missing.jsonl"], "not found"),
])
def test_replay_bad_input(tmp_path, data, args, message):
    base = {"--data": str(data), "--policy": "pace", "--budget": "300", "--out": "out"}
    for i in range(0, len(args), 2):
        base[args[i]] = args[i + 1]
    flat = [x for kv in base.items() for x in kv]
    r = cli("replay", *flat, "--no-mlflow", cwd=tmp_path)
    assert r.returncode == 2 and message in r.stderr


@pytest.mark.parametrize("body,message", [
    ("name: x\ndata: {file: d.jsonl}\nmemory: {queries: 64, block_size: 32}\n",
     "queries (64) must be fewer than block_size (32)"),
    ("name: x\ndata: {file: d.jsonl}\noptim: {surprise: 1}\n", "optim.surprise: Extra inputs are not permitted"),
    ("name: x\nactor: {path: /nonexistent}\ndata: {file: d.jsonl}\n", "holds no HF model"),
    ("- not a mapping\n", "a training config is a mapping"),
])
def test_train_refuses_bad_configs_before_any_worker(tmp_path, body, message):
    (tmp_path / "c.yaml").write_text(body)
    r = cli("train", "--config", "c.yaml", "--no-mlflow", cwd=tmp_path)
    assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr


def test_train_prints_its_summary_as_one_json_object_and_nothing_else(tmp_path, monkeypatch, capfd):
    """The summary's long strings (a checkpoint path) were wrapped by the console, which broke the JSON."""
    from typer.testing import CliRunner

    import palimpsest.cli.model_commands as commands
    from palimpsest.cli import app

    (tmp_path / "c.yaml").write_text("name: x\ndata: {file: d.jsonl}\n")
    path = "/a/very/long/path/" + "x" * 200 + "/checkpoint_2026-12-03_17-56-56.324472"

    def fake_launch(cfg, track=True):  # stands in for Ray Train: this test is about what reaches stdout
        print("a library's notice")
        return {"name": cfg.name, "checkpoint": path, "registered": "models:/palimpsest-memory/3"}

    monkeypatch.setattr(commands, "launch", fake_launch)
    monkeypatch.chdir(tmp_path)
    r = CliRunner().invoke(app, ["train", "--config", "c.yaml", "--no-mlflow"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["checkpoint"] == path and doc["registered"].endswith("/3")


@pytest.mark.parametrize("args,message", [
    (("eval-reconstruction", "--model", "m", "--data", "d", "--spans", "1"),
     "Input should be greater than or equal to 2"),
    (("eval-reconstruction", "--model", "m", "--data", "d", "--split", "val"),
     "'val' is not one of held-out, train, all"),
    (("eval-reconstruction", "--model", "m", "--data", "d", "--split", "train", "--include-train"), "contradicts"),
])
def test_a_bad_option_value_is_a_usage_error_naming_the_option_not_a_traceback(tmp_path, args, message):
    r = cli(*args, cwd=tmp_path)
    assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr, r.stderr[-1500:]


def test_eval_memory_refuses_what_is_not_a_model(tmp_path, data):
    r = cli("eval-memory", "--model", "not-a-model", "--data", str(data), cwd=tmp_path)
    assert r.returncode == 2 and "neither a memory bundle directory nor an MLflow model URI" in r.stderr


def test_json_mode_sends_whatever_libraries_print_to_stderr(capfd):
    """What a library prints while a --json command works (DeepSpeed's accelerator notice is one) must not
    reach stdout, whether through Python's sys.stdout or straight to file descriptor 1."""
    import os

    from palimpsest.cli import _json_stdout

    with _json_stdout(True):
        print("[WARNING] [real_accelerator.py] Setting accelerator to CPU")
        os.write(1, b"a C library line\n")
    print('{"ok": true}')
    got = capfd.readouterr()
    assert got.out == '{"ok": true}\n'
    assert "real_accelerator" in got.err and "a C library line" in got.err


def _strict(text: str):
    """JSON as a strict parser reads it: NaN and Infinity are not JSON."""
    def refuse(name):
        raise ValueError(f"{name} is not JSON")
    return json.loads(text, parse_constant=refuse)


def test_json_output_is_strict_json_a_figure_that_is_not_a_number_is_null(capsys):
    """An eval with no verdict has no mean and no p-value: --json writes them as null, never NaN."""
    import numpy as np

    from palimpsest.cli.common import print_json

    print_json({"mean": float("nan"), "hi": [float("inf"), 1.5], "p": {"x": -float("inf")}, "n": 0,
                "kl": np.float32("nan"), "m": np.float32(0.5), "k": np.int64(3)}, default=float)
    assert _strict(capsys.readouterr().out) == {"mean": None, "hi": [None, 1.5], "p": {"x": None}, "n": 0,
                                                "kl": None, "m": 0.5, "k": 3}


def test_every_json_flag_prints_through_the_one_strict_writer():
    src = Path(__file__).resolve().parents[1] / "src" / "palimpsest" / "cli"
    for path in src.glob("*.py"):
        text = path.read_text()
        for bad in ("print(json.dumps(", "sys.stdout.write(_json.dumps(", "sys.stdout.write(json.dumps("):
            assert bad not in text, f"{path.name}: {bad} (use common.print_json)"
