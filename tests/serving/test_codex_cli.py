"""Codex CLI (npm ``@openai/codex``, pinned) through the gateway's Responses API: ``codex exec`` against the
embedded default app (SmolLM2, pace) exits 0, its steps are recorded in the session its thread names, and a
second turn (``codex exec resume --last``) continues the same session. Skipped only where npm cannot install
the CLI."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from palimpsest.platform import Ledger
from tests.serving.conftest import free_port

pytestmark = [pytest.mark.slow, pytest.mark.ray, pytest.mark.vllm, pytest.mark.e2e]

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import codex_cli  # noqa: E402  (the CLI's pinned version and the settings a small window needs)


@pytest.fixture(scope="module")
def codex() -> Path:
    if not codex_cli.CLI.exists():
        npm = shutil.which("npm")
        if npm is None:
            pytest.skip("npm is not installed")
        try:
            subprocess.run([npm, "install", "--no-audit", "--no-fund", "--prefix", str(ROOT / ".cache" / "npm"),
                            f"@openai/codex@{codex_cli.CLI_VERSION}"], check=True, capture_output=True, timeout=600)
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as e:
            pytest.skip(f"npm could not install @openai/codex@{codex_cli.CLI_VERSION}: {e}")
    version = subprocess.run([str(codex_cli.CLI), "--version"], capture_output=True, text=True, timeout=60).stdout
    assert codex_cli.CLI_VERSION in version, version
    return codex_cli.CLI


def test_codex_exec_runs_two_turns_of_one_session_through_the_gateway(codex, tmp_path):
    from palimpsest.serving.local import LocalServer

    ledger = tmp_path / "ledger.db"
    cfg = {"ledger": str(ledger), "summarizer": {"mode": "rule"}, "memory": {"model": None},
           "arms": [{"name": "pace", "policy": {"type": "pace"}}]}
    home, work = tmp_path / "home", tmp_path / "work"
    (home / ".codex").mkdir(parents=True)
    work.mkdir()
    (work / "notes.txt").write_text("remember the milk\n")
    env = {"PATH": os.environ["PATH"], "HOME": str(home), "CODEX_HOME": str(home / ".codex"),
           "PALIMPSEST_API_KEY": "unused-locally", "NO_COLOR": "1"}
    with LocalServer(cfg, port=free_port()) as srv:
        model = srv.cfg.actor.model
        first = subprocess.run(codex_cli.codex_command(srv.url, model, str(home), False, "Say which files are in "
                                                       "the current directory.", False),
                               cwd=work, env=env, capture_output=True, text=True, timeout=900)
        assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-2000:]
        second = subprocess.run(codex_cli.codex_command(srv.url, model, str(home), False, "In one short sentence: "
                                                        "what does notes.txt say?", True),
                                cwd=work, env=env, capture_output=True, text=True, timeout=900)
    led = Ledger(str(ledger))
    rows = [r for r in led.served() if "error" not in r]
    (session,) = {r["session_id"] for r in rows}  # the thread id Codex sends as prompt_cache_key names it
    assert second.returncode == 0 and len(rows) == 2, second.stdout[-2000:] + second.stderr[-2000:]
    steps = led.steps(session, 0, 10)
    assert steps[0].observation == "Say which files are in the current directory."
    assert steps[-1].observation == "In one short sentence: what does notes.txt say?"
    assert rows[1]["tokens_cached"] > 0  # the second turn extends the first: the prefix cache held it
    assert '"reasoning.encrypted_content"' in rows[0]["requested_include"]
