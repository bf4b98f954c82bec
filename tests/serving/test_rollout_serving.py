"""The served app with a dark memory candidate of `pace`, end to end on the tiny actor: no session lands on the
candidate, a served `pace` turn is judged for it (the pair recorded for that turn, nothing served for it), and
the stages written to the ledger are followed by the live router within a refresh."""

from __future__ import annotations

import time

import httpx
import pytest

from palimpsest.platform import Ledger
from tests.serving.conftest import free_port, tiny_config

pytestmark = [pytest.mark.slow, pytest.mark.ray, pytest.mark.vllm]

OBS = "def parse_config(env): return env['database_url']\nsettings/loader.py:12: KeyError"


@pytest.fixture(scope="module")
def server(tiny_dir, tiny_memory, tmp_path_factory):
    from palimpsest.serving.local import LocalServer

    cfg = tiny_config(tiny_dir, tiny_memory, tmp_path_factory.mktemp("serve") / "ledger.db")
    cfg.pop("auth")  # one tenant on loopback
    cfg["arms"] = [{"name": "pace", "policy": {"type": "pace"}, "weight": 1.0},
                   {"name": "pace+memory", "policy": {"type": "pace"}, "memory": True, "candidate_of": "pace",
                    "canary_share": 0.5}]
    # every pace turn judged; the stages are the test's to write (the replica's gate never has enough pairs)
    cfg["ab"] = {"candidate_rate": 1.0, "shadow_queue": 8, "refresh_s": 1.0, "gate_min_pairs": 1000}
    srv = LocalServer(cfg, port=free_port())
    srv.start(timeout_s=600)
    yield srv
    srv.stop()


def _stage(c: httpx.Client, want: str, timeout_s: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        state = c.get("/readyz").json()["rollouts"]["pace+memory"]
        if state["stage"] == want or time.monotonic() > deadline:
            return state
        time.sleep(0.25)


def test_a_dark_candidate_is_judged_live_and_the_router_follows_the_ledger(server):
    with httpx.Client(base_url=server.url, timeout=120) as c:
        state = _stage(c, "dark")
        assert state["stage"] == "dark" and state["memory"] and "memory=" in state["subject"]
        arms = {c.post("/v1/sessions", json={"session_id": f"d{i}", "task": "t"}).json()["arm"] for i in range(40)}
        assert arms == {"pace"}
        r = c.post("/v1/sessions", json={"session_id": "asked", "task": "t", "arm": "pace+memory"})
        assert r.status_code == 422 and "dark candidate" in r.text

        sid = "judged"
        assert c.post("/v1/sessions", json={"session_id": sid, "task": "Fix the failing test"}).json()["arm"] == "pace"
        for t in range(14):  # more than the budget holds: the memory reads what the prompt leaves out
            r = c.post(f"/v1/sessions/{sid}/steps", json={"kind": "bash", "action": f"grep -n parse_config # {t}",
                                                          "observation": OBS, "tool": "bash"})
            assert r.status_code == 200, r.text
        turn = c.post(f"/v1/sessions/{sid}/turn", json={"max_tokens": 4}).json()
        assert turn["arm"] == "pace"
        lane = c.get("/v1/ab/shadow", params={"wait_s": 180}).json()
        assert lane["drained"] and lane["paired"] == 1 and lane["sampled"] == 0, lane

        led = Ledger(server.cfg.ledger)
        (pair,) = led.shadow_pairs()
        assert (pair["session_id"], pair["t"], pair["control"]) == (sid, turn["t"], "pace")
        assert pair["status"] == "scored" and pair["reference"] and pair["candidate_kl"] >= 0
        assert pair["candidate_tokens"] > 0 and pair["control_tokens"] == turn["tokens"]["prompt"]
        assert {r["arm"] for r in led.served()} == {"pace"} and led.shadows() == []
        metrics = c.get("/metrics").text
        assert 'palimpsest_rollout_stage{candidate="pace+memory",control="pace",stage="dark"} 1.0' in metrics
        assert 'palimpsest_shadow_pairs_total{candidate="pace+memory",status="scored"} 1.0' in metrics

        # decisions in the ledger (as the gate of any replica appends them) are followed within a refresh
        first = led.record_rollout("pace+memory", "pace", state["subject"], "canary", "promote", {"by": "test"}, 0)
        assert _stage(c, "canary")["stage"] == "canary"
        canary = {f"c{i}": c.post("/v1/sessions", json={"session_id": f"c{i}", "task": "t"}).json()["arm"]
                  for i in range(40)}
        assert set(canary.values()) == {"pace", "pace+memory"}
        assert led.record_rollout("pace+memory", "pace", state["subject"], "withdrawn", "withdraw", {"by": "test"},
                                  first)
        assert _stage(c, "withdrawn")["stage"] == "withdrawn"
        after = {c.post("/v1/sessions", json={"session_id": f"w{i}", "task": "t"}).json()["arm"] for i in range(40)}
        assert after == {"pace"}
        # a session created on the canary is served by its control once the candidate is withdrawn
        was = next(s for s, a in canary.items() if a == "pace+memory")
        c.post(f"/v1/sessions/{was}/steps", json={"kind": "bash", "action": "ls", "observation": "a b", "tool": "bash"})
        assert c.post(f"/v1/sessions/{was}/turn", json={"max_tokens": 4}).json()["arm"] == "pace"
        assert c.post("/v1/sessions", json={"session_id": was, "task": "t"}).json()["arm"] == "pace"
