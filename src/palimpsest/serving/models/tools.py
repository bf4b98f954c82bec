"""Tool calling on the actor, through vLLM's own machinery (no parser of ours).

Per request: vLLM's ``ChatCompletionRequest`` holds the declared tools and ``tool_choice``; the parser
named in the config (``actor.tool_parser``, e.g. ``hermes``) adjusts it (``required`` or a named
function becomes a structural-tag constraint on decoding), and reads the reply back into content and
tool calls, whole or delta by delta. Imports vLLM: it runs inside the Actor deployment only.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from palimpsest.platform.types import ConfigError


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolTurn:
    """One generation with tools: the parser (it keeps streaming state) and vLLM's view of the request."""

    parser: Any
    request: Any

    def sampling(self) -> dict:
        """What the tools add to the sampling parameters: the decoding constraint, and special tokens kept
        where the parser needs them."""
        out: dict[str, Any] = {"skip_special_tokens": bool(getattr(self.request, "skip_special_tokens", True))}
        if getattr(self.request, "structured_outputs", None) is not None:
            out["structured_outputs"] = self.request.structured_outputs
        return out

    def parse(self, text: str, token_ids: list[int]) -> tuple[str | None, list[dict]]:
        """The whole reply as (content, tool calls in OpenAI's wire shape, each with an id). With
        ``parallel_tool_calls: false`` at most the first call (vLLM's own filter, which its serving layer
        applies and this path must apply itself)."""
        from vllm.entrypoints.serve.utils.tool_calls_utils import maybe_filter_parallel_tool_calls

        _reasoning, content, calls = self.parser.parse(text, self.request, enable_auto_tools=True,
                                                       model_output_token_ids=token_ids)
        calls = maybe_filter_parallel_tool_calls(list(calls or []), self.request)
        wire = [{"id": getattr(c, "id", None) or call_id(), "type": "function",
                 "function": {"name": c.name, "arguments": c.arguments if c.arguments is not None else "{}"}}
                for c in (calls or [])]
        return content, wire

    def content_delta(self, delta: str, delta_ids: list[int], finished: bool) -> str | None:
        """The part of a streamed delta that is content (tool-call markup is held back by the parser)."""
        # The prompt ids only tell a reasoning parser whether the prompt left reasoning open; none is used.
        msg = self.parser.parse_delta(delta, list(delta_ids), self.request, [], finished=finished)
        return getattr(msg, "content", None) if msg is not None else None


class ToolCalling:
    """The configured vLLM tool parser over the actor's tokenizer, checked at start-up."""

    def __init__(self, parser_name: str, model_path: str, model_name: str):
        from vllm.parser import ParserManager
        from vllm.tokenizers import get_tokenizer

        self.tokenizer = get_tokenizer(model_path)
        try:
            self.parser_cls = ParserManager.get_parser(tool_parser_name=parser_name, enable_auto_tools=True,
                                                       model_name=model_name, tokenizer=self.tokenizer)
        except TypeError as e:
            raise ConfigError(f"actor.tool_parser: {e}") from None
        if self.parser_cls is None:
            raise ConfigError(f"actor.tool_parser: vLLM has no tool parser {parser_name!r}")
        self.model_name = model_name
        self.name = parser_name

    def turn(self, tools: list[dict], tool_choice: Any = None, parallel_tool_calls: bool | None = None) -> ToolTurn:
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

        request = ChatCompletionRequest(model=self.model_name, messages=[{"role": "user", "content": "-"}],
                                        tools=tools, tool_choice=tool_choice or "auto",
                                        **({} if parallel_tool_calls is None else
                                           {"parallel_tool_calls": parallel_tool_calls}))
        parser = self.parser_cls(self.tokenizer, request.tools)
        return ToolTurn(parser, parser.adjust_request(request))
