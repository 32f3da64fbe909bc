"""Stop strings found in a stream of text in time independent of how many there are.

`StopMatcher` is an Aho-Corasick automaton over a request's stop strings, fed the text as it is
decoded: each character costs one transition (amortized; failure links never go deeper than the
text read), whatever the number of stop strings. It answers the detokenizer's two questions:

- did a stop string just end? The first one to end wins (of those ending at the same
  character, the longest, which started first); its start is where the text is cut;
- how much of the text may still be the start of a stop string? The automaton's state is the
  longest suffix of the text that is a prefix of some stop string: exactly what must be held
  back, so text that is sent can never turn out to be part of a match.

Building it costs one step per character of the stop strings (their count and length are
bounded by `SamplingParams.validate`). Decoding tokens into text is `sitsd.engine.detokenizer`'s.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence


class StopMatcher:
    """The stop strings of one request, and how far the text fed so far matches them."""

    def __init__(self, stops: Sequence[str]) -> None:
        """Args: stops: the stop strings (non-empty; duplicates are harmless)."""
        self._goto: list[dict[str, int]] = [{}]  # node -> next char -> node
        self._depth = [0]  # characters from the root: the length of the node's string
        self._match = [0]  # length of the longest stop string that is a suffix of the node's
        for stop in stops:
            self._insert(stop)
        self._fail = [0] * len(self._goto)
        self._link_failures()
        self._state = 0
        self._num_fed = 0  # characters fed so far

    def _insert(self, stop: str) -> None:
        node = 0
        for char in stop:
            child = self._goto[node].get(char)
            if child is None:
                child = len(self._goto)
                self._goto[node][char] = child
                self._goto.append({})
                self._depth.append(self._depth[node] + 1)
                self._match.append(0)
            node = child
        self._match[node] = len(stop)

    def _link_failures(self) -> None:
        """Failure links breadth first: a node's is the longest proper suffix that is a node."""
        queue = deque(self._goto[0].values())
        while queue:
            node = queue.popleft()
            for char, child in self._goto[node].items():
                fallback = self._fail[node]
                while fallback and char not in self._goto[fallback]:
                    fallback = self._fail[fallback]
                self._fail[child] = self._goto[fallback].get(char, 0)
                if not self._match[child]:
                    self._match[child] = self._match[self._fail[child]]
                queue.append(child)

    def feed(self, text: str) -> int | None:
        """Read `text`; where the first stop string to end in it starts (an offset into all
        the text fed so far), or None. After a match the matcher must not be fed again."""
        goto, fail, match = self._goto, self._fail, self._match
        state = self._state
        for offset, char in enumerate(text):
            while state and char not in goto[state]:
                state = fail[state]
            state = goto[state].get(char, 0)
            if match[state]:
                self._state = state
                end = self._num_fed + offset + 1
                self._num_fed += len(text)
                return end - match[state]
        self._state = state
        self._num_fed += len(text)
        return None

    @property
    def num_held(self) -> int:
        """Characters at the end of the text fed that may still begin a stop string."""
        return self._depth[self._state]
