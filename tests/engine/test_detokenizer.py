"""Incremental detokenization: UTF-8 safety and stop strings."""

from __future__ import annotations

import os
import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from sitsd.engine.detokenizer import IncrementalDetokenizer
from sitsd.engine.stop_strings import StopMatcher


def byte_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-in character for each byte (what ByteLevel tokens are made of)."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    mapping, extra = {}, 0
    for b in range(256):
        if b in printable:
            mapping[b] = chr(b)
        else:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


class ByteTokenizer:
    """Token id == byte value (byte-level BPE without merges): splits multi-byte characters."""

    eos_token_ids: tuple[int, ...] = ()  # none: the tests stop requests by max_tokens

    def __init__(self) -> None:
        vocab = {c: b for b, c in byte_to_unicode().items()}
        assert set(vocab) == set(pre_tokenizers.ByteLevel.alphabet())
        tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        self._tok = tok

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text).ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)


TEXTS = ["plain ascii text", "naïve café — 東京 🚀🎉 done", "emoji at end 👩‍👩‍👧", "a\n\tb  c"]


@pytest.mark.parametrize("text", TEXTS)
def test_streamed_pieces_concatenate_to_the_full_text_and_never_split_a_character(text):
    tok = ByteTokenizer()
    prompt = tok.encode("prompt: ")
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok, prompt)
    pieces = []
    i = 0
    while i < len(ids):
        n = random.randint(1, 3)
        pieces.append(detok.step(ids[i : i + n]))
        i += n
    pieces.append(detok.flush())
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)


def test_stop_string_cuts_the_text_and_reports_stopped():
    tok = ByteTokenizer()
    detok = IncrementalDetokenizer(tok, [], stop=["STOP"])
    out = ""
    for t in tok.encode("hello wSTOPorld"):
        out += detok.step([t])
        if detok.stopped:
            break
    out += detok.flush()
    assert detok.stopped
    assert out == "hello w"


def test_text_that_may_become_a_stop_string_is_held_back_then_released():
    tok = ByteTokenizer()
    detok = IncrementalDetokenizer(tok, [], stop=["</end>"])
    assert detok.step(tok.encode("ab</e")) == "ab"
    assert detok.step(tok.encode("x")) == "</ex"
    assert not detok.stopped


def test_earliest_of_several_stop_strings_wins():
    tok = ByteTokenizer()
    detok = IncrementalDetokenizer(tok, [], stop=["world", "lo w"])
    out = detok.step(tok.encode("hello world"))
    assert detok.stopped
    assert out == "hel"


def test_flush_releases_held_back_text_at_the_end():
    tok = ByteTokenizer()
    detok = IncrementalDetokenizer(tok, [], stop=["###"])
    assert detok.step(tok.encode("x ##")) == "x "
    assert detok.flush() == "##"


def reference_cut(text: str, stops: list[str]) -> int | None:
    """Where the text is cut: the start of the first stop string to end (the longest of those
    ending at the same character), found by brute force; None when none occurs."""
    for end in range(1, len(text) + 1):
        starts = [end - len(s) for s in stops if end >= len(s) and text[end - len(s) : end] == s]
        if starts:
            return min(starts)
    return None


def test_stop_strings_cut_where_a_brute_force_search_does_however_the_text_arrives():
    tok = ByteTokenizer()
    rng = random.Random(os.urandom(8))
    alphabet = "ab é🚀"  # few letters: stop strings overlap and nest often
    for _ in range(300):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 40)))
        stops = [
            "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 5)))
            for _ in range(rng.randint(1, 6))
        ]
        detok = IncrementalDetokenizer(tok, [], stop=stops)
        ids, out, i = tok.encode(text), "", 0
        while i < len(ids) and not detok.stopped:
            n = rng.randint(1, 4)
            piece = detok.step(ids[i : i + n])
            i += n
            out += piece
            # Nothing sent may be undone: it can never be part of a stop string found later.
            cut = reference_cut(text, stops)
            assert cut is None or len(out) <= cut, (text, stops, out)
        out += detok.flush()
        cut = reference_cut(text, stops)
        assert detok.stopped == (cut is not None), (text, stops)
        assert out == (text if cut is None else text[:cut]), (text, stops)


def test_the_matcher_holds_back_exactly_the_longest_suffix_that_begins_a_stop_string():
    rng = random.Random(os.urandom(8))
    for _ in range(200):
        stops = ["".join(rng.choice("xyz") for _ in range(rng.randint(1, 6))) for _ in range(4)]
        matcher, text = StopMatcher(stops), ""
        while True:
            piece = "".join(rng.choice("xyz") for _ in range(rng.randint(1, 3)))
            found = matcher.feed(piece)
            text += piece
            if found is not None:
                assert found == reference_cut(text, stops)
                break
            assert reference_cut(text, stops) is None
            longest = max(
                (n for n in range(1, len(text) + 1) if any(s.startswith(text[-n:]) for s in stops)),
                default=0,
            )
            assert matcher.num_held == longest
