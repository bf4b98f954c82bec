"""Codex CLI through the gateway (BENCHMARKS.md, "Codex CLI through the gateway"): the official Codex CLI
(``codex exec``) pointed at the served app with a model provider whose ``wire_api`` is ``responses``, two turns
of one session (the second resumes the first with ``codex exec resume --last``), on this machine. It records
what the CLI sent (through the recording forwarder of ``claude_code.py``), its exit status, what the ledger
holds afterwards, and each served turn's overhead beside one chat and one Messages turn of the same app.

The app is the embedded default serve configuration (SmolLM2-135M with the Hermes tool template and parser,
MiniLM, pace), with rule summaries and no memory so that the run fits 2 cores. Codex's default instructions and
tool set are about 9,000 SmolLM2 tokens, past the 6,000-token budget (refused with a 422 naming it): the run
replaces the instructions with a two-line file and turns off the multi-agent, goal, image and skill-search
features and web search, leaving the shell tools (``--cli-defaults`` runs the CLI as installed).

    npm install --prefix .cache/npm @openai/codex@0.171.0      # the CLI, once
    .venv/bin/python benchmarks/codex_cli.py [--cli-defaults] [--out benchmarks/results/codex_cli.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from claude_code import Recorder, gateway_config, run_record  # noqa: E402  (the recorder, the app, the record)

ROOT = Path(__file__).resolve().parents[1]
CLI = ROOT / ".cache" / "npm" / "node_modules" / ".bin" / "codex"
CLI_VERSION = "0.171.0"
INSTRUCTIONS = ("You are a coding agent in a terminal. Answer briefly.\n"
                "Run shell commands with exec_command when needed.\n")
#: What the run turns off so that the CLI's request fits SmolLM2's budget (each a `-c` override)
TRIM = ["features.multi_agent=false", "features.goals=false", "features.view_image=false",
        "features.skill_search=false", "features.image_generation=false", 'web_search="disabled"']


def codex_command(url: str, model: str, home: str, cli_defaults: bool, prompt: str, resume: bool) -> list[str]:
    provider = f'model_providers.palimpsest={{name="palimpsest",base_url="{url}/v1",wire_api="responses",' \
               'env_key="PALIMPSEST_API_KEY"}'
    cmd = [str(CLI), "exec"] + (["resume", "--last"] if resume else []) + [
        "--skip-git-repo-check", "-m", model, "-c", "model_provider=palimpsest", "-c", provider,
        "-c", "model_context_window=8192"]
    if not cli_defaults:
        instructions = Path(home, "instructions.md")
        instructions.write_text(INSTRUCTIONS)
        cmd += ["-c", f'model_instructions_file="{instructions}"']
        for t in TRIM:
            cmd += ["-c", t]
    return cmd + [prompt]


def overhead(rows: list[dict]) -> dict:
    """The gateway's part of a served turn: everything but the actor (plan, embed, memory, recording)."""
    if not rows:
        return {}
    total = [r["total_ms"] for r in rows]
    actor = [r["actor_ms"] for r in rows]
    return {"turns": len(rows), "total_ms_median": round(statistics.median(total), 1),
            "actor_ms_median": round(statistics.median(actor), 1),
            "overhead_ms_median": round(statistics.median(t - a for t, a in zip(total, actor)), 1),
            "plan_ms_median": round(statistics.median(r["plan_ms"] for r in rows), 1),
            "prompt_tokens_median": statistics.median(r["tokens_prompt"] for r in rows)}


