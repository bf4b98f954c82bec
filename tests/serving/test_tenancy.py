"""A tenant's pinned policy, budget and compaction mode, and a request's context edit on top: which policy
config serves a turn (``serving.http.tenancy``), without a server."""

from __future__ import annotations

import hashlib

import pytest

from palimpsest.platform import Ledger, Runtime
from palimpsest.platform.compile.budget import Budget
from palimpsest.platform.compile.context_edits import ContextEdits
from palimpsest.platform.policies import parse_policy_config
from palimpsest.platform.types import ConfigError
from palimpsest.serving.http.tenancy import OFF, PinnedError, TurnPolicies
from palimpsest.serving.serve_config import parse_serve_config

KEY = hashlib.sha256(b"k").hexdigest()


def config(**tenants) -> object:
    return parse_serve_config({"embedder": "hashing", "memory": {"model": None},
                               "auth": {"tenants": {name: {"key_sha256": KEY, **pin}
                                                    for name, pin in tenants.items()}}})


@pytest.fixture
def runtime(tmp_path):
    return Runtime(Ledger(str(tmp_path / "l.db")))


def test_a_pinned_policy_budget_and_compaction_mode_serve_the_tenants_sessions_only(runtime):
    cfg = config(a={"policy": {"type": "window", "k": 3}, "budget": 3000, "compaction": "per_turn"},
                 b={"compaction": "off"}, c={})
    arms = {a.name: runtime.policy(a.policy_config()) for a in cfg.arms}
    tp = TurnPolicies(cfg, runtime, arms)
    assert tp.pin("c::s1") is None and tp.pin("s1") is None  # no pin, and the single-tenant server
    assert tp.policy("pace", None, None, Budget(6000, 100)) is arms["pace"]
    pin = tp.pin("a::s1")
    assert pin.budget == 3000
    pol = tp.policy("pace", pin, None, Budget(3000, 100))
    want = parse_policy_config({"type": "window", "k": 3, "compaction": {"mode": "per_turn"}})
    assert pol.name == "window" and pol.config_hash == want.config_hash()
    assert tp.policy("pace", pin, None, Budget(3000, 100)) is pol  # built once
    off = tp.policy("pace", tp.pin("b::s"), None, Budget(6000, 100))
    assert off.config_hash == parse_policy_config(OFF).config_hash()
    # a pinned per_turn (or off) admits no context edit, and a pinned budget no other budget: both refused
    with pytest.raises(PinnedError, match="^context_management: this tenant's compaction is pinned to 'per_turn'"):
        tp.policy("pace", pin, ContextEdits(kind="compaction", trigger_tokens=1500), Budget(3000, 100))
    with pytest.raises(PinnedError, match="^budget: this tenant's budget is pinned to 3000"):
        tp.budget(pin, 2000)
    assert tp.budget(pin, None) == tp.budget(pin, 3000) == 3000 and tp.budget(None, 2000) == 2000
    # a pin of epochs takes the edit on top: its watermarks, the pinned policy
    e = TurnPolicies(config(a={"policy": {"type": "window", "k": 3}, "compaction": "epochs"}), runtime, arms)
    edited = e.policy("pace", e.pin("a::s"), ContextEdits(kind="compaction", trigger_tokens=1400), Budget(3000, 100))
    assert edited.name == "window" and edited.cfg.compaction.high == 0.5  # (1,400 input + 100 reserved) / 3,000
    rec = TurnPolicies.recorded(pin, pol)
    assert rec["policy_hash"] == pol.config_hash and '"compaction": "per_turn"' in rec["tenant_pin"]


def test_a_bad_pin_is_refused_with_the_config():
    with pytest.raises(ConfigError, match="policy"):
        config(a={"policy": {"type": "nope"}})
    with pytest.raises(ConfigError, match="compaction"):
        config(a={"compaction": "sometimes"})


def test_every_route_but_health_and_metrics_resolves_its_caller_by_the_one_dependency():
    """The tenant is checked in one place (``ingress.caller``, a FastAPI dependency), not by each handler: every
    route but the health checks, the metrics and the documents depends on it, so a new route that forgets the key
    check fails here (the 401 of each route is ``test_app``'s)."""
    from fastapi.routing import APIRoute

    from palimpsest.serving.http.ingress import app, caller

    def depends(dependant) -> bool:
        return any(d.call is caller or depends(d) for d in dependant.dependencies)

    open_routes = {"/healthz", "/readyz", "/metrics"}
    routes = [r for r in app.routes if isinstance(r, APIRoute)]
    assert len(routes) > 15
    unguarded = sorted(f"{sorted(r.methods)} {r.path}" for r in routes
                       if r.path not in open_routes and not depends(r.dependant))
    assert unguarded == []
    assert not any(depends(r.dependant) for r in routes if r.path in open_routes)
