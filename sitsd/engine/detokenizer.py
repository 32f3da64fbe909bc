"""Incremental, UTF-8-safe detokenization with stop strings.

Byte-level tokenizers split characters across tokens, so decoding one token at a time yields
U+FFFD halves. The detokenizer decodes a short window of recent tokens and emits only the text
that became complete, the way TGI and vLLM do. Text that could still grow into a stop string is
held back until it can no longer match; the first stop string to be completed is cut off with
everything after. Finding them is `sitsd.engine.stop_strings.StopMatcher`'s: per character of
new text, whatever the number of stop strings.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from sitsd.engine.stop_strings import StopMatcher

# Prompt tokens decoded along with the first outputs, so tokenizers that render a leading space
# from context (SentencePiece) produce the same text as decoding the whole sequence.
_PROMPT_CONTEXT = 5


class Decoder(Protocol):
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    """Turns a request's stream of token ids into a stream of text pieces."""

    def __init__(
        self, tokenizer: Decoder, prompt_token_ids: Sequence[int], stop: Sequence[str] = ()
    ) -> None:
        self._tokenizer = tokenizer
        self._ids = list(prompt_token_ids[-_PROMPT_CONTEXT:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._stops = StopMatcher(stop) if stop else None
        self.text = ""  # all output text decoded so far (before stop-string truncation)
        self._num_sent = 0  # characters of `text` already handed out
        self._num_matched = 0  # characters of `text` the stop matcher has read
        self.stopped = False  # a stop string matched

    def step(self, new_token_ids: Sequence[int]) -> str:
        """Add tokens; return the text that is now safe to send. Sets `stopped` on a match."""
        if self.stopped:
            return ""
        self._ids.extend(new_token_ids)
        self.text += self._decode_new()
        return self._release()

    def flush(self) -> str:
        """At the end of the request: everything not yet sent, incomplete characters included."""
        if self.stopped:
            return ""
        tail = self._tokenizer.decode(self._ids[self._prefix_offset :])
        head = self._tokenizer.decode(self._ids[self._prefix_offset : self._read_offset])
        if tail.startswith(head) and len(tail) > len(head):
            self.text += tail[len(head) :]
            self._read_offset = len(self._ids)
        out = self.text[self._num_sent :]
        self._num_sent = len(self.text)
        return out

    def _decode_new(self) -> str:
        head = self._tokenizer.decode(self._ids[self._prefix_offset : self._read_offset])
        full = self._tokenizer.decode(self._ids[self._prefix_offset :])
        if len(full) > len(head) and not full.endswith("\ufffd"):
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._ids)
            return full[len(head) :]
        return ""

    def _release(self) -> str:
        if self._stops is None:
            out = self.text[self._num_sent :]
            self._num_sent = len(self.text)
            return out
        # Only the text decoded since the last step is read: a stop string can end only in it.
        first = self._stops.feed(self.text[self._num_matched :])
        self._num_matched = len(self.text)
        if first is not None:
            self.stopped = True
            out = self.text[self._num_sent : first]
            self._num_sent = first
            self.text = self.text[:first]
            return out
        # What may still grow into a stop string is held back (never inside text sent: the
        # matcher's state is the longest suffix that begins a stop string, shorter than one).
        end = max(self._num_sent, len(self.text) - self._stops.num_held)
        out = self.text[self._num_sent : end]
        self._num_sent = end
        return out
