"""Prompts of OpenAI bodies -> token ids: completion prompts (text or ids, one or a batch) and
chat conversations rendered with the model's chat template.

Messages reach the template as `transformers` hands them over: dicts with `role`, `content` (a
string; text parts are joined), and `tool_calls` / `tool_call_id` / `name` where the client
sent them, tool calls' `arguments` parsed from their JSON text, as chat templates expect. The
template, and what it makes of roles and tools, is the model's (`sitsd.weights`). The checks
are the shared ones (`sitsd.engine.validation`: text that cannot fit the context or is not valid
Unicode is refused before it is tokenized, token ids against the vocabulary), and long text is
tokenized off the event loop (`sitsd.api.inference.encode_text`), as for gRPC.
"""

from __future__ import annotations

import json
from typing import Any, Protocol

from sitsd.api.inference import encode_text
from sitsd.engine.validation import (
    check_prompt_length,
    check_prompt_text,
    check_text_fits,
    check_token_ids,
)
from sitsd.http.errors import bad_request
from sitsd.http.protocol import ChatCompletionRequest, ChatMessage, CompletionRequest
from sitsd.outputs import ModelInfo


class ChatTokenizer(Protocol):
    """What prompts need of a tokenizer (`sitsd.weights.Tokenizer`)."""

    has_chat_template: bool

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **extra: Any
    ) -> str: ...


async def completion_prompts(
    body: CompletionRequest, tokenizer: ChatTokenizer, info: ModelInfo
) -> tuple[list[list[int]], list[str | None]]:
    """The token ids of each prompt of the batch, and each one's text (None for token ids)."""
    prompt = body.prompt
    if isinstance(prompt, str):
        items: list[str | list[int]] = [prompt]
    elif prompt and all(isinstance(p, int) for p in prompt):
        items = [list(prompt)]  # type: ignore[arg-type]
    else:
        items = list(prompt)  # type: ignore[arg-type]
    if not items:
        raise bad_request("prompt", "the prompt is empty")
    for item in items:  # every one checked before any is tokenized
        if isinstance(item, str):
            check_prompt_text(item, info)
        else:
            check_prompt_length(len(item), info)
            check_token_ids("prompt", item, info.vocab_size)
    token_ids: list[list[int]] = []
    texts: list[str | None] = []
    for item in items:
        if isinstance(item, str):
            token_ids.append(await encode_text(tokenizer, item, add_special_tokens=True))
            texts.append(item)
        else:
            token_ids.append(list(item))
            texts.append(None)
    return token_ids, texts


async def chat_prompt(
    body: ChatCompletionRequest, tokenizer: ChatTokenizer, info: ModelInfo
) -> list[int]:
    """The conversation rendered with the model's template and tokenized."""
    if not tokenizer.has_chat_template:
        raise bad_request("messages", "the model has no chat template; use /v1/completions")
    messages = [template_message(m, i) for i, m in enumerate(body.messages)]
    # Before rendering them: what the client wrote must fit, and be text a tokenizer takes.
    check_text_fits("messages", [str(m.get("content", "")) for m in messages], info)
    extra: dict[str, Any] = dict(body.chat_template_kwargs or {})
    if body.tools and body.tool_choice != "none":
        extra["tools"] = body.tools
    try:
        text = tokenizer.apply_chat_template(
            messages, add_generation_prompt=body.add_generation_prompt, **extra
        )
    except ValueError as exc:  # sitsd.weights.ChatTemplateError: the template refused them
        raise bad_request("messages", str(exc)) from exc
    check_text_fits("messages", [text], info)  # roles, names, tools: all of it is tokenized
    # The template writes the special tokens (BOS, role markers) itself.
    return await encode_text(tokenizer, text, add_special_tokens=False)


def template_message(message: ChatMessage, index: int) -> dict[str, Any]:
    """One message as chat templates take it (see the module docstring)."""
    out: dict[str, Any] = {"role": message.role, "content": _text(message, index)}
    if message.name is not None:
        out["name"] = message.name
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    if message.tool_calls:
        out["tool_calls"] = [
            {
                "id": call.id,
                "type": call.type,
                "function": {
                    "name": call.function.name,
                    "arguments": _arguments(call.function.arguments, index),
                },
            }
            for call in message.tool_calls
        ]
    return out


def _text(message: ChatMessage, index: int) -> str:
    content = message.content
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = []
    for part in content:
        if part.type != "text" or part.text is None:
            raise bad_request(
                f"messages[{index}].content", f"only text parts are supported, got {part.type!r}"
            )
        parts.append(part.text)
    return "".join(parts)


def _arguments(arguments: str, index: int) -> Any:
    """Tool call arguments as data: templates iterate over them (`arguments | items`)."""
    if not arguments:
        return {}
    try:
        return json.loads(arguments)
    except json.JSONDecodeError:
        raise bad_request(
            f"messages[{index}].tool_calls", "function.arguments must be JSON text"
        ) from None
