"""Types that cross the boundary between the API layer and the engine.

Everything here is plain Python data (ints, strings, lists): no tensors, no proto messages.
The API layer (`sitsd.api`) turns proto messages into these; the engine (`sitsd.engine`) turns
its results back into `RequestDelta`s. `TokenizerLike` is what every layer may use of the
model's tokenizer (`sitsd.weights.Tokenizer` is the one).
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import tokenizers


class Tier(enum.StrEnum):
    """SLA tier of a request: sets its latency targets and its scheduling priority."""

    GOLD = "gold"
    SILVER = "silver"
    BRONZE = "bronze"

    @property
    def rank(self) -> int:
        """Lower rank is served first."""
        return _TIER_RANK[self]


TIER_ORDER = (Tier.GOLD, Tier.SILVER, Tier.BRONZE)  # highest priority first
_TIER_RANK = {tier: rank for rank, tier in enumerate(TIER_ORDER)}


class FinishReason(enum.StrEnum):
    """Why a request stopped producing tokens."""

    STOP = "stop"  # an end-of-sequence token, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the model's context length reached
    ABORT = "abort"  # cancelled by the client, a passed deadline or shutdown
    ERROR = "error"  # the engine failed while serving it


class AbortCause(enum.StrEnum):
    """Why the engine aborted a request, when the API must answer more than ABORTED."""

    DEADLINE = "deadline"  # the request's own deadline passed (DEADLINE_EXCEEDED)
    OVERLOADED = "overloaded"  # refused or shed to keep its tier's queue wait (RESOURCE_EXHAUSTED)


class EndReason(enum.StrEnum):
    """How a request ended, as telemetry tells it: finer than the client's `FinishReason`.

    A trace attribute and a metric label (`sitsd_requests_finished_total{finish_reason}`);
    the API keeps answering with `FinishReason` and its statuses.
    """

    STOP = "stop"  # finished normally: EOS, a stop token or a stop string
    LENGTH = "length"  # finished normally: max_tokens or the context
    REFUSED = "refused"  # admission control refused it on arrival: never queued
    SHED = "shed"  # dropped after waiting past its tier's queue limit without a token
    DEADLINE = "deadline"  # its deadline passed (the engine's clock or the client's)
    CANCELLED = "cancelled"  # the client cancelled the call or went away
    SHUTDOWN = "shutdown"  # the daemon stopped while it was live
    ERROR = "error"  # the engine failed while serving it


class SamplingError(ValueError):
    """A sampling parameter is out of range; `field` names it for the client."""

    def __init__(self, field_name: str, message: str) -> None:
        super().__init__(f"{field_name}: {message}")
        self.field = field_name


GRAMMAR_KINDS = ("json_schema", "json_object", "regex", "lark")
MAX_TOP_LOGPROBS = 20  # the most alternatives a request may ask for at each position
# Bounds on what a request makes the engine check at every token (OpenAI allows 4 stop strings).
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 128


@dataclass(frozen=True, slots=True)
class GrammarSpec:
    """A constraint on a request's output, enforced token by token while it decodes.

    `kind` is one of `GRAMMAR_KINDS`: "json_schema" (`source` is the schema as JSON text),
    "json_object" (any JSON object; `source` is ignored), "regex" or "lark" (a Lark grammar).
    """

    kind: str
    source: str = ""


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to pick the next tokens of one request.

    `temperature == 0` is greedy decoding; `top_k == 0`, `top_p == 1` and `min_p == 0` switch
    those filters off. `seed is None` means a seed drawn at admission: still reproducible from
    the engine's side, not from the client's. Penalties and `logit_bias` change the logits
    before any choice, greedy ones too (OpenAI's and vLLM's definitions: presence and frequency
    over the output so far, repetition over prompt and output). `logprobs` asks for the
    log-probability of each sampled token under the model (its log-softmax, before any of
    the above) plus that many top alternatives; None asks for none.
    """

    max_tokens: int = 256
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_p: float = 0.0  # drop tokens less likely than min_p times the most likely one
    presence_penalty: float = 0.0  # subtracted from the logit of every token already output
    frequency_penalty: float = 0.0  # subtracted once per earlier occurrence in the output
    repetition_penalty: float = 1.0  # divides positive (multiplies negative) seen logits
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)
    logprobs: int | None = None  # top alternatives per sampled token; None = no logprobs
    grammar: GrammarSpec | None = None  # the output must match it

    def validate(self, max_tokens_limit: int) -> None:
        """Raise `SamplingError` naming the first field that is out of range."""
        if self.max_tokens < 1:
            raise SamplingError("max_tokens", f"must be at least 1, got {self.max_tokens}")
        if self.max_tokens > max_tokens_limit:
            raise SamplingError(
                "max_tokens", f"must be at most {max_tokens_limit}, got {self.max_tokens}"
            )
        if not 0.0 <= self.temperature < math.inf:  # also rejects NaN
            raise SamplingError(
                "temperature", f"must be a finite number >= 0, got {self.temperature}"
            )
        if not 0.0 < self.top_p <= 1.0:
            raise SamplingError("top_p", f"must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise SamplingError("top_k", f"must be >= 0, got {self.top_k}")
        self._validate_stops()
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise SamplingError("seed", f"must be in [0, 2**63), got {self.seed}")
        self._validate_extras()

    def _validate_stops(self) -> None:
        if len(self.stop) > MAX_STOP_STRINGS:
            raise SamplingError(
                "stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}"
            )
        for stop in self.stop:
            if not stop:
                raise SamplingError("stop", "stop strings must not be empty")
            if len(stop) > MAX_STOP_STRING_CHARS:
                raise SamplingError(
                    "stop", f"stop strings must be at most {MAX_STOP_STRING_CHARS} characters, "
                    f"got one of {len(stop)}",
                )  # fmt: skip
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise SamplingError(
                "stop_token_ids",
                f"at most {MAX_STOP_TOKEN_IDS} ids, got {len(self.stop_token_ids)}",
            )

    def _validate_extras(self) -> None:
        if not 0.0 <= self.min_p <= 1.0:
            raise SamplingError("min_p", f"must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:
                raise SamplingError(name, f"must be in [-2, 2], got {value}")
        if not 0.0 < self.repetition_penalty <= 2.0:
            raise SamplingError(
                "repetition_penalty", f"must be in (0, 2], got {self.repetition_penalty}"
            )
        for token_id, bias in self.logit_bias:
            if not -100.0 <= bias <= 100.0:
                raise SamplingError(
                    "logit_bias", f"biases must be in [-100, 100], got {bias} for {token_id}"
                )
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise SamplingError(
                "top_logprobs", f"must be in [0, {MAX_TOP_LOGPROBS}], got {self.logprobs}"
            )
        if self.grammar is not None and self.grammar.kind not in GRAMMAR_KINDS:
            raise SamplingError(
                "response_format", f"unknown kind {self.grammar.kind!r}; one of {GRAMMAR_KINDS}"
            )

    @property
    def penalized(self) -> bool:
        """Whether any penalty changes this request's logits."""
        return bool(self.presence_penalty or self.frequency_penalty) or (
            self.repetition_penalty != 1.0
        )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True, slots=True)
class Usage:
    """Token counts of one request."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens served from the prefix cache


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """A sampled token's log-probability under the model, and the most likely alternatives."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob), most likely first


@dataclass(slots=True)
class RequestDelta:
    """What one engine step produced for one request; the last one has `finish_reason` set."""

    req_id: str
    new_token_ids: list[int] = field(default_factory=list)
    text: str = ""  # detokenized text of new_token_ids (held back across UTF-8 and stop strings)
    finish_reason: FinishReason | None = None
    usage: Usage | None = None  # set on the last delta
    weights_version: str = ""  # the weights version that produced these tokens
    error: str = ""  # set when finish_reason is ERROR or ABORT, for the client
    abort_cause: AbortCause | None = None  # set when the engine itself aborted the request
    # One per new token when the request asked for logprobs (`SamplingParams.logprobs`).
    logprobs: list[TokenLogprob] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def followed_by(self, later: RequestDelta) -> RequestDelta:
        """This delta and the next one of the same request as one (same weights version)."""
        return RequestDelta(
            req_id=self.req_id,
            new_token_ids=self.new_token_ids + later.new_token_ids,
            text=self.text + later.text,
            finish_reason=later.finish_reason,
            usage=later.usage,
            weights_version=self.weights_version,
            error=later.error,
            abort_cause=later.abort_cause,
            logprobs=(
                None
                if self.logprobs is None and later.logprobs is None
                else (self.logprobs or []) + (later.logprobs or [])
            ),
        )


class TokenizerLike(Protocol):
    """The model's tokenizer, as the engine, the API and hot-swap use it."""

    @property
    def eos_token_ids(self) -> Sequence[int]:
        """Every id that ends generation, the primary EOS first."""
        ...

    @property
    def has_chat_template(self) -> bool: ...

    @property
    def backend(self) -> tokenizers.Tokenizer:
        """The Hugging Face `tokenizers` object (its vocabulary identifies the tokenizer)."""
        ...

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...

    def apply_chat_template(
        self,
        messages: list[dict[str, object]],
        add_generation_prompt: bool = True,
        **extra: object,
    ) -> str:
        """The conversation as prompt text; `extra` reaches the template (e.g. `tools`)."""
        ...
