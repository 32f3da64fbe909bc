"""The serving tokenizer: ids equal transformers' for HF directories and GGUF vocabularies
(byte-level BPE and SentencePiece), BOS/EOS handling, special tokens, decoding."""

from __future__ import annotations

import random
import threading
import time

import pytest

from sitsd.weights import load_checkpoint
from tests.weights.tiny_models import (
    ENDOFTEXT_ID,
    IM_END_ID,
    IM_START_ID,
    tiny_tokenizer,
    write_sentencepiece_gguf,
    write_tiny_gguf,
    write_tiny_llama,
)

TEXTS = [
    "Hello, world!",
    "  leading and trailing spaces  ",
    "def add(a, b):\n\treturn a + b\n",
    "Numbers 1234567 and 3.14159",
    "Caf\u00e9 \u4f60\u597d \U0001f600 mixed",
    "<|im_start|>user\nhi<|im_end|>",
    "",
]
_ALPHABET = "abcdefghij XYZ0123456789.,;!?\n\t\u00e9\u00fc\u4f60\u597d\U0001f600<|>"


def random_text(rng: random.Random, max_len: int = 60) -> str:
    return "".join(rng.choice(_ALPHABET) for _ in range(rng.randrange(1, max_len)))


@pytest.fixture(scope="module")
def hf_pair(tmp_path_factory):
    """(our tokenizer, transformers' tokenizer) of the tiny HF directory, BOS added."""
    from transformers import AutoTokenizer

    model_dir = write_tiny_llama(tmp_path_factory.mktemp("tok") / "m", add_bos_token=True)
    ours = load_checkpoint(model_dir, load_tensors=False).tokenizer
    return ours, AutoTokenizer.from_pretrained(model_dir)


def test_hf_directory_encodes_like_transformers(hf_pair, seed):
    ours, theirs = hf_pair
    rng = random.Random(seed)

    for text in TEXTS + [random_text(rng) for _ in range(20)]:
        assert ours.encode(text) == theirs.encode(text), text
        assert ours.encode(text, add_special_tokens=False) == theirs.encode(
            text, add_special_tokens=False
        ), text


def test_add_bos_token_prepends_bos_only_with_special_tokens(hf_pair):
    ours, _ = hf_pair

    assert ours.add_bos_token
    assert ours.encode("hi")[0] == ours.bos_token_id == ENDOFTEXT_ID
    assert ours.encode("hi", add_special_tokens=False)[0] != ENDOFTEXT_ID


def test_decode_round_trips_text(hf_pair, seed):
    ours, _ = hf_pair
    rng = random.Random(seed)

    for text in TEXTS[:5] + [random_text(rng).replace("<|", "") for _ in range(20)]:
        assert ours.decode(ours.encode(text, add_special_tokens=False)) == text


def test_decode_skips_special_tokens_unless_asked(hf_pair):
    ours, _ = hf_pair
    ids = ours.encode("<|im_start|>hi<|im_end|>", add_special_tokens=False)

    assert ids[0] == IM_START_ID
    assert ids[-1] == IM_END_ID
    assert ours.decode(ids) == "hi"
    assert ours.decode(ids, skip_special_tokens=False) == "<|im_start|>hi<|im_end|>"


def test_special_token_ids_and_eos(hf_pair):
    ours, _ = hf_pair

    assert {ENDOFTEXT_ID, IM_START_ID, IM_END_ID} <= ours.special_token_ids
    assert ours.eos_token_ids[0] == IM_END_ID
    assert ours.pad_token_id == ENDOFTEXT_ID


def test_embedding_padding_rows_decode_to_nothing(tmp_path, seed):
    tok_size = tiny_tokenizer().get_vocab_size()
    model_dir = write_tiny_llama(tmp_path / "m", vocab_size=tok_size + 24, seed=seed)
    tok = load_checkpoint(model_dir, load_tensors=False).tokenizer
    ids = tok.encode("hello", add_special_tokens=False)

    assert tok.vocab_size == tok_size + 24
    assert tok.decode([*ids, tok_size + 3]) == "hello"