def peers(url: str, model: str, n: int) -> None:
    """``n`` chat and ``n`` Messages turns of about the same size, each its own session."""
    with httpx.Client(base_url=url, timeout=600) as c:
        for k in range(n):
            task = f"List the files in the current directory ({k})."
            r = c.post("/v1/chat/completions", json={"model": model, "max_tokens": 32, "temperature": 0,
                                                     "user": f"chat-{k}", "messages": [
                                                         {"role": "system", "content": INSTRUCTIONS},
                                                         {"role": "user", "content": task}]})
            r.raise_for_status()
            r = c.post("/v1/messages", headers={"anthropic-version": "2023-06-01"},
                       json={"model": model, "max_tokens": 32, "temperature": 0, "system": INSTRUCTIONS,
                             "metadata": {"user_id": f"messages-{k}"}, "messages": [{"role": "user", "content": task}]})
            r.raise_for_status()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--task", default="Say which files are in the current directory.")
    ap.add_argument("--follow-up", default="In one short sentence: what does notes.txt say?")
    ap.add_argument("--cli-defaults", action="store_true", help="the CLI's own instructions and every tool")
    ap.add_argument("--peers", type=int, default=3, help="chat and Messages turns to compare with")
    ap.add_argument("--port", type=int, default=8474)
    ap.add_argument("--timeout", type=int, default=900)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "codex_cli.json"))
    args = ap.parse_args()
    if not CLI.exists():
        sys.exit(f"the Codex CLI is not installed: npm install --prefix .cache/npm @openai/codex@{CLI_VERSION}")

    from palimpsest.platform import Ledger
    from palimpsest.serving.local import LocalServer

    cfg = gateway_config("codex")
    out: dict = {**run_record(CLI, CLI_VERSION), "cli_defaults": args.cli_defaults, "task": args.task}
    with LocalServer(cfg, port=args.port) as srv:
        model = httpx.get(f"{srv.url}/v1/models", timeout=60).json()["data"][0]["id"]
        rec = Recorder(srv.url)
        threading.Thread(target=rec.serve_forever, daemon=True).start()
        out["runs"] = []
        with tempfile.TemporaryDirectory() as home, tempfile.TemporaryDirectory() as work:
            Path(work, "notes.txt").write_text("remember the milk\n")
            Path(home, ".codex").mkdir()
            env = {"PATH": os.environ["PATH"], "HOME": home, "CODEX_HOME": str(Path(home, ".codex")),
                   "PALIMPSEST_API_KEY": "unused-locally", "NO_COLOR": "1"}
            for prompt, resume in ((args.task, False), (args.follow_up, True)):
                cmd = codex_command(rec.url, model, home, args.cli_defaults, prompt, resume)
                t0 = time.perf_counter()
                try:
                    p = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, timeout=args.timeout,
                                       check=False)
                    rc, stdout, stderr = p.returncode, p.stdout, p.stderr
                except subprocess.TimeoutExpired:
                    rc, stdout, stderr = "timeout", "", ""
                out["runs"].append({"resume": resume, "exit": rc, "seconds": round(time.perf_counter() - t0, 1),
                                    "stdout": stdout[-1500:], "stderr": stderr[-1500:]})
        peers(srv.url, model, args.peers)
        rec.shutdown()
        out["requests"] = [{"method": r["method"], "path": r["path"], "status": r["status"],
                            "seconds": r["seconds"], **({"answer": r["answer"]} if r["answer"] else {}),
                            **({"input_items": len(r["body"].get("input") or []),
                                "tools": [t.get("name") or t.get("type") for t in r["body"].get("tools") or []]}
                               if isinstance(r["body"], dict) else {})}
                           for r in rec.log]
        led = Ledger(cfg["ledger"])
        served = led.served()
        codex = sorted({r["session_id"] for r in served if not r["session_id"].startswith(("chat-", "messages-"))})
        out["ledger"] = [{"session": sid, "steps": [{"t": s.t, "kind": s.kind, "authority": str(s.authority),
                                                     "action": s.action[:200],
                                                     "observation": (s.observation or "")[:200]}
                                                    for s in led.steps(sid, 0, led.count(sid))],
                          "turns": [{k: r.get(k) for k in ("t", "tokens_prompt", "tokens_cached", "total_ms",
                                                           "actor_ms", "tool_calls", "streamed", "requested_include",
                                                           "requested_hosted_tools", "requested_prompt_cache_key")}
                                    for r in served if r["session_id"] == sid]} for sid in codex]
        out["overhead"] = {
            "responses (codex)": overhead([r for r in served if r["session_id"] in codex and "error" not in r]),
            "chat": overhead([r for r in served if r["session_id"].startswith("chat-")]),
            "messages": overhead([r for r in served if r["session_id"].startswith("messages-")])}
        out["raw_requests"] = rec.log
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2, default=str))
    json.dump({k: v for k, v in out.items() if k != "raw_requests"}, sys.stdout, indent=2, default=str)
    print()


if __name__ == "__main__":
    main()
