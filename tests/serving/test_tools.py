"""Tool calls read by vLLM's parser on the actor's path, with what vLLM's serving layer would enforce."""

import json

import pytest

TOOLS = [{"type": "function", "function": {"name": "run_shell", "parameters": {
    "type": "object", "properties": {"cmd": {"type": "string"}}}}}]
TWO_CALLS = ('<tool_call>\n{"name": "run_shell", "arguments": {"cmd": "ls"}}\n</tool_call>\n'
             '<tool_call>\n{"name": "run_shell", "arguments": {"cmd": "pwd"}}\n</tool_call>')


def test_parallel_tool_calls_false_returns_at_most_the_first_call(tiny_dir):
    pytest.importorskip("vllm")
    from palimpsest.serving.models.tools import ToolCalling

    calling = ToolCalling("hermes", str(tiny_dir), "tiny")
    _, free = calling.turn(TOOLS).parse(TWO_CALLS, [])
    _, allowed = calling.turn(TOOLS, parallel_tool_calls=True).parse(TWO_CALLS, [])
    _, single = calling.turn(TOOLS, parallel_tool_calls=False).parse(TWO_CALLS, [])
    assert len(free) == len(allowed) == 2
    assert len(single) == 1 and json.loads(single[0]["function"]["arguments"]) == {"cmd": "ls"}