def test_bos_comes_from_the_tokenizer_json_post_processor_when_config_is_silent(tmp_path):
    import json

    from tokenizers import processors

    model_dir = write_tiny_llama(tmp_path / "m")
    backend = tiny_tokenizer()
    backend.post_processor = processors.TemplateProcessing(
        single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", ENDOFTEXT_ID)]
    )
    backend.save(str(model_dir / "tokenizer.json"))
    config_file = model_dir / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    del config["add_bos_token"], config["add_eos_token"]
    config_file.write_text(json.dumps(config))

    tok = load_checkpoint(model_dir, load_tensors=False).tokenizer

    assert tok.add_bos_token
    assert tok.encode("hi")[0] == ENDOFTEXT_ID
    assert ENDOFTEXT_ID not in tok.encode("hi", add_special_tokens=False)


# --- GGUF vocabularies ----------------------------------------------------------------------------


def test_gguf_byte_level_vocab_encodes_like_the_original_tokenizer(tmp_path, seed):
    path, _ = write_tiny_gguf(tmp_path / "m.gguf", pre="gpt2", seed=seed)
    tok = load_checkpoint(path, load_tensors=False).tokenizer
    original = tiny_tokenizer()
    rng = random.Random(seed)

    for text in TEXTS + [random_text(rng) for _ in range(20)]:
        assert tok.encode(text, add_special_tokens=False) == original.encode(text).ids, text


def test_gguf_metadata_sets_special_tokens_and_bos_behaviour(tmp_path, seed):
    path, _ = write_tiny_gguf(tmp_path / "m.gguf", seed=seed)

    tok = load_checkpoint(path, load_tensors=False).tokenizer

    assert tok.bos_token_id == IM_START_ID
    assert not tok.add_bos_token
    assert tok.eos_token_ids[0] == IM_END_ID
    assert ENDOFTEXT_ID in tok.eos_token_ids  # an end-of-turn token llama.cpp also stops on
    assert tok.pad_token_id == IM_END_ID
    assert {ENDOFTEXT_ID, IM_START_ID, IM_END_ID} <= tok.special_token_ids
    assert tok.encode("<|im_start|>x", add_special_tokens=False)[0] == IM_START_ID


def test_smollm_pre_tokenizer_isolates_every_digit(tmp_path, seed):
    path, _ = write_tiny_gguf(tmp_path / "m.gguf", pre="smollm", seed=seed)
    tok = load_checkpoint(path, load_tensors=False).tokenizer
    digits = "".join(random.Random(seed).choice("0123456789") for _ in range(12))

    ids = tok.encode(f"year {digits}", add_special_tokens=False)

    assert [tok.decode([i]) for i in ids[-12:]] == list(digits)


def test_llama_bpe_pre_tokenizer_groups_digits_by_three(tmp_path, seed):
    path, _ = write_tiny_gguf(tmp_path / "m.gguf", pre="llama-bpe", seed=seed)
    backend = load_checkpoint(path, load_tensors=False).tokenizer.backend

    pieces = [p for p, _ in backend.pre_tokenizer.pre_tokenize_str("I'm at 1234567!")]

    assert pieces == ["I", "'m", "Ġat", "Ġ", "123", "456", "7", "!"]


SPM_PIECES = [
    "▁",
    "h",
    "e",
    "l",
    "o",
    "w",
    "r",
    "d",
    "a",
    "▁h",
    "he",
    "ll",
    "▁he",
    "llo",
    "▁hello",
    "▁w",
    "or",
    "▁wor",
    "ld",
    "▁world",
    "▁a",
    "lo",
]


