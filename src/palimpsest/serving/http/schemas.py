"""Wire schemas of the HTTP API (pydantic; they make the OpenAPI document)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from palimpsest.platform.compile.context_edits import ContextEdits
from palimpsest.platform.types import Authority
from palimpsest.serving.turn.request import TurnRequest

MAX_INT = 2**53  # JSON numbers beyond this are not integers anywhere else either


def valid_text(value: Any, where: str = "") -> None:
    """JSON may carry lone surrogates (\\ud800); they are not text and no tokenizer or database takes them."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError(f"{where or 'a string'} is not valid Unicode (lone surrogate)") from None
    elif isinstance(value, dict):
        for k, v in value.items():
            valid_text(k, where)
            valid_text(v, f"{where}.{k}" if where else str(k))
    elif isinstance(value, (list, tuple)):
        for v in value:
            valid_text(v, where)


class _Text(BaseModel):
    @model_validator(mode="before")
    @classmethod
    def _unicode(cls, data: Any) -> Any:
        valid_text(data)
        return data


class _In(_Text):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class SessionIn(_In):
    session_id: str | None = Field(None, description="1-200 characters of letters, digits and ._:/@+-; "
                                                     "generated when absent")
    task: str = Field(..., min_length=1)
    system: str = ""
    tools: str | None = None
    arm: str | None = Field(None, description="an arm name; assigned by a sticky hash of the session id when absent")


class SessionOut(BaseModel):
    session_id: str
    arm: str
    steps: int


class StepIn(_In):
    t: int | None = Field(None, ge=0, le=MAX_INT, description="the step index; the next one when absent")
    kind: str = "message"
    thought: str = ""
    action: str = ""
    observation: str | None = None
    authority: Authority = Authority.TOOL
    tool: str | None = None


class StepOut(BaseModel):
    session_id: str
    step_id: int
    t: int


class TurnIn(_In):
    budget: int | None = Field(None, ge=1, le=MAX_INT,
                               description="context budget in tokens; the arm's or the server's default")
    max_tokens: int | None = Field(None, ge=1, le=8192)
    temperature: float = Field(0.0, ge=0.0, le=2.0)
    seed: int | None = Field(None, ge=0, le=2**32 - 1)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    stop: list[Annotated[str, Field(min_length=1)]] | None = Field(None, max_length=4)
    edits: ContextEdits | None = Field(None, description="a context-management edit honoured by this turn's "
                                       "compaction (platform.compile.context_edits): trigger, clear_at_least, keep, "
                                       "exclude_tools")

    def request(self, session_id: str) -> TurnRequest:
        """The turn this body asks for, in the one type every route builds (``serving.turn.request``)."""
        return TurnRequest(session_id, **self.model_dump(exclude={"edits"}), edits=self.edits)


class TurnOut(BaseModel):
    session_id: str
    t: int
    arm: str
    action: str
    finish_reason: str | None
    stop_sequence: str | None = Field(None, description="the stop sequence that ended the reply, when one did")
    plan: dict[str, int] = Field(description="how many history steps at each resolution")
    tokens: dict[str, int] = Field(description="context (text), prefix, soft (memory positions), "
                                               "prompt (actor input), completion, cached")
    latency_ms: dict[str, float] = Field(description="plan (plan+compile, including embed: waiting for the query "
                                                     "embedding), memory, actor, total")
    glimpses: list[int] = Field(description="step ids the model glimpsed in this turn")
    prompt_hash: str
    content: str | None = Field(None, description="the reply without tool-call markup")
    tool_calls: list[dict[str, Any]] = Field(default_factory=list, description="tool calls read from the reply "
                                             "(OpenAI's shape), when the session declares tools")
    context_edit: dict[str, Any] | None = Field(None, description="what the request's context edit did to this "
                                                "turn: tool uses not shown in full, the ids that saved, whether "
                                                "the turn compacted, the watermarks it ran under")


class GlimpseIn(_In):
    step_id: int = Field(..., ge=0, le=MAX_INT)


class GlimpseOut(BaseModel):
    session_id: str
    step_id: int
    text: str


class OutcomeIn(_In):
    value: float = Field(..., description="the session's outcome, e.g. 1 = task solved, 0 = failed")
    note: str = Field("", max_length=2000)


class CompletionIn(_In):
    prompt: str | None = None
    prompt_embeds: str | None = Field(None, description="base64 of torch.save(tensor[T, hidden])")
    max_tokens: int | None = Field(None, ge=1, le=8192)
    temperature: float = Field(0.0, ge=0.0, le=2.0)
    seed: int | None = Field(None, ge=0, le=2**32 - 1)
    model: str | None = None


MAX_TOOL_CALLS = 128  # per assistant message


