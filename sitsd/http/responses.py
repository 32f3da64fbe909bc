"""Engine deltas -> OpenAI bodies: whole responses, and the chunks of a stream.

`Collected` gathers the deltas of every choice for a non-streamed answer; `completion_chunk`
and `chat_chunk` turn one delta into one chunk, in the format the `openai` client parses:
text and logprobs as they come, `finish_reason` only on a choice's last chunk, and (with
`stream_options.include_usage`) a last chunk with `choices == []` and the usage. Logprobs are
the engine's (`TokenLogprob`), with each token's text as it decodes alone. Every choice says
which weights version computed its tokens (the extra `weights_versions`: runs of tokens per
version, in order; a chunk's are the tokens since the choice's last chunk, so text held back
by the detokenizer keeps its tokens' versions). Error answers are
`sitsd.http.errors`'; the SSE framing is `sitsd.http.sse`'.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from sitsd.http.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprobs,
    ChatResponseMessage,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    PromptTokensDetails,
    TopLogprob,
    UsageInfo,
    WeightsRun,
)
from sitsd.types import RequestDelta, TokenLogprob


class Decoder(Protocol):
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


class TokenTexts:
    """Each token id's text when decoded alone (what logprobs name), decoded once."""

    def __init__(self, tokenizer: Decoder) -> None:
        self._tokenizer = tokenizer
        self._texts: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self._tokenizer.decode([token_id], skip_special_tokens=False)
            self._texts[token_id] = text
        return text


@dataclass
class Header:
    """What every body and chunk of one answer repeats."""

    id: str
    created: int
    model: str


@dataclass
class _Choice:
    texts: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    completion_tokens: int = 0
    runs: list[WeightsRun] = field(default_factory=list)  # every token's weights version
    unsent: list[WeightsRun] = field(default_factory=list)  # streamed: not in a chunk yet


def _extend(runs: list[WeightsRun], version: str, num_tokens: int) -> None:
    if runs and runs[-1].version == version:
        runs[-1].num_tokens += num_tokens
    else:
        runs.append(WeightsRun(version=version, num_tokens=num_tokens))


