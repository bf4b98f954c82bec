"""Claude Code through the gateway (BENCHMARKS.md, "Claude Code through the gateway"): the official Claude Code
CLI in print mode, pointed at the served app with ``ANTHROPIC_BASE_URL``, runs one short session on this machine.
It records what the CLI sent (every request, through a recording forwarder in front of the app) and what the
ledger holds afterwards (the session's steps, calls and results, and its audited turns).

The app is the embedded default serve configuration (SmolLM2-135M with the Hermes tool template and parser,
MiniLM, pace), with rule summaries and no memory so that the run fits 2 cores. The CLI runs with its
non-essential traffic off, in a scratch HOME and working directory, with only the Bash tool and a short system
prompt: its default system prompt and tool set are ~20K tokens, past the actor's 8K window, and are refused
with a 422 naming the budget (the run with ``--cli-defaults`` shows it).

    npm install --prefix .cache/npm @anthropic-ai/claude-code@2.1.332     # the CLI (~400 MB), once
    .venv/bin/python benchmarks/claude_code.py [--cli-defaults] [--out benchmarks/results/claude_code.json]
"""

from __future__ import annotations

import argparse
import http.server
import json
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
CLI = ROOT / ".cache" / "npm" / "node_modules" / ".bin" / "claude"
CLI_VERSION = "2.1.332"  # the release installed; what ran is read from the CLI itself (cli_version)


