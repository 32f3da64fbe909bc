"""Structured outputs: grammars compiled by llguidance, token masks applied on the device.

`GrammarCompiler` turns a `GrammarSpec` (JSON schema, any JSON object, regex, Lark grammar)
into llguidance's grammar over one tokenizer's vocabulary: `check` says whether it compiles
(the API calls it before a request is added, so a bad schema is a 400, never an engine
failure), `matcher` starts one request's matcher. `GrammarState` is that request's matcher
plus how many of its output tokens it has consumed; the runner keeps one per constrained
request and builds it again from the tokens after a preemption.

`GrammarMasks` is the step's part: for the constrained rows it brings each matcher up to the
request's last token, fills the rows of a host bitmask (one bit per token id, llguidance's
layout: 32 ids per int32 word), copies it to the device in one non-blocking copy from pinned
memory and masks the logits there: no host sync of its own. A matcher that has reached the
grammar's end allows only the end-of-sequence token, so the request stops on its next token.
(With asynchronous scheduling the last token of a request may still be on the device when the
next step is launched: reading it is then the one sync constrained requests add.)

Which requests are constrained is `SamplingParams.grammar`; sampling is `sampler`'s.
"""

from __future__ import annotations

import json
import sys
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import llguidance
import torch
from llguidance.torch import fill_next_token_bitmask

from sitsd.types import GrammarSpec, TokenizerLike

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

_BITS = 32  # token ids per bitmask word
_MAX_CACHED_GRAMMARS = 256


class GrammarError(ValueError):
    """A grammar that does not compile; the message says why."""


class GrammarCompiler:
    """Grammar specs -> llguidance matchers over one vocabulary (built once, on first use)."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_id: int) -> None:
        """Args:
        tokenizer_json: the `tokenizers` JSON of the serving tokenizer.
        vocab_size: rows of the model's logits (may exceed the tokenizer's ids).
        eos_token_id: the token a finished grammar allows.
        """
        self._tokenizer_json = tokenizer_json
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._grammars: OrderedDict[GrammarSpec, str] = OrderedDict()

    @classmethod
    def for_tokenizer(cls, tokenizer: TokenizerLike, vocab_size: int) -> GrammarCompiler:
        """From the serving tokenizer (its `backend` and `eos_token_ids`)."""
        eos = tokenizer.eos_token_ids
        return cls(tokenizer.backend.to_str(), vocab_size, eos[0] if eos else 0)

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        if self._tokenizer is None:
            self._tokenizer = llguidance.LLTokenizer(
                self._tokenizer_json, n_vocab=self.vocab_size, eos_token=self.eos_token_id
            )
        return self._tokenizer

    def grammar(self, spec: GrammarSpec) -> str:
        """llguidance's grammar text of `spec` (cached).

        Raises:
            GrammarError: the spec does not compile.
        """
        text = self._grammars.get(spec)
        if text is not None:
            self._grammars.move_to_end(spec)
            return text
        text = _grammar_text(spec)
        error = llguidance.LLMatcher.validate_grammar(text, self.tokenizer)
        if error:
            raise GrammarError(error)
        self._grammars[spec] = text
        if len(self._grammars) > _MAX_CACHED_GRAMMARS:
            self._grammars.popitem(last=False)
        return text

    def check(self, spec: GrammarSpec) -> None:
        """Raise `GrammarError` unless `spec` compiles."""
        self.grammar(spec)

    def matcher(self, spec: GrammarSpec) -> GrammarState:
        """A new request's matcher, at the start of the grammar."""
        matcher = llguidance.LLMatcher(self.tokenizer, self.grammar(spec))
        if matcher.is_error():
            raise GrammarError(matcher.get_error())
        return GrammarState(matcher)


def _grammar_text(spec: GrammarSpec) -> str:
    try:
        if spec.kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema(
                {"type": "object"}, defaults=_JSON_OPTIONS
            )
        if spec.kind == "json_schema":
            schema = json.loads(spec.source)
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=_JSON_OPTIONS)
        if spec.kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(spec.source)
        if spec.kind == "lark":
            return llguidance.LLMatcher.grammar_from_lark(spec.source)
    except (ValueError, TypeError) as exc:  # json.JSONDecodeError is a ValueError
        raise GrammarError(str(exc)) from exc
    raise GrammarError(f"unknown grammar kind {spec.kind!r}")


# Compact JSON: free whitespace lets a sampled model pad its output with newlines forever.
_JSON_OPTIONS: JsonCompileOptions = {"whitespace_flexible": False}


@dataclass(eq=False)
class GrammarState:
    """One request's matcher and how many of its output tokens it has consumed."""

    matcher: llguidance.LLMatcher
    num_consumed: int = 0

    def advance(self, output_token_ids: Sequence[int]) -> None:
        """Consume the outputs it has not seen yet (all of them after a preemption)."""
        new = output_token_ids[self.num_consumed :]
        if new:
            # A token the mask allowed is always accepted; a failure leaves the matcher in
            # its error state, whose mask allows only EOS: the request ends.
            self.matcher.consume_tokens(list(new))
            self.num_consumed = len(output_token_ids)


class GrammarMasks:
    """The host bitmask, its device copy, and the masking of constrained rows' logits."""

    def __init__(self, vocab_size: int, max_rows: int, device: torch.device) -> None:
        if sys.byteorder != "little":  # the bitmask is read byte by byte (CPUs and GPUs: little)
            raise RuntimeError("grammar masks need a little-endian host")
        self.vocab_size = vocab_size
        num_words = -(-vocab_size // _BITS)
        on_cuda = device.type == "cuda"
        self._host = torch.zeros(max_rows, num_words, dtype=torch.int32, pin_memory=on_cuda)
        self._dev = self._host.to(device) if on_cuda else self._host
        self._copied = torch.cuda.Event() if on_cuda else None
        # [256, 8] bool: bit b of a mask byte is 0 (the token 8k + b of byte k is not allowed)
        self._blocked = ((torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1 == 0).to(device)

    def apply(
        self,
        logits: torch.Tensor,  # [num_rows, vocab] float32, masked in place
        rows: Sequence[int],  # the constrained rows of `logits`, ascending
        states: Sequence[GrammarState],  # their matchers, brought up to date by the caller
    ) -> None:
        if not rows:
            return
        n = len(rows)
        if self._copied is not None:
            self._copied.synchronize()  # the last step's copy has left the host buffer
        for i, state in enumerate(states):
            fill_next_token_bitmask(state.matcher, self._host, i)
        words = self._dev[:n]
        if self._copied is not None:
            words.copy_(self._host[:n], non_blocking=True)
            self._copied.record()
        # One lookup per mask byte (little-endian: byte k of a word holds ids 8k .. 8k + 7).
        mask_bytes = words.view(torch.uint8).int()  # [n, 4 * num_words]
        blocked = self._blocked[mask_bytes].view(n, -1)[:, : self.vocab_size]  # [n, vocab]
        if rows[-1] - rows[0] + 1 == n:  # a run of rows (every row, often): masked in place
            logits[rows[0] : rows[-1] + 1].masked_fill_(blocked, float("-inf"))
            return
        index = _to_device(list(rows), logits.device)
        picked = logits.index_select(0, index).masked_fill_(blocked, float("-inf"))
        logits.index_copy_(0, index, picked)


def _to_device(values: list[int], device: torch.device) -> torch.Tensor:
    """A small host list on the device without a host sync (pinned source, async copy)."""
    t = torch.tensor(values, dtype=torch.int64)
    return t if device.type == "cpu" else t.pin_memory().to(device, non_blocking=True)