@dataclass
class Collected:
    """Every choice's text, logprobs and finish, and the usage, as deltas arrive."""

    num_choices: int
    prompt_lengths: list[int]  # tokens of each prompt
    n: int  # choices per prompt
    choices: list[_Choice] = field(init=False)
    cached_tokens: int = 0  # prompt tokens the first choice of each prompt found cached
    weights_version: str = ""

    def __post_init__(self) -> None:
        self.choices = [_Choice() for _ in range(self.num_choices)]

    def add(self, index: int, delta: RequestDelta) -> None:
        choice = self.choices[index]
        choice.texts.append(delta.text)
        choice.logprobs += delta.logprobs or ()
        self.weights_version = delta.weights_version or self.weights_version
        if delta.new_token_ids:
            _extend(choice.runs, delta.weights_version, len(delta.new_token_ids))
            _extend(choice.unsent, delta.weights_version, len(delta.new_token_ids))
        if delta.finished:
            choice.finish_reason = delta.finish_reason.value if delta.finish_reason else None
            if delta.usage is not None:
                choice.completion_tokens = delta.usage.completion_tokens
                if index % self.n == 0:
                    self.cached_tokens += delta.usage.cached_tokens

    def unsent_versions(self, index: int) -> list[WeightsRun]:
        """The versions of choice `index`'s tokens no chunk has carried yet."""
        return list(self.choices[index].unsent)

    def mark_sent(self, index: int) -> None:
        """A chunk carried them."""
        self.choices[index].unsent.clear()

    def usage(self) -> UsageInfo:
        prompt = sum(self.prompt_lengths)
        completion = sum(c.completion_tokens for c in self.choices)
        return UsageInfo(
            prompt_tokens=prompt,
            completion_tokens=completion,
            total_tokens=prompt + completion,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=self.cached_tokens),
        )

    def completion(
        self, header: Header, texts: TokenTexts, prompt_texts: Sequence[str | None], echo: bool
    ) -> CompletionResponse:
        choices = []
        for index, choice in enumerate(self.choices):
            prefix = (prompt_texts[index // self.n] or "") if echo else ""
            choices.append(
                CompletionChoice(
                    index=index,
                    text=prefix + "".join(choice.texts),
                    logprobs=completion_logprobs(choice.logprobs, texts, len(prefix)),
                    finish_reason=choice.finish_reason,
                    weights_versions=choice.runs,
                )
            )
        return CompletionResponse(
            id=header.id, created=header.created, model=header.model, choices=choices,
            usage=self.usage(), system_fingerprint=self.weights_version or None,
        )  # fmt: skip

    def chat(self, header: Header, texts: TokenTexts, logprobs: bool) -> ChatCompletionResponse:
        choices = [
            ChatChoice(
                index=index,
                message=ChatResponseMessage(content="".join(choice.texts)),
                logprobs=chat_logprobs(choice.logprobs, texts) if logprobs else None,
                finish_reason=choice.finish_reason,
                weights_versions=choice.runs,
            )
            for index, choice in enumerate(self.choices)
        ]
        return ChatCompletionResponse(
            id=header.id, created=header.created, model=header.model, choices=choices,
            usage=self.usage(), system_fingerprint=self.weights_version or None,
        )  # fmt: skip


def completion_logprobs(
    entries: Sequence[TokenLogprob], texts: TokenTexts, offset: int = 0
) -> CompletionLogprobs | None:
    """The legacy shape (parallel lists); None when the request asked for no logprobs."""
    if not entries:
        return None
    out = CompletionLogprobs()
    for entry in entries:
        token = texts(entry.token_id)
        out.tokens.append(token)
        out.token_logprobs.append(entry.logprob)
        out.top_logprobs.append({texts(t): lp for t, lp in entry.top} if entry.top else None)
        out.text_offset.append(offset)
        offset += len(token)
    return out


def chat_logprobs(entries: Sequence[TokenLogprob], texts: TokenTexts) -> ChatLogprobs:
    return ChatLogprobs(content=[_chat_token(entry, texts) for entry in entries])


def _chat_token(entry: TokenLogprob, texts: TokenTexts) -> ChatTokenLogprob:
    token = texts(entry.token_id)
    return ChatTokenLogprob(
        token=token,
        logprob=entry.logprob,
        bytes=list(token.encode()),
        top_logprobs=[
            TopLogprob(token=texts(t), logprob=lp, bytes=list(texts(t).encode()))
            for t, lp in entry.top
        ],
    )


def finish_name(delta: RequestDelta) -> str | None:
    return delta.finish_reason.value if delta.finished and delta.finish_reason else None


def completion_chunk(
    header: Header,
    index: int,
    delta: RequestDelta,
    texts: TokenTexts,
    prefix: str = "",
    versions: list[WeightsRun] | None = None,
) -> CompletionResponse | None:
    """The chunk of one delta; None when it carries nothing a client sees (text held back).
    `versions`: of the tokens since the choice's last chunk."""
    if not (delta.text or prefix or delta.logprobs or delta.finished):
        return None
    choice = CompletionChoice(
        index=index,
        text=prefix + delta.text,
        logprobs=completion_logprobs(delta.logprobs or (), texts, len(prefix)),
        finish_reason=finish_name(delta),
        weights_versions=versions,
    )
    return CompletionResponse(
        id=header.id, created=header.created, model=header.model, choices=[choice],
        system_fingerprint=delta.weights_version or None,
    )  # fmt: skip


def chat_chunk(
    header: Header,
    index: int,
    delta: RequestDelta,
    texts: TokenTexts,
    logprobs: bool,
    versions: list[WeightsRun] | None = None,
) -> ChatCompletionChunk | None:
    """The chunk of one delta; None when it carries nothing a client sees. `versions`: of
    the tokens since the choice's last chunk."""
    if not (delta.text or delta.logprobs or delta.finished):
        return None
    choice = ChatChunkChoice(
        index=index,
        delta=ChatDelta(content=delta.text or None),
        logprobs=chat_logprobs(delta.logprobs or (), texts) if logprobs else None,
        finish_reason=finish_name(delta),
        weights_versions=versions,
    )
    return ChatCompletionChunk(
        id=header.id, created=header.created, model=header.model, choices=[choice],
        system_fingerprint=delta.weights_version or None,
    )  # fmt: skip


def chat_role_chunk(header: Header, num_choices: int) -> ChatCompletionChunk:
    """The first chunk: each choice's role, as OpenAI sends it."""
    choices = [
        ChatChunkChoice(index=i, delta=ChatDelta(role="assistant", content=""))
        for i in range(num_choices)
    ]
    return ChatCompletionChunk(
        id=header.id, created=header.created, model=header.model, choices=choices
    )