class FunctionCallIn(_Text):
    name: str = Field(..., min_length=1, max_length=256)
    arguments: str | dict[str, Any] = Field("", description="JSON text (an object is accepted and serialised)")


class ToolCallIn(_Text):
    model_config = ConfigDict(extra="forbid")
    id: str = Field(..., min_length=1, max_length=256)
    type: Literal["function"] = "function"
    function: FunctionCallIn
    index: int | None = Field(None, ge=0, le=MAX_TOOL_CALLS, description="accepted as streamed replies carry it")


class ChatMessage(_Text):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = Field(None, max_length=MAX_TOOL_CALLS,
                                                description="an assistant message's tool calls")
    tool_call_id: str | None = Field(None, min_length=1, max_length=256,
                                     description="the tool call a tool message answers")


class ChatIn(_Text):
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)  # OpenAI clients send many optional fields
    model: str | None = None
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_tokens: int | None = Field(None, ge=1, le=8192)
    max_completion_tokens: int | None = Field(None, ge=1, le=8192)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    seed: int | None = Field(None, ge=0, le=2**32 - 1)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    stop: str | list[str] | None = Field(None, description="up to 4 stop sequences")
    response_format: dict[str, Any] | None = Field(None, description="only {\"type\": \"text\"} is served")
    tools: list[dict[str, Any]] | None = Field(None, max_length=256, description="tool declarations: recorded with "
                                               "the session (its stable prefix) and declared to the actor")
    tool_choice: str | dict[str, Any] | None = Field(None, description="auto, none, required, or "
                                                     "{\"type\": \"function\", \"function\": {\"name\": ...}}")
    parallel_tool_calls: bool | None = None
    user: str | None = None
    stream: bool | None = False
    stream_options: dict[str, Any] | None = Field(None, description="{\"include_usage\": true} adds a usage chunk")
    n: int | None = Field(1, ge=1, le=1)

    @model_validator(mode="after")
    def _honoured(self) -> "ChatIn":
        stops = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        if len(stops) > 4 or any(not s for s in stops):
            raise ValueError("stop: at most 4 non-empty sequences")
        if self.response_format is not None and self.response_format.get("type") != "text":
            raise ValueError("response_format: only {\"type\": \"text\"} is served (structured outputs are not "
                             "enabled on this actor)")
        names = []
        for k, t in enumerate(self.tools or []):
            fn = t.get("function") if isinstance(t, dict) else None
            if not isinstance(fn, dict) or t.get("type", "function") != "function":
                raise ValueError(f"tools[{k}]: a function tool is {{\"type\": \"function\", \"function\": {{...}}}}")
            if not isinstance(fn.get("name"), str) or not fn["name"]:
                raise ValueError(f"tools[{k}].function.name: a non-empty string is needed")
            if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
                raise ValueError(f"tools[{k}].function.parameters: a JSON schema object is needed")
            if fn.get("description") is not None and not isinstance(fn["description"], str):
                raise ValueError(f"tools[{k}].function.description: a string is needed")
            names.append(fn["name"])
        choice = self.tool_choice
        if isinstance(choice, str) and choice not in ("auto", "none", "required"):
            raise ValueError("tool_choice: auto, none, required, or a named function")
        if choice == "required" or isinstance(choice, dict):
            if not self.tools:
                raise ValueError("tool_choice: forcing a tool call needs tools")
        if isinstance(choice, dict):
            fn = choice.get("function")
            wanted = fn.get("name") if choice.get("type") == "function" and isinstance(fn, dict) else None
            if wanted not in names:
                raise ValueError(f"tool_choice: names {wanted!r}, which tools do not declare")
        if self.max_tokens is not None and self.max_completion_tokens is not None and \
                self.max_tokens != self.max_completion_tokens:
            raise ValueError("max_tokens: differs from max_completion_tokens (send one of them, or the same value)")
        if self.stream_options is not None and set(self.stream_options) - {"include_usage"}:
            raise ValueError("stream_options: only include_usage is served")
        for name, value in (self.model_extra or {}).items():
            if name in RECORDED or (name in _UNSET_ONLY and value in (None, False, 0, [], {}, "none", "auto")):
                continue
            raise ValueError(f"{name}: not served by this endpoint (nothing is ignored silently; remove the field)")
        return self


# Fields an OpenAI client may send that change nothing here (bookkeeping: recorded with the served turn as
# ``requested_<name>``), and fields accepted only unset (options of what is not served): anything else is
# refused by name.
RECORDED = frozenset({"metadata", "store", "service_tier"})
_UNSET_ONLY = frozenset({"functions", "function_call", "logprobs", "top_logprobs",
                         "logit_bias", "presence_penalty", "frequency_penalty", "modalities", "audio", "prediction"})
