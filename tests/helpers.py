"""Small hand-built sessions for the tests."""

from __future__ import annotations

import numpy as np

from palimpsest.platform import Authority, StepRecord

TASK = "Fix the KeyError 'database_url' raised by parse_config in settings/loader.py when the env file is empty."


def step(t: int, action: str, observation: str | None = "", kind: str = "bash", thought: str = "",
         authority: Authority = Authority.TOOL) -> StepRecord:
    return StepRecord(t=t, kind=kind, action=action, thought=thought, observation=observation, authority=authority,
                      tool=action.split()[0] if action else None)


# A session where step 1 is plainly what the latest steps are about and the others are not.
STEPS = [
    ("ls images/", "cat.png dog.png horse.png zebra.png"),
    ("cat settings/loader.py",
     "def parse_config(env):\n    url = env['database_url']  # KeyError when the env file is empty\n"
     "    return Config(database_url=url, pool_size=env.get('pool_size', 5))"),
    ("curl https://weather.example.com/today", "sunny, 23 degrees, light wind from the west"),
    ("du -sh assets/", "412M assets/"),
    ("cat tests/test_loader.py",
     "def test_parse_config_empty_env():\n    assert parse_config({}).database_url is None  # settings/loader.py"),
    ("echo hello world", "hello world"),
    ("git log --oneline settings/loader.py", "a1b2c3d parse_config: read database_url from the env file"),
    ("date", "Mon Nov 30 10:00:00 UTC 2026"),
    ("whoami", "builder"),
    ("uptime", "up 3 days, load average 0.10 0.20 0.30"),
    ("python -c 'from settings.loader import parse_config; parse_config({})'",
     "Traceback (most recent call last):\n  File \"settings/loader.py\", line 2, in parse_config\n"
     "KeyError: 'database_url'"),
    ("grep -n database_url settings/loader.py",
     "2:    url = env['database_url']  # KeyError when the env file is empty"),
]


#: Planning every turn anew (the seeds' behaviour): what the tests of a policy's or the compiler's per-turn
#: decisions compile with, since every policy runs in compaction epochs by default (platform/compile/epochs.py).
PER_TURN = {"mode": "per_turn"}


def per_turn(name: str, **fields) -> dict:
    """A policy config (by type) that plans every turn."""
    return {"type": name, "compaction": PER_TURN, **fields}


def same_snapshot(a, b) -> None:
    """Two snapshots hold the same session state (every column a policy reads)."""
    assert a.t == b.t and [s.id for s in a.steps] == [s.id for s in b.steps]
    np.testing.assert_array_equal(a.step_ids, b.step_ids)
    np.testing.assert_array_equal(a.tokens, b.tokens)
    assert a.bodies == b.bodies and a.abstractions == b.abstractions
    np.testing.assert_array_equal(a.has_key, b.has_key)
    np.testing.assert_array_equal(a.keys[a.has_key], b.keys[b.has_key])
    assert dict(a.folds) == dict(b.folds) and dict(a.last_context_tokens) == dict(b.last_context_tokens)
    assert a.prefix_tokens == b.prefix_tokens
    sa, sb = a.salient_index(), b.salient_index()
    for q in (frozenset({"src/mod_3.py"}), frozenset({"f_7", "TOKEN7"}), frozenset()):
        np.testing.assert_array_equal(sa.overlap(q), sb.overlap(q))
    np.testing.assert_array_equal(sa.ready, sb.ready)


def error_message(r) -> str:
    """The message of an error response, once its body is checked to have the shape of the protocol its route
    speaks (``palimpsest.serving.http.errors``): Anthropic's on the Messages routes, OpenAI's on the chat and
    completion routes, Palimpsest's one-line body elsewhere."""
    from palimpsest.serving.http import errors

    body = r.json()
    protocol = errors.protocol_of(r.request.url.path, "anthropic-version" in r.request.headers)
    if protocol == errors.ANTHROPIC:
        assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, body
        assert body["error"]["type"] == errors.ANTHROPIC_TYPES.get(r.status_code, body["error"]["type"]), body
        return body["error"]["message"]
    if protocol == errors.OPENAI:
        assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
        assert body["error"]["type"] == ("server_error" if r.status_code >= 500 else "invalid_request_error"), body
        return body["error"]["message"]
    assert set(body) == {"error"} and isinstance(body["error"], str), body
    return body["error"]
