"""The remote actor: Palimpsest in front of an upstream OpenAI-compatible server. The slow tests start a real
second vLLM server process (SmolLM2, prompt embeds enabled) on 127.0.0.1."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time

import httpx
import pytest

from palimpsest.serving.models.remote import RemoteEngine, UpstreamUnavailable
from palimpsest.serving.serve_config import ActorConfig
from tests.serving.conftest import free_port


def test_an_upstream_that_is_down_is_unavailable_after_bounded_retries():
    port = free_port()  # nothing listens there
    cfg = ActorConfig(model="smollm2", remote={"url": f"http://127.0.0.1:{port}", "retries": 2, "connect_timeout_s": 1})
    engine = RemoteEngine(cfg, "unused")

    async def go():
        try:
            await engine.start(hidden_size=8)
        finally:
            await engine.close()

    with pytest.raises(UpstreamUnavailable, match="after 3 attempts"):
        asyncio.run(go())
    assert engine.stats["retries"] == 2


def test_the_remote_config_is_checked_before_anything_starts():
    from palimpsest.platform.types import ConfigError
    from palimpsest.serving.serve_config import parse_serve_config

    with pytest.raises(ConfigError, match="url"):
        parse_serve_config({"actor": {"remote": {"url": "not a url"}}})


def upstream_prompt_tokens(url: str) -> int:
    """The prompt tokens the upstream vLLM server has prefilled, from its own Prometheus counter."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    rows = [ln for ln in text.splitlines() if ln.startswith("vllm:prompt_tokens_total")]
    assert rows, "the upstream exports no vllm:prompt_tokens_total"
    return int(sum(float(ln.rsplit(" ", 1)[1]) for ln in rows))


@pytest.fixture(scope="module")
def upstream():
    """`python -m vllm.entrypoints.openai.api_server` with SmolLM2 on a free port, prompt embeds enabled."""
    from palimpsest.models.registry import resolve_actor_path

    path = str(resolve_actor_path("smollm2"))
    port = free_port()
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_HOST_IP": "127.0.0.1"}
    proc = subprocess.Popen([sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", path,
                             "--host", "127.0.0.1", "--port", str(port), "--max-model-len", "2048",
                             "--enable-prompt-embeds", "--dtype", "float32", "--enforce-eager"],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"the upstream vLLM server exited: {proc.stderr.read()[-2000:]}")
        try:
            if httpx.get(f"{url}/v1/models", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(2)
    else:
        proc.kill()
        pytest.fail("the upstream vLLM server did not start within 600 s")
    yield url, path
    proc.terminate()
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()


@pytest.mark.slow
@pytest.mark.vllm
def test_text_and_soft_memory_turns_go_to_a_real_upstream_vllm(upstream):
    from pathlib import Path

    import torch

    from palimpsest.serving.models.engine import load_embedding_table

    url, path = upstream
    table = load_embedding_table(Path(path))
    cfg = ActorConfig(model=path, max_model_len=2048, remote={"url": url})
    engine = RemoteEngine(cfg, path, table)
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hello."}]

    async def go():
        try:
            await engine.start(int(table.shape[1]))
            text = await engine.generate({"messages": messages, "max_tokens": 8, "temperature": 0.0})
            events = [e async for e in engine.stream({"messages": messages, "max_tokens": 8, "temperature": 0.0})]
            soft = {"soft": torch.randn(4, table.shape[1]) * 0.01, "ms": 0.0, "cached": False}
            embeds = await engine.generate({"context": [1, 2, 3], "bridge": [4], "max_tokens": 4}, soft)
            return text, events, embeds
        finally:
            await engine.close()

    text, events, embeds = asyncio.run(go())
    assert engine.prompt_embeds and engine.model
    assert text["text"] and text["completion_tokens"] >= 1 and text["prompt_tokens"] > 10
    deltas = "".join(e["delta"] for e in events if not e.get("done"))
    assert events[-1]["done"] and deltas == events[-1]["text"] == text["text"]  # greedy: the same reply
    assert embeds["prompt_tokens"] == 3 + 4 + 1 and embeds["completion_tokens"] >= 1


@pytest.mark.slow
@pytest.mark.ray
@pytest.mark.vllm
def test_the_served_app_is_a_gateway_in_front_of_the_upstream(upstream, tmp_path):
    from palimpsest.serving.local import LocalServer

    url, path = upstream
    cfg = {"ledger": str(tmp_path / "ledger.db"), "embedder": "hashing", "budget": 1500,
           "actor": {"model": path, "max_model_len": 2048, "max_tokens": 8, "max_embeds_len": 2048,
                     "remote": {"url": url}},
           "summarizer": {"mode": "rule"}, "memory": {"model": None},
           "arms": [{"name": "pace", "policy": {"type": "pace"}}]}
    srv = LocalServer(cfg, port=free_port()).start(timeout_s=600)
    try:
        ready = httpx.get(f"{srv.url}/readyz", timeout=30).json()
        assert ready["remote"] == url and ready["prompt_embeds"] is True
        # a history well past the budget: the compiled prompt must fit it as the upstream counts it
        msgs = [{"role": "user", "content": "Find why the settings loader fails."}]
        for i in range(24):
            msgs += [{"role": "assistant", "content": f"sed -n {i * 40},{i * 40 + 40}p settings/loader.py"},
                     {"role": "user", "content": f"{i}: " + "def parse_config(env): return env['database_url'] " * 12}]
        before = upstream_prompt_tokens(url)
        r = httpx.post(f"{srv.url}/v1/chat/completions", json={"messages": msgs, "user": "gw-1", "max_tokens": 8,
                                                               "temperature": 0}, timeout=300)
        assert r.status_code == 200, r.text
        body = r.json()
        upstream_counted = upstream_prompt_tokens(url) - before  # what the upstream itself prefilled
        tokens = body["palimpsest"]["tokens"]
        assert tokens["full_history_estimate"] > 2 * 1500  # the budget bites
        assert tokens["generations"] == 1 and body["usage"]["completion_tokens"] >= 1
        # the upstream's own count is the one the user pays: reported as usage, equal to the local count of the
        # compiled ids, and within the budget with the reply
        assert body["usage"]["prompt_tokens"] == upstream_counted == tokens["context"]
        assert upstream_counted + 8 <= 1500
        assert isinstance(body["choices"][0]["message"]["content"], str)
    finally:
        srv.stop()
