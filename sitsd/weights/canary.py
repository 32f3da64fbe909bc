"""The canary gate: on fixed prompts, a new version's logits must stay close to the active one's.

`--canary-file FILE` holds prompts, one per line, or JSON lines `{"prompt": "..."}` or
`{"token_ids": [...]}` (cut to `canary_max_tokens`). Before a staged version may commit, each
prompt runs on the active slot and on the standby slot as low-priority work inside the
engine's normal steps, next to the requests they serve (`SwapPort.prompt_logprobs`: the
scheduler fits its chunks into what a step's swap allowance leaves, so the batch never pauses
for it). Per prompt: the mean over its positions of KL(active || new) of the next-token
distributions, and each version's perplexity on the prompt's own tokens. The version is
rejected when the mean KL over the prompts exceeds `--canary-max-kl` (nats), with the measured
values in the reason.

When to run it is `sitsd.weights.staging`'s business.
"""

from __future__ import annotations

import contextlib
import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from sitsd.types import TokenizerLike


class CanaryFileError(ValueError):
    """The canary file cannot be used; the message says where and why."""


def read_canary_prompts(
    path: str | Path, tokenizer: TokenizerLike, max_tokens: int
) -> list[list[int]]:
    """Token ids of every prompt in the canary file (each at least 2 tokens, cut to `max_tokens`).

    Raises:
        CanaryFileError: unreadable, empty, or a line that is neither text nor a JSON prompt.
    """
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise CanaryFileError(f"cannot read the canary file {path}: {exc}") from exc
    prompts = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        ids = _prompt_ids(line, tokenizer)
        if ids is None or len(ids) < 2:
            raise CanaryFileError(f"{path}:{number}: a canary prompt needs at least 2 tokens")
        prompts.append(ids[:max_tokens])
    if not prompts:
        raise CanaryFileError(f"the canary file {path} holds no prompt")
    return prompts


def _prompt_ids(line: str, tokenizer: TokenizerLike) -> list[int] | None:
    text = line.strip()
    if text.startswith("{"):
        try:
            entry = json.loads(text)
        except json.JSONDecodeError:
            entry = None
        if isinstance(entry, dict):
            if isinstance(entry.get("token_ids"), list):
                return [int(t) for t in entry["token_ids"]]
            if isinstance(entry.get("prompt"), str):
                return list(tokenizer.encode(entry["prompt"], add_special_tokens=True))
            return None
    return list(tokenizer.encode(line, add_special_tokens=True))


@dataclass(frozen=True)
class CanaryScore:
    """One prompt under both versions."""

    kl: float  # mean KL(active || new) per position, nats
    nll_active: float  # mean negative log-likelihood of the prompt's tokens, active version
    nll_new: float  # the same under the new version
    num_tokens: int


@dataclass(frozen=True)
class CanaryResult:
    """Every prompt's score, and the verdict."""

    scores: tuple[CanaryScore, ...]
    max_kl: float  # the bound

    @property
    def mean_kl(self) -> float:
        return sum(s.kl for s in self.scores) / len(self.scores)

    @property
    def ppl_ratio(self) -> float:
        """Perplexity of the new version over the active one's, on the prompts' tokens."""
        n = sum(s.num_tokens - 1 for s in self.scores)
        delta = sum((s.nll_new - s.nll_active) * (s.num_tokens - 1) for s in self.scores)
        return math.exp(delta / max(n, 1))

    @property
    def passed(self) -> bool:
        return math.isfinite(self.mean_kl) and self.mean_kl <= self.max_kl

    def describe(self) -> str:
        return (
            f"canary: mean KL {self.mean_kl:.4f} nats (bound {self.max_kl:g}), perplexity "
            f"ratio {self.ppl_ratio:.3f} over {len(self.scores)} prompts"
        )


@torch.inference_mode()
def warm_compare(device: torch.device, vocab_size: int) -> CanaryScore:
    """Run `compare` once, on uniform log-probabilities of a two-token prompt, so that its
    kernels' modules are loaded before the first canary (CUDA loads a kernel's module at its
    first launch, holding a lock the engine's launches wait on). The score: KL 0, each
    version's NLL log(vocab_size)."""
    logprobs = torch.full((2, vocab_size), -math.log(vocab_size), device=device)
    return compare(logprobs, logprobs, [0, 0])


def compare(active: torch.Tensor, new: torch.Tensor, prompt: list[int]) -> CanaryScore:
    """One prompt's score from its log-probabilities under both versions ([n, vocab] each).

    On a GPU it runs on a side stream of its own, ordered after what the engine has queued.
    On the engine's stream (the default one, which a thread uses unless told otherwise) its
    upload of the prompt's ids, a synchronous copy from pageable memory, waited for every step
    queued ahead of it, and the engine's next launch into that stream could wait behind it:
    the suspect for the 20-23 ms step an H100 had in each swap's canary with nothing of the
    canary in it and all of its host time in the launch (not measured since)."""
    n = len(prompt)
    side = torch.cuda.Stream(active.device) if active.device.type == "cuda" else None
    with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
        targets = torch.tensor(prompt[1:], device=active.device).unsqueeze(-1)  # [n - 1, 1]
        if side is not None:  # the log-probabilities come from the engine's stream
            side.wait_stream(torch.cuda.default_stream(active.device))
            active.record_stream(side)
            new.record_stream(side)
        kl = (active.exp() * (active - new)).sum(-1).mean()
        nll_active = -active[: n - 1].gather(-1, targets).mean()
        nll_new = -new[: n - 1].gather(-1, targets).mean()
        # One host sync per canary prompt, on a staging thread (never the engine's or the loop's).
        values = torch.stack([kl, nll_active, nll_new]).tolist()
    return CanaryScore(values[0], values[1], values[2], n)