class Recorder(http.server.ThreadingHTTPServer):
    """Forwards every request to ``upstream`` and keeps its method, path, body and the answer's status. An
    answer is forwarded whole once it is complete (a streamed one included: the CLI reads its events the same)."""

    def __init__(self, upstream: str):
        self.upstream, self.log = upstream, []
        super().__init__(("127.0.0.1", 0), _Forward)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _Forward(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def _forward(self) -> None:
        n = int(self.headers.get("content-length") or 0)
        body = self.rfile.read(n) if n else b""
        headers = {k: v for k, v in self.headers.items() if k.lower() not in ("host", "content-length", "connection")}
        t0 = time.perf_counter()
        with httpx.Client(timeout=900) as c:
            r = c.request(self.command, self.server.upstream + self.path, content=body, headers=headers)
        try:
            parsed = json.loads(body) if body else None
        except ValueError:
            parsed = body.decode("utf-8", "replace")
        self.server.log.append({"method": self.command, "path": self.path, "status": r.status_code,
                                "seconds": round(time.perf_counter() - t0, 2), "body": parsed,
                                "answer": r.text[:2000] if r.status_code >= 400 else None})
        self.send_response(r.status_code)
        for k, v in r.headers.items():
            if k.lower() not in ("content-length", "transfer-encoding", "connection", "content-encoding"):
                self.send_header(k, v)
        self.send_header("content-length", str(len(r.content)))
        self.end_headers()
        self.wfile.write(r.content)

    do_GET = do_POST = do_HEAD = _forward

    def log_message(self, *args) -> None:  # the log above is the record
        pass


def gateway_config(name: str) -> dict:
    """The served app of a CLI run: the embedded default (what `palimpsest serve` runs with no config: actor,
    template, tool parser, embedder, budget) with rule summaries and no memory, on a ledger of its own."""
    ledger = ROOT / ".palimpsest" / f"{name}-{int(time.time())}.db"
    return {"ledger": str(ledger), "summarizer": {"mode": "rule"}, "memory": {"model": None},
            "arms": [{"name": "pace", "policy": {"type": "pace"}}]}


def run_record(cli: Path, pinned: str) -> dict:
    """What a run records of where it ran and which CLI ran (the version the CLI itself prints)."""
    return {"machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, no GPU",
            "cli": pinned, "cli_version": subprocess.run([str(cli), "--version"], capture_output=True, text=True,
                                                        timeout=60).stdout.strip()}


def sent(body) -> dict:
    """What one Messages request carried, in numbers (its text is in the raw log)."""
    if not isinstance(body, dict):
        return {}
    system = body.get("system")
    return {"model": body.get("model"), "stream": bool(body.get("stream")), "max_tokens": body.get("max_tokens"),
            "messages": len(body.get("messages") or []), "tools": [t.get("name") for t in body.get("tools") or []],
            "system_chars": len(system) if isinstance(system, str)
            else sum(len(b.get("text", "")) for b in system or [] if isinstance(b, dict)),
            "fields": sorted(body)}


def openai_checks(url: str, model: str) -> dict:
    """The official ``openai`` client's tool request and streamed request against the same app (the embedded
    default's tool template and parser): their status, finish reason and tool calls."""
    from openai import OpenAI

    oc = OpenAI(base_url=f"{url}/v1", api_key="unused-locally", timeout=600, max_retries=0)
    tools = [{"type": "function", "function": {"name": "bash", "description": "Run a shell command.", "parameters": {
        "type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}}]
    msgs = [{"role": "system", "content": "You are a coding agent."},
            {"role": "user", "content": "List the files in the current directory."}]
    r = oc.chat.completions.create(model=model, messages=msgs, tools=tools, tool_choice="required", max_tokens=64,
                                   temperature=0, user="openai-tools")
    calls = [{"name": c.function.name, "arguments": c.function.arguments}
             for c in r.choices[0].message.tool_calls or []]
    chunks, text = 0, ""
    for chunk in oc.chat.completions.create(model=model, messages=msgs, tools=tools, max_tokens=16, temperature=0,
                                            user="openai-stream", stream=True):
        chunks += 1
        if chunk.choices and chunk.choices[0].delta.content:
            text += chunk.choices[0].delta.content
    return {"tools": {"finish_reason": r.choices[0].finish_reason, "tool_calls": calls},
            "stream": {"chunks": chunks, "text": text}}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--task", default="Run `ls` in the current directory with the Bash tool, then say which "
                                       "file is there.")
    ap.add_argument("--follow-up", default="Now say what notes.txt is about.")
    ap.add_argument("--max-turns", type=int, default=3)
    ap.add_argument("--max-output-tokens", type=int, default=128)
    ap.add_argument("--cli-defaults", action="store_true", help="the CLI's own system prompt and every tool")
    ap.add_argument("--port", type=int, default=8473)
    ap.add_argument("--timeout", type=int, default=900)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "claude_code.json"))
    args = ap.parse_args()
    if not CLI.exists():
        sys.exit(f"the Claude Code CLI is not installed: npm install --prefix .cache/npm "
                 f"@anthropic-ai/claude-code@{CLI_VERSION}")

    from palimpsest.platform import Ledger
    from palimpsest.serving.local import LocalServer

    cfg = gateway_config("claude-code")
    out: dict = {**run_record(CLI, CLI_VERSION), "cli_defaults": args.cli_defaults, "task": args.task}
    with LocalServer(cfg, port=args.port) as srv:
        model = httpx.get(f"{srv.url}/v1/models", timeout=60).json()["data"][0]["id"]
        out["openai_client"] = openai_checks(srv.url, model)
        rec = Recorder(srv.url)
        threading.Thread(target=rec.serve_forever, daemon=True).start()
        with tempfile.TemporaryDirectory() as home, tempfile.TemporaryDirectory() as work:
            Path(work, "notes.txt").write_text("remember the milk\n")
            env = {"PATH": os.environ["PATH"], "HOME": home, "ANTHROPIC_BASE_URL": rec.url,
                   "ANTHROPIC_API_KEY": "unused-locally", "ANTHROPIC_MODEL": model,
                   "ANTHROPIC_SMALL_FAST_MODEL": model, "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
                   "DISABLE_AUTOUPDATER": "1", "DISABLE_TELEMETRY": "1", "DISABLE_ERROR_REPORTING": "1",
                   # the CLI asks for 32,000 reply tokens by default, past the whole budget (a 422 naming max_tokens)
                   "CLAUDE_CODE_MAX_OUTPUT_TOKENS": str(args.max_output_tokens)}
            out["runs"] = []
            for prompt, again in ((args.task, False), (args.follow_up, True)):  # a second turn of one session
                cmd = [str(CLI), "-p", prompt, "--output-format", "json", "--model", model,
                       "--max-turns", str(args.max_turns), "--allowedTools", "Bash"] + (["--continue"] if again else [])
                if not args.cli_defaults:
                    cmd += ["--tools", "Bash", "--system-prompt", "You are a coding agent. Use the Bash tool to act."]
                t0 = time.perf_counter()
                try:
                    p = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, timeout=args.timeout,
                                       check=False)
                    rc, stdout, stderr = p.returncode, p.stdout, p.stderr
                except subprocess.TimeoutExpired as e:
                    rc, stdout, stderr = "timeout", (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (
                        e.stdout or ""), ""
                try:
                    result = json.loads(stdout)
                except ValueError:
                    result = stdout[-2000:]
                out["runs"].append({"continue": again, "cli_exit": rc,
                                    "cli_seconds": round(time.perf_counter() - t0, 1),
                                    "cli_result": result, "cli_stderr": stderr[-2000:]})
        rec.shutdown()
        out["requests"] = [{"method": r["method"], "path": r["path"], "status": r["status"], "seconds": r["seconds"],
                            **sent(r["body"]), **({"answer": r["answer"]} if r["answer"] else {})}
                           for r in rec.log]
        led = Ledger(cfg["ledger"])
        sessions = sorted(led.sessions())
        out["ledger"] = []
        for sid in sessions:
            steps = led.steps(sid, 0, led.count(sid))
            out["ledger"].append({
                "session": sid, "tools_declared": len(json.loads(led.session(sid).tools or "[]")),
                "steps": [{"t": s.t, "kind": s.kind, "authority": str(s.authority), "action": s.action[:200],
                           "calls": (s.calls or "")[:300],
                           "observation": (s.observation or "")[:200]} for s in steps],
                "turns": [{k: r.get(k) for k in ("t", "arm", "tokens_context", "tokens_prompt", "tokens_cached",
                                                 "tool_calls", "streamed", "requested_thinking",
                                                 "requested_output_config",
                                                 "requested_context_management", "requested_user_id", "requested_beta",
                                                 "requested_deferred_tools", "requested_cache_control")}
                          for r in led.served() if r["session_id"] == sid]})
        out["raw_requests"] = rec.log
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2, default=str))
    json.dump({k: v for k, v in out.items() if k != "raw_requests"}, sys.stdout, indent=2, default=str)
    print()


if __name__ == "__main__":
    main()