@pytest.fixture(scope="module")
def spm_pair(tmp_path_factory):
    """(ours, transformers') for a tiny SentencePiece GGUF: unk, <s>, </s>, 256 byte tokens."""
    from transformers import AutoTokenizer

    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + SPM_PIECES
    scores = [0.0] * 259 + [-float(i) for i in range(len(SPM_PIECES))]
    token_types = [2, 3, 3] + [6] * 256 + [1] * len(SPM_PIECES)
    folder = tmp_path_factory.mktemp("spm")
    path = write_sentencepiece_gguf(folder / "spm.gguf", tokens, scores, token_types)
    ours = load_checkpoint(path, load_tensors=False).tokenizer
    return ours, AutoTokenizer.from_pretrained(folder, gguf_file=path.name)


def test_sentencepiece_gguf_encodes_like_transformers(spm_pair, seed):
    ours, theirs = spm_pair
    rng = random.Random(seed)
    words = ["hello", "world", "a", "held", "low", "h\u00e9llo", "w\u00f6rld", "\n", "  ", "<s>"]

    for _ in range(30):
        text = " ".join(rng.choice(words) for _ in range(rng.randrange(1, 6)))
        assert ours.encode(text) == theirs.encode(text), text


def test_sentencepiece_gguf_merges_whole_words_and_falls_back_to_bytes(spm_pair):
    ours, _ = spm_pair
    hello, world = ours.token_to_id("▁hello"), ours.token_to_id("▁world")

    assert ours.encode("hello world") == [1, hello, world]  # BOS by default for SentencePiece
    ids = ours.encode("\u00e9", add_special_tokens=False)
    assert ids[1:] == [ours.token_to_id("<0xC3>"), ours.token_to_id("<0xA9>")]
    assert ours.decode(ours.encode("h\u00e9llo w\u00f6rld")) == "h\u00e9llo w\u00f6rld"


def test_sentencepiece_gguf_add_bos_false_is_honoured(tmp_path):
    tokens = ["<unk>", "<s>", "</s>", "▁", "a", "▁a"]
    path = write_sentencepiece_gguf(
        tmp_path / "m.gguf", tokens, [0, 0, 0, -1, -2, -3], [2, 3, 3, 1, 1, 1], add_bos_token=False
    )

    tok = load_checkpoint(path, load_tensors=False).tokenizer

    assert tok.encode("a") == [5]


@pytest.mark.parametrize("pair", ["hf_pair", "spm_pair"])
def test_no_token_stands_for_more_text_than_max_token_bytes(request, pair, seed):
    ours, _ = request.getfixturevalue(pair)
    bound = ours.max_token_bytes
    for token_id in range(ours.vocab_size):
        assert len(ours.decode([token_id], skip_special_tokens=False).encode()) <= bound
    rng = random.Random(seed)
    for text in TEXTS + [random_text(rng, 400) for _ in range(50)]:
        ids = ours.encode(text, add_special_tokens=False)
        assert len(text.encode()) <= len(ids) * bound, text


def test_encoding_a_long_text_lets_other_threads_run(hf_pair):
    """The tokenizer must release the GIL: the daemon tokenizes long prompts on a worker thread
    while the event loop streams tokens. Holding it, the encode would be one gap as long as
    itself in this thread's turns; released, the gaps are the scheduler's."""
    ours, _ = hf_pair
    text = "the quick brown fox jumps over the lazy dog. " * 40_000  # 1.8 MB: long work
    span: list[float] = []
    done = threading.Event()

    def encode() -> None:
        span.append(time.perf_counter())
        ours.encode(text)
        span.append(time.perf_counter())
        done.set()

    worker = threading.Thread(target=encode)
    turns = [time.perf_counter()]
    worker.start()
    while not done.is_set():
        turns.append(time.perf_counter())
    worker.join()
    start, end = span
    during = [t for t in turns if start <= t <= end] or [end]
    longest_gap = max(b - a for a, b in zip([start, *during], [*during, end], strict=True))
    assert longest_gap < 0.5 * (end - start)
