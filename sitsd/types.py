"""Types that cross the boundary between the API layer and the engine.

Everything here is plain Python data (ints, strings, lists): no tensors, no proto messages.
The API layer (`sitsd.api`) turns proto messages into these; the engine (`sitsd.engine`) turns
its results back into `RequestDelta`s. `TokenizerLike` is what every layer may use of the
model's tokenizer (`sitsd.weights.Tokenizer` is the one).
"""

from __future__ import annotations

import enum
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


class SamplingError(ValueError):
    """A sampling parameter is out of range; `field` names it for the client."""

    def __init__(self, field_name: str, message: str) -> None:
        super().__init__(f"{field_name}: {message}")
        self.field = field_name


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to pick the next tokens of one request.

    `temperature == 0` is greedy decoding; `top_k == 0` and `top_p == 1` switch those filters off.
    `seed is None` means a seed drawn at admission: still reproducible from the engine's side,
    not from the client's.
    """

    max_tokens: int = 256
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def validate(self, max_tokens_limit: int) -> None:
        """Raise `SamplingError` naming the first field that is out of range."""
        if self.max_tokens < 1:
            raise SamplingError("max_tokens", f"must be at least 1, got {self.max_tokens}")
        if self.max_tokens > max_tokens_limit:
            raise SamplingError(
                "max_tokens", f"must be at most {max_tokens_limit}, got {self.max_tokens}"
            )
        if not self.temperature >= 0.0:  # also rejects NaN
            raise SamplingError("temperature", f"must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise SamplingError("top_p", f"must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise SamplingError("top_k", f"must be >= 0, got {self.top_k}")
        if any(not s for s in self.stop):
            raise SamplingError("stop", "stop strings must not be empty")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise SamplingError("seed", f"must be in [0, 2**63), got {self.seed}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True, slots=True)
class Usage:
    """Token counts of one request."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens served from the prefix cache


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
        self, messages: list[dict[str, str]], add_generation_prompt: bool = True
    ) -> str: ...
