"""Faults while serving: a child replica killed under load. Turns are still served (the embedder down:
planned without keys) or get a retriable 503 (the actor restarting); Serve replaces the replica;
enrichment catches up; nothing in the ledger is lost. (RELIABILITY.md reports the figures.)"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from palimpsest.platform import Ledger
from tests.serving.conftest import KEYS

pytestmark = [pytest.mark.slow, pytest.mark.ray, pytest.mark.vllm]
AUTH = {"Authorization": f"Bearer {KEYS['alice']}"}


def kill_replicas(deployment: str) -> int:
    import ray

    killed = 0
    for a in ray.util.list_named_actors(all_namespaces=True):
        if f"#{deployment}#" in a["name"]:
            ray.kill(ray.get_actor(a["name"], namespace=a["namespace"]), no_restart=True)
            killed += 1
    return killed


def session(c, sid, steps):
    c.post("/v1/sessions",
           json={"session_id": sid, "task": "Fix parse_config in settings/loader.py"}).raise_for_status()
    for t in range(steps):
        c.post(f"/v1/sessions/{sid}/steps",
               json={"action": f"grep -n parse_config settings/loader.py # {t}",
                     "observation": "settings/loader.py:12: def parse_config(env)"}).raise_for_status()


def wait_for(pred, timeout_s: float, every: float = 0.5):
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if pred():
            return True
        time.sleep(every)
    return False


def test_embedder_killed_turns_still_served_and_enrichment_catches_up(server):
    ledger = Ledger(server.cfg.ledger)
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=120) as c:
        session(c, "fault-emb", 5)
        assert wait_for(lambda: not ledger.pending("alice::fault-emb", "hashing-256-512")[1], 60)
        assert kill_replicas("Embedder") >= 1
        session(c, "fault-emb", 0)
        for t in range(3):  # appended while the embedder is down: durable at once
            r = c.post("/v1/sessions/fault-emb/steps",
                       json={"action": f"cat settings/loader.py # {t}", "observation": "x"})
            assert r.status_code == 200
        codes = [c.post("/v1/sessions/fault-emb/turn", json={"max_tokens": 2}).status_code for _ in range(3)]
        assert codes == [200, 200, 200]
        # Serve replaces the replica and the retried enrichment writes every missing key.
        assert wait_for(lambda: not ledger.pending("alice::fault-emb", "hashing-256-512")[1], 120)
        assert ledger.verify("alice::fault-emb") == 8
        metrics = c.get("/metrics").text
        fallbacks = sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                        if line.startswith("palimpsest_fallbacks_total{"))
        print(f"embedder killed: 3/3 turns served, {fallbacks:.0f} on the no-key fallback; keys complete after restart")


def test_actor_killed_under_load_gives_retriable_errors_then_recovers(server):
    ledger = Ledger(server.cfg.ledger)
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=300) as c:
        for k in range(4):
            session(c, f"fault-act-{k}", 4)
        before = {k: ledger.hashes(f"alice::fault-act-{k}") for k in range(4)}

        def turns(k):
            out = []
            for _ in range(3):
                out.append(c.post(f"/v1/sessions/fault-act-{k}/turn", json={"max_tokens": 4}))
            return out

        with ThreadPoolExecutor(4) as pool:
            futures = [pool.submit(turns, k) for k in range(4)]
            time.sleep(0.5)
            assert kill_replicas("Actor") >= 1
            replies = [r for f in futures for r in f.result()]
        codes = [r.status_code for r in replies]
        assert set(codes) <= {200, 503}, [(r.status_code, r.text[:200]) for r in replies
                                          if r.status_code not in (200, 503)]
        assert all(r.headers.get("retry-after") for r in replies if r.status_code == 503)
        # Serve starts a new Actor replica; turns succeed again.
        assert wait_for(lambda: c.post("/v1/sessions/fault-act-0/turn", json={"max_tokens": 2}).status_code == 200,
                        300, 2)
        for k in range(4):
            assert ledger.hashes(f"alice::fault-act-{k}") == before[k] and ledger.verify(f"alice::fault-act-{k}") == 4
        print(f"actor killed under load: {codes.count(200)} turns served, {codes.count(503)} retriable 503, 0 other")
