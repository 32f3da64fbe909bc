"""The serving tokenizer: text <-> ids, special tokens, chat templates; built on `tokenizers`.

`Tokenizer` wraps a `tokenizers.Tokenizer` with what serving needs to know about the model: which
ids end generation, whether a prompt starts with BOS, and how to render a chat. It never relies on
a `tokenizer.json` post-processor: BOS/EOS are added here, from `add_bos_token`/`add_eos_token`,
so HF directories and GGUF files behave the same.

`backend_from_gguf_vocab` rebuilds a `tokenizers.Tokenizer` from the vocabulary a GGUF file stores
in its metadata (byte-level BPE, or SentencePiece-style BPE with byte fallback).

Reading checkpoint files is left to the loaders (`hf.py`, `gguf_file.py`); incremental
detokenization of a stream is left to the engine's detokenizer.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers

from sitsd.weights.chat_template import ChatTemplate, ChatTemplateError

logger = logging.getLogger(__name__)

# Special tokens that end a turn in common chat formats. llama.cpp treats every one of these that
# the vocabulary marks as special as end-of-generation, even when the file names another EOS.
END_OF_TURN_TOKENS = frozenset(
    {
        "<|eot_id|>",
        "<|eom_id|>",
        "<|im_end|>",
        "<|end|>",
        "<end_of_turn>",
        "<|endoftext|>",
        "<|end_of_text|>",
        "<EOT>",
        "<|return|>",
    }
)


class Tokenizer:
    """Text <-> token ids for one model, with its special tokens and chat template.

    Args:
        backend: The `tokenizers.Tokenizer` doing the work (its post-processor is ignored).
        vocab_size: Rows of the model's embedding; at least the backend's largest id + 1.
        bos_token_id: Beginning-of-sequence id, or None.
        eos_token_ids: Every id that ends generation, the primary EOS first.
        pad_token_id: Padding id, or None.
        add_bos_token: Whether `encode(add_special_tokens=True)` prepends BOS.
        add_eos_token: Whether `encode(add_special_tokens=True)` appends the primary EOS.
        chat_template: Jinja2 source of the chat template, or None.
        unk_token_id: Unknown-token id, or None.
        source_digest: What it was built from, when that is files (`sitsd.weights.hf`'s
            `tokenizer_digest`); "" otherwise. Equal digests build equal tokenizers.

    Raises:
        ValueError: The backend has ids the model's embedding does not cover.
    """

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        vocab_size: int,
        bos_token_id: int | None,
        eos_token_ids: Sequence[int],
        pad_token_id: int | None = None,
        add_bos_token: bool = False,
        add_eos_token: bool = False,
        chat_template: str | None = None,
        unk_token_id: int | None = None,
        source_digest: str = "",
    ):
        self._backend = backend
        self.source_digest = source_digest
        self._id_limit = max(backend.get_vocab(with_added_tokens=True).values(), default=-1) + 1
        if vocab_size < self._id_limit:
            raise ValueError(
                f"the tokenizer has ids up to {self._id_limit - 1} but the model's embedding has "
                f"only {vocab_size} rows; tokenizer and weights do not belong together"
            )
        self.vocab_size = vocab_size
        self.bos_token_id = bos_token_id
        self.eos_token_ids = tuple(dict.fromkeys(eos_token_ids))
        self.pad_token_id = pad_token_id
        self.unk_token_id = unk_token_id
        self.add_bos_token = add_bos_token and bos_token_id is not None
        self.add_eos_token = add_eos_token and bool(self.eos_token_ids)
        added = backend.get_added_tokens_decoder()
        named = (bos_token_id, pad_token_id, unk_token_id, *self.eos_token_ids)
        self.special_token_ids = frozenset(
            [i for i, tok in added.items() if tok.special] + [i for i in named if i is not None]
        )
        eos_id = self.eos_token_ids[0] if self.eos_token_ids else None
        self._chat_template = None
        if chat_template:
            self._chat_template = ChatTemplate(
                chat_template,
                {
                    "bos_token": self.id_to_token(bos_token_id),
                    "eos_token": self.id_to_token(eos_id),
                    "unk_token": self.id_to_token(unk_token_id),
                    "pad_token": self.id_to_token(pad_token_id),
                },
            )

    @property
    def backend(self) -> tokenizers.Tokenizer:
        """The underlying `tokenizers.Tokenizer` (treat as read-only)."""
        return self._backend

    @property
    def has_chat_template(self) -> bool:
        """Whether the checkpoint shipped a chat template."""
        return self._chat_template is not None

    @property
    def chat_template(self) -> str | None:
        """Jinja2 source of the chat template, or None."""
        return self._chat_template.source if self._chat_template else None

    @functools.cached_property
    def max_token_bytes(self) -> int:
        """UTF-8 bytes of the longest vocabulary entry: no token stands for more text.

        An upper bound (byte-level BPE spells a byte with a character of one or two bytes,
        SentencePiece a space with three), which is what a refusal of too long a text needs.
        """
        vocab = self._backend.get_vocab(with_added_tokens=True)
        return max((len(token.encode()) for token in vocab), default=1)

    def id_to_token(self, token_id: int | None) -> str | None:
        """The token string for `token_id`, or None if there is none."""
        return None if token_id is None else self._backend.id_to_token(token_id)

    def token_to_id(self, token: str) -> int | None:
        """The id of the token spelled `token`, or None if it is not in the vocabulary."""
        return self._backend.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`.

        Special tokens written in the text (e.g. `<|im_start|>`) become their ids either way;
        `add_special_tokens` only controls the BOS/EOS this model adds around a sequence.
        """
        # encode_batch, not encode: `tokenizers` releases the GIL only there, so a long text
        # tokenized on a worker thread does not stop the event loop (or the engine) meanwhile.
        ids: list[int] = self._backend.encode_batch([text], add_special_tokens=False)[0].ids
        if add_special_tokens:
            if self.add_bos_token:
                ids.insert(0, self.bos_token_id)  # type: ignore[arg-type]
            if self.add_eos_token:
                ids.append(self.eos_token_ids[0])
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`.

        Ids past the tokenizer's vocabulary (padding rows of the embedding) decode to nothing.
        """
        kept = [i for i in ids if 0 <= i < self._id_limit]
        return self._backend.decode(kept, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        messages: list[dict[str, object]],
        add_generation_prompt: bool = True,
        **extra: object,
    ) -> str:
        """Render a conversation into prompt text (encode it with `add_special_tokens=False`).

        `extra` holds more template variables (`tools`, a template's own switches).

        Raises:
            ChatTemplateError: No chat template, or the template rejected the messages.
        """
        if self._chat_template is None:
            raise ChatTemplateError(
                "this model has no chat template; send a plain prompt instead of messages"
            )
        return self._chat_template.render(
            messages, add_generation_prompt=add_generation_prompt, **extra
        )


def end_of_generation_ids(
    backend: tokenizers.Tokenizer, declared_ids: Iterable[int | None]
) -> tuple[int, ...]:
    """`declared_ids` (primary EOS first), then every special end-of-turn token in the vocab."""
    ids = [i for i in declared_ids if i is not None]
    for token_id, token in sorted(backend.get_added_tokens_decoder().items()):
        if token.special and token.content in END_OF_TURN_TOKENS:
            ids.append(token_id)
    return tuple(dict.fromkeys(ids))


# --- GGUF vocabularies ---------------------------------------------------------------------------

# Token types as llama.cpp writes them in `tokenizer.ggml.token_type`.
TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED, TOKEN_BYTE = range(
    1, 7
)

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# `tokenizer.ggml.pre` values llama.cpp maps to the Llama-3 split (and to ignore_merges).
_LLAMA3_PRE = frozenset(
    {
        "llama3",
        "llama-v3",
        "llama-bpe",
        "falcon3",
        "falcon-h1",
        "pixtral",
        "midm-2.0",
        "lfm2",
    }
)
_QWEN2_PRE = frozenset({"qwen2", "deepseek-r1-qwen"})
_GPT2_PRE = frozenset({"gpt2", "gpt-2", "default", ""})


@dataclass(frozen=True)
class GgufVocab:
    """The tokenizer a GGUF file describes in its `tokenizer.ggml.*` metadata."""

    model: str  # tokenizer.ggml.model: "gpt2" (byte-level BPE) or "llama" (SentencePiece)
    pre: str  # tokenizer.ggml.pre: which split regex the merges were learned with
    tokens: list[str]
    token_types: list[int]  # TOKEN_* per token; empty = all normal
    merges: list[str]  # "left right" per merge, best first; empty for SentencePiece
    scores: list[float]  # SentencePiece piece scores; empty for BPE
    unk_token_id: int | None = None
    add_space_prefix: bool = True  # SentencePiece: prepend "▁" to the text


def backend_from_gguf_vocab(vocab: GgufVocab) -> tokenizers.Tokenizer:
    """Build the `tokenizers.Tokenizer` a GGUF vocabulary describes.

    Raises:
        ValueError: The tokenizer model is not one this function knows.
    """
    if vocab.model == "gpt2":
        backend = _byte_level_bpe(vocab)
    elif vocab.model == "llama":
        backend = _sentencepiece_bpe(vocab)
    else:
        raise ValueError(
            f"GGUF tokenizer model {vocab.model!r} is not supported (supported: 'gpt2' byte-level "
            "BPE, 'llama' SentencePiece)"
        )
    types = vocab.token_types or [TOKEN_NORMAL] * len(vocab.tokens)
    special = [
        AddedToken(tok, special=True, normalized=False)
        for tok, kind in zip(vocab.tokens, types)
        if kind == TOKEN_CONTROL
    ]
    # User-defined tokens (e.g. `<think>`) are matched whole, but are not special.
    user = [
        AddedToken(tok, special=False, normalized=False)
        for tok, kind in zip(vocab.tokens, types)
        if kind == TOKEN_USER_DEFINED
    ]
    backend.add_special_tokens(special)
    backend.add_tokens(user)
    return backend


def _byte_level_bpe(vocab: GgufVocab) -> tokenizers.Tokenizer:
    token_ids = {tok: i for i, tok in enumerate(vocab.tokens)}
    merges = [_merge_pair(m) for m in vocab.merges]
    backend = tokenizers.Tokenizer(
        models.BPE(token_ids, merges, ignore_merges=vocab.pre in _LLAMA3_PRE)
    )
    backend.pre_tokenizer = _byte_level_pre_tokenizer(vocab.pre)
    backend.decoder = decoders.ByteLevel()
    return backend


def _byte_level_pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    if pre == "smollm":
        # llama.cpp's SMOLLM type: every digit on its own, then the GPT-2 split.
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(r"\p{N}"), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    split = _LLAMA3_SPLIT if pre in _LLAMA3_PRE else _QWEN2_SPLIT if pre in _QWEN2_PRE else None
    if split is not None:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    if pre not in _GPT2_PRE:
        logger.warning("unknown GGUF pre-tokenizer %r; splitting text like GPT-2", pre)
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _sentencepiece_bpe(vocab: GgufVocab) -> tokenizers.Tokenizer:
    token_ids = {tok: i for i, tok in enumerate(vocab.tokens)}
    unk = vocab.tokens[vocab.unk_token_id] if vocab.unk_token_id is not None else None
    backend = tokenizers.Tokenizer(
        models.BPE(
            token_ids,
            _merges_from_scores(vocab),
            unk_token=unk,
            fuse_unk=True,
            byte_fallback=True,
        )
    )
    prepend = "first" if vocab.add_space_prefix else "never"
    backend.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="▁", prepend_scheme=prepend, split=False
    )
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if vocab.add_space_prefix:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    backend.decoder = decoders.Sequence(steps)
    return backend


def _merges_from_scores(vocab: GgufVocab) -> list[tuple[str, str]]:
    """BPE merges implied by a SentencePiece vocabulary, best first.

    Every normal piece that splits into two pieces of the vocabulary yields a merge ranked by
    the piece's score (higher merges first) -- the rule SentencePiece's BPE applies, and the
    order `transformers` derives for GGUF files.
    """
    types = vocab.token_types or [TOKEN_NORMAL] * len(vocab.tokens)
    piece_ids = {
        tok: i for i, (tok, kind) in enumerate(zip(vocab.tokens, types)) if kind == TOKEN_NORMAL
    }
    scored: list[tuple[str, str, float]] = []
    for piece, piece_id in piece_ids.items():
        splits = [
            (piece[:k], piece[k:])
            for k in range(1, len(piece))
            if piece[:k] in piece_ids and piece[k:] in piece_ids
        ]
        splits.sort(key=lambda lr: (piece_ids[lr[0]], piece_ids[lr[1]]))
        scored.extend((left, right, vocab.scores[piece_id]) for left, right in splits)
    scored.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in scored]


def _merge_pair(merge: str) -> tuple[str, str]:
    """A GGUF merge rule, "left right", as the pair `tokenizers.models.BPE` takes."""
    left, right = merge.split(" ", 1)
    return left, right
