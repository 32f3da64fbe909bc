"""The OpenAI API's bodies as pydantic models: what `/v1/completions` and `/v1/chat/completions`
take and what they answer, streamed or not.

Fields follow OpenAI's API reference; the extras sitsd (like vLLM) takes in the body are marked
"extra". Fields a client may send that sitsd does not know are ignored (clients send fields of
newer API versions); fields it knows but cannot honour are refused by `sitsd.http.sampling`,
which also turns a body into the engine's `SamplingParams`. Range checks are the engine's
(`SamplingParams.validate`); the models here check types only.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


# ------------------------------------------------------------------------------- requests


class StreamOptions(_Body):
    include_usage: bool = False  # a last chunk with empty `choices` and the usage
    continuous_usage_stats: bool = False  # extra: the usage so far on every chunk


class JsonSchemaFormat(_Body):
    name: str = "response"
    description: str | None = None
    # `schema` shadows a BaseModel attribute, hence the alias.
    json_schema: dict[str, Any] | bool = Field(default=True, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(_Body):
    """extra: one constraint besides `response_format` (vLLM's `structured_outputs`)."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    grammar: str | None = None  # a Lark grammar
    choice: list[str] | None = None  # the output is exactly one of these strings


class _SamplingBody(_Body):
    """The sampling fields both endpoints share."""

    model: str = ""
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    response_format: ResponseFormat | None = None
    # extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    tier: Literal["gold", "silver", "bronze"] | None = None
    structured_outputs: StructuredOutputs | None = None


class CompletionRequest(_SamplingBody):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = None
    echo: bool = False
    logprobs: int | None = None  # top alternatives per token (OpenAI allows up to 5)
    suffix: str | None = None  # not supported: refused when set
    best_of: int | None = None  # supported only equal to n


class FunctionCall(_Body):
    name: str
    arguments: str = ""


class ToolCall(_Body):
    id: str = ""
    type: Literal["function"] = "function"
    function: FunctionCall


class ContentPart(_Body):
    type: str  # only "text" is served
    text: str | None = None


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None


class ChatCompletionRequest(_SamplingBody):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None  # wins over max_tokens
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None  # rendered by the chat template
    tool_choice: str | dict[str, Any] | None = None  # only "none" and "auto" are served
    # extras
    add_generation_prompt: bool = True  # open the assistant's turn after the messages
    chat_template_kwargs: dict[str, Any] | None = None  # more variables for the template


# ------------------------------------------------------------------------------ responses


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens served from the prefix cache


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "sitsd"
    root: str = ""  # the checkpoint it was loaded from
    max_model_len: int = 0


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class WeightsRun(BaseModel):
    """extra: consecutive tokens of a choice computed by one weights version (a trainer tells
    on-policy from off-policy tokens by it; the versions change only at a commit)."""

    version: str
    num_tokens: int


class CompletionLogprobs(BaseModel):
    """The legacy completions shape: parallel lists, one entry per token."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    # extra: the weights versions of its tokens, in order (a chunk: those since the last one)
    weights_versions: list[WeightsRun] | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None  # the weights version


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    weights_versions: list[WeightsRun] | None = None  # extra: its tokens' weights versions


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    # extra: the weights versions of the tokens since the choice's last chunk, in order
    weights_versions: list[WeightsRun] | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo
