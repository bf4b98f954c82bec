"""Scale-out: two ingress replicas on two Ray nodes over one PostgreSQL ledger serve one session's interleaved
appends and turns with no lost or duplicated step; unreachable dependencies fail at start-up with a clear error."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import yaml

from palimpsest.platform import Ledger, LedgerUnavailableError, RuleSummarizer, Runtime
from palimpsest.platform.types import PalimpsestError
from tests import pg
from tests.serving.conftest import KEYS, free_port, tiny_config

AUTH = {"Authorization": f"Bearer {KEYS['alice']}"}


def test_an_unreachable_database_or_tracking_server_fails_before_anything_starts(tiny_dir, tiny_memory, tmp_path,
                                                                                 monkeypatch):
    from palimpsest.serving.app import build_app

    for var in ("MLFLOW_TRACKING_URI", "PALIMPSEST_MLFLOW_ARTIFACTS"):  # build_app exports the config's tracking:
        monkeypatch.setenv(var, "-")  # setenv first, so that teardown restores what was there before
        monkeypatch.delenv(var)
    cfg = tiny_config(tiny_dir, tiny_memory, "postgresql://agent:pw@127.0.0.1:1/ledger")
    with pytest.raises(LedgerUnavailableError, match=r"cannot connect to the ledger database "
                                                     r"postgresql://agent:\*\*\*@127.0.0.1:1/ledger"):
        build_app(cfg)
    cfg = tiny_config(tiny_dir, tiny_memory, tmp_path / "l.db") | {"tracking": {"uri": "http://127.0.0.1:1"}}
    with pytest.raises(PalimpsestError, match="cannot reach the MLflow tracking server at http://127.0.0.1:1"):
        build_app(cfg)


def test_palimpsest_serve_names_the_unreachable_database_and_exits_2(tiny_dir, tiny_memory, tmp_path):
    cfg = tiny_config(tiny_dir, tiny_memory, "postgresql://agent:pw@127.0.0.1:1/ledger")
    (tmp_path / "serve.yaml").write_text(yaml.safe_dump(cfg))
    exe = Path(sys.executable).with_name("palimpsest")
    proc = subprocess.run([str(exe), "serve", "--config", str(tmp_path / "serve.yaml"), "--port", str(free_port())],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          env={k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"} | {"COLUMNS": "300"})
    assert proc.returncode == 2
    assert "cannot connect to the ledger database postgresql://agent:***@127.0.0.1:1/ledger" in proc.stderr
    assert "Traceback" not in proc.stderr and "pw@" not in proc.stderr


def test_several_ingress_replicas_need_a_shared_ledger(tiny_dir, tiny_memory, tmp_path):
    from palimpsest.serving.serve_config import parse_serve_config

    with pytest.raises(Exception, match="replicas.ingress=2 needs a ledger every replica reaches"):
        parse_serve_config(tiny_config(tiny_dir, tiny_memory, tmp_path / "l.db") | {"replicas": {"ingress": 2}})


def test_a_lost_database_is_a_retriable_503():
    import asyncio

    from palimpsest.serving.http.server import _palimpsest_error

    resp = asyncio.run(_palimpsest_error(None, LedgerUnavailableError("lost the ledger database postgresql://h/d")))
    assert resp.status_code == 503 and resp.headers["retry-after"] == "5"


@pytest.fixture(scope="module")
def two_nodes(tiny_dir, tiny_memory):
    """A two-node Ray cluster (two raylets on this machine) serving the app with two ingress replicas, one
    per node, over one PostgreSQL ledger."""
    import ray
    from ray.cluster_utils import Cluster

    from palimpsest.serving.local import LocalServer

    # One HTTP proxy here (on the head node), where a cluster has one per node behind a load balancer: let it
    # route to both nodes' replicas instead of preferring its own node's (inherited by the raylets' workers).
    saved = os.environ.get("RAY_SERVE_PROXY_PREFER_LOCAL_NODE_ROUTING")
    os.environ["RAY_SERVE_PROXY_PREFER_LOCAL_NODE_ROUTING"] = "0"
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False, configure_logging=False)
    try:
        with pg.fresh_schema() as url:
            cfg = tiny_config(tiny_dir, tiny_memory, url)
            cfg["replicas"] = {"ingress": 2, "ingress_max_per_node": 1}
            # Shares small enough that any placement fits: the spread of the ingress is what is under test.
            cfg["resources"] = {"ingress": 0.05, "actor": 0.6, "embedder": 0.05, "summarizer": 0.05, "memory": 0.1}
            srv = LocalServer(cfg, port=free_port())
            srv.start(timeout_s=600)
            try:
                yield srv, url
            finally:
                srv.stop()
    finally:
        ray.shutdown()
        cluster.shutdown()
        if saved is None:
            os.environ.pop("RAY_SERVE_PROXY_PREFER_LOCAL_NODE_ROUTING", None)
        else:
            os.environ["RAY_SERVE_PROXY_PREFER_LOCAL_NODE_ROUTING"] = saved


@pytest.mark.slow
@pytest.mark.ray
@pytest.mark.vllm
def test_two_replicas_on_two_nodes_interleave_one_session_with_no_lost_or_duplicated_step(two_nodes):
    srv, url = two_nodes
    n = 12
    replicas: set[str] = set()
    with httpx.Client(base_url=srv.url, headers=AUTH, timeout=120) as http, ThreadPoolExecutor(4) as pool:
        r = http.post("/v1/sessions", json={"session_id": "shared", "task": "fix the failing test", "arm": "pace"})
        assert r.status_code == 200, r.text
        for t in range(n):
            step = {"t": t, "kind": "bash", "action": f"run step {t}", "observation": f"output {t}"}
            # The same append sent twice at once (a client retrying through another replica) ...
            appends = list(pool.map(lambda _: http.post("/v1/sessions/shared/steps", json=step), range(2)))
            assert [a.status_code for a in appends] == [200, 200], [a.text for a in appends]
            assert appends[0].json()["step_id"] == appends[1].json()["step_id"]  # ... is stored once
            # ... and two turns of the session at once, served by whichever replicas take them.
            turns = list(pool.map(lambda _: http.post("/v1/sessions/shared/turn", json={"max_tokens": 2}), range(2)))
            assert [x.status_code for x in turns] == [200, 200], [x.text for x in turns]
            replicas.update(x.headers["x-palimpsest-replica"] for x in appends + turns)
    assert len(replicas) == 2, replicas  # both replicas served the session ...
    assert len({r.split("@")[1] for r in replicas}) == 2, replicas  # ... from two Ray nodes

    # Every ledger connection of both replicas dropped (a database fail-over, a network blip): the pools
    # notice on checkout and reconnect, so the next requests are served and nothing is lost.
    import psycopg

    with psycopg.connect(pg.server_url(), autocommit=True) as admin:
        killed = admin.execute("SELECT COUNT(pg_terminate_backend(pid)) FROM pg_stat_activity WHERE "
                               "datname = current_database() AND pid <> pg_backend_pid() AND backend_type = "
                               "'client backend'").fetchone()[0]
    assert killed >= 2
    with httpx.Client(base_url=srv.url, headers=AUTH, timeout=120) as http:
        step = {"t": n, "kind": "bash", "action": f"run step {n}", "observation": f"output {n}"}
        for _ in range(2):  # whichever replica takes them
            r = http.post("/v1/sessions/shared/steps", json=step)
            assert r.status_code == 200, r.text
            assert http.post("/v1/sessions/shared/turn", json={"max_tokens": 2}).status_code == 200
    n += 1

    led = Ledger(url)
    sid = "alice::shared"
    steps = led.snapshot(sid).steps
    assert [s.t for s in steps] == list(range(n)) and len({s.id for s in steps}) == n
    assert [s.action for s in steps] == [f"run step {t}" for t in range(n)] and led.verify(sid) == n
    assert len(led.audit(sid)) == 2 * n and len([r for r in led.served() if r["session_id"] == sid]) == 2 * n
    # Background enrichment ran on both replicas: every step ends up with its rule summary, key and an
    # LLM summary, each written once.
    rt = Runtime(led)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        no_sum = led._read("SELECT COUNT(*) FROM steps s WHERE s.session_id=? AND NOT EXISTS "
                           "(SELECT 1 FROM abstractions a WHERE a.step_id=s.id AND a.producer=?)",
                           (sid, RuleSummarizer.name))[0][0]
        no_key = led._read("SELECT COUNT(*) FROM steps s WHERE s.session_id=? AND NOT EXISTS "
                           "(SELECT 1 FROM keys k WHERE k.step_id=s.id)", (sid,))[0][0]
        if no_sum == 0 and no_key == 0:
            break
        time.sleep(1)
    assert (no_sum, no_key) == (0, 0)
    dup = led._read("SELECT step_id, producer, COUNT(*) FROM abstractions GROUP BY step_id, producer "
                    "HAVING COUNT(*) > 1")
    assert dup == []
    assert rt.ledger.count(sid) == n
    led.close()
