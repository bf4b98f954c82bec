"""Programmatic recall sessions: a fact shown early that a later action needs, around real agent steps.

REMORY's Stage II needs many boundaries where what the prompt left out matters to the next action. The dev
trajectories give a few dozen at the budgets this machine can train at; these sessions give as many as asked:

    step 0       the agent reads a file or runs a command whose output holds a fact (``API_TOKEN=3f9c1e07a2``,
                 a port, a branch, a build artifact), among lines of real observations;
    steps 1..k   real steps of one source trajectory, in order and of their own kind (shell, code, tool call;
                 observations cut to ``max_observation_chars``, the run's ``data.max_observation_chars``,
                 actions to 600 characters and thoughts to 400): the work a session does between seeing a fact
                 and using it;
    step k+1     the action that needs the fact (``curl -H "Authorization: Bearer 3f9c1e07a2" ...``).

The value is drawn at random (seeded), so only the history can tell it: the actor given the whole history can
copy it, a prompt that hid step 0 cannot, unless the memory carries it. Every other boundary of the session is
an ordinary continuation of real steps.

Fillers come only from the trajectories of the training split (``trajectories.split_of`` at the run's
``val_fraction``), so no text of a validation trajectory reaches a training row. Each session is split by its
own id, like any trajectory.
"""

from __future__ import annotations

import random
import string
from typing import Any

from palimpsest.pipelines.trajectories import Trajectory, split_of

SYSTEM = ("You are an agent working in a Linux shell and with tools. Each turn, think briefly, then take exactly "
          "one action: a bash command, code, or a tool call. Use the values earlier steps showed you exactly as shown.")


def _hex(rng: random.Random, n: int) -> str:
    return "".join(rng.choice("0123456789abcdef") for _ in range(n))


def _word(rng: random.Random) -> str:
    return rng.choice(["atlas", "birch", "cobalt", "delta", "ember", "fjord", "granite", "harbor", "iris", "juniper",
                       "krypton", "lumen", "marble", "nimbus", "onyx", "pulsar", "quartz", "raven", "sierra",
                       "tundra", "umber", "vortex", "willow", "xenon", "yarrow", "zephyr"])


def _fact(rng: random.Random) -> dict[str, str]:
    """One fact: how it is shown (command, the line that holds it) and the action that needs it."""
    kind = rng.choice(["token", "port", "branch", "artifact", "path"])
    if kind == "token":
        v = _hex(rng, 10)
        name = rng.choice(["API_TOKEN", "DEPLOY_KEY", "SERVICE_SECRET", "REGISTRY_TOKEN"])
        return {"task": "deploy the service and check that it answers", "show": "cat .env",
                "line": f"{name}={v}", "thought": f"Now I call the health endpoint with the {name} from .env.",
                "use": f'curl -s -H "Authorization: Bearer {v}" http://localhost:8080/health', "value": v}
    if kind == "port":
        v = str(rng.randint(1025, 65000))
        return {"task": "start the dev server and check its status page", "show": "grep -n port config/server.yaml",
                "line": f"14:  port: {v}", "thought": "The server should be up; I check the port from the config.",
                "use": f"curl -s http://127.0.0.1:{v}/status", "value": v}
    if kind == "branch":
        v = f"fix/{_word(rng)}-{rng.randint(100, 999)}"
        return {"task": "commit the fix and push it to the working branch", "show": "git branch --show-current",
                "line": v, "thought": "Tests pass; I push the branch I am on.", "use": f"git push origin {v}",
                "value": v}
    if kind == "artifact":
        v = f"{_word(rng)}_{_word(rng)}-{rng.randint(0, 9)}.{rng.randint(0, 30)}.{rng.randint(0, 9)}-py3-none-any.whl"
        return {"task": "build the package and install the wheel", "show": "ls dist/", "line": v,
                "thought": "The build finished; I install the wheel it produced.", "use": f"pip install dist/{v}",
                "value": v}
    d = "".join(rng.choice(string.ascii_lowercase) for _ in range(6))
    v = f"/var/log/{_word(rng)}/{d}-{_hex(rng, 6)}.log"
    return {"task": "find out why the worker crashed", "show": "ls -1 /var/log/*/*.log | tail -n 1", "line": v,
            "thought": "I read the newest worker log found earlier.", "use": f"tail -n 50 {v}", "value": v}


def _lines(rng: random.Random, sources: list[Trajectory], n: int) -> list[str]:
    """``n`` short real observation lines (context around the fact)."""
    out: list[str] = []
    for _ in range(50 * n):
        if len(out) >= n:
            break
        s = rng.choice(rng.choice(sources).steps)
        lines = [ln for ln in (s.observation or "").splitlines() if 8 <= len(ln.strip()) <= 100]
        if lines:
            out.append(rng.choice(lines).strip())
    return out


def recall_session(i: int, sources: list[Trajectory], rng: random.Random, min_fill: int = 4, max_fill: int = 10,
                   max_observation_chars: int = 1200) -> dict[str, Any]:
    """One session in the trajectory schema (``shared/data/trajectories/README.md``)."""
    fact = _fact(rng)
    src = rng.choice([t for t in sources if len(t.steps) > min_fill])
    k = rng.randint(min_fill, min(max_fill, len(src.steps) - 1))
    start = rng.randint(0, len(src.steps) - k)
    around = _lines(rng, sources, 6)
    at = rng.randint(0, len(around))
    shown = "\n".join(around[:at] + [fact["line"]] + around[at:]) if fact["show"].startswith(("cat", "grep")) \
        else fact["line"]
    steps = [{"t": 0, "kind": "bash", "thought": "First I look at what I will need later.", "action": fact["show"],
              "observation": shown, "obs_source": "tool"}]
    for j, s in enumerate(src.steps[start:start + k], 1):
        action = s.action or s.thought or "true"
        obs = (s.observation or "")[:max_observation_chars]
        steps.append({"t": j, "kind": s.kind, "thought": (s.thought or "")[:400], "action": action[:600],
                      "observation": obs, "obs_source": "tool"})
    steps.append({"t": k + 1, "kind": "bash", "thought": fact["thought"], "action": fact["use"],
                  "observation": "ok", "obs_source": "tool",
                  "needs": [{"token": fact["value"], "kind": "recall", "strength": "strong",
                             "first_obs_step": 0, "last_obs_step": 0}]})
    return {"id": f"recall/{i:05d}", "group": "recall", "task": f"Please {fact['task']}.", "system": SYSTEM,
            "steps": steps, "meta": {"source": src.id, "source_steps": [start, start + k], "fact": fact["value"]}}


def recall_sessions(trajectories: list[Trajectory], n: int, val_fraction: float, seed: int = 0,
                    max_observation_chars: int = 1200, max_fill: int = 10) -> list[Trajectory]:
    """``n`` sessions whose fillers come from the training split of ``trajectories`` only."""
    if n <= 0:
        return []
    if max_fill < 4:
        raise ValueError(f"max_fill must be >= 4 (a session has 4 to max_fill real steps), got {max_fill}")
    sources = [t for t in trajectories if split_of(t.id, val_fraction) == "train" and len(t.steps) > 4]
    if not sources:
        raise ValueError("recall sessions need training-split trajectories of more than 4 steps to draw steps from")
    rng = random.Random(seed)
    return [Trajectory.model_validate(recall_session(i, sources, rng, max_fill=max_fill,
                                                     max_observation_chars=max_observation_chars))
            for i in range(n)]


__all__ = ["SYSTEM", "recall_session", "recall_sessions"]
