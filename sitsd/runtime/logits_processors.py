"""What happens to a step's logits between the model and the sampler, and the logprobs.

`LogitsProcessors.apply` changes the rows of the requests that ask for it, on the device:

    logit_bias          logits[t] += bias[t]
    repetition_penalty  a token seen in the prompt or the output: logit / p if > 0, else * p
    frequency_penalty   logits[t] -= f * (times t was output)
    presence_penalty    logits[t] -= p * (t was output at all)
    grammar             tokens the request's grammar does not allow next: -inf (`grammar`)

(vLLM's and OpenAI's definitions.) Token counts are built from the host's token lists in one
pinned copy; each row's last token is read from the step's input ids on the device, because
with asynchronous scheduling the host may not know it yet. Rows that ask for nothing are not
touched, and a batch where none asks costs nothing.

`SampledLogprobs` is the log-softmax of the model's own logits (before any of the above) at
the sampled tokens plus the top alternatives, computed on the device and copied to pinned host
memory with the sampled ids, so reading them adds no host sync. Sampling is `sampler`'s.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from sitsd.runtime.grammar import GrammarCompiler, GrammarMasks
from sitsd.runtime.input_batch import CachedRequestState
from sitsd.types import TokenLogprob


class LogitsProcessors:
    """Bias, penalties and grammar masks for one runner's batches."""

    def __init__(
        self, max_rows: int, device: torch.device, grammars: GrammarCompiler | None = None
    ) -> None:
        self.device = device
        self.grammars = grammars
        self._masks: GrammarMasks | None = None
        self._max_rows = max_rows

    def apply(
        self,
        logits: torch.Tensor,  # [num_rows, vocab] float32, changed in place
        rows: Sequence[CachedRequestState],  # the request of each row
        last_tokens: torch.Tensor,  # [num_rows] int64: each row's last token, on the device
        awaiting: frozenset[str] = frozenset(),  # rows whose last token the host lacks
    ) -> None:
        biased = [i for i, s in enumerate(rows) if s.params.logit_bias]
        if biased:
            self._bias(logits, [rows[i] for i in biased], biased)
        penalized = [i for i, s in enumerate(rows) if s.params.penalized]
        if penalized:
            self._penalize(logits, [rows[i] for i in penalized], penalized, last_tokens)
        constrained = [i for i, s in enumerate(rows) if s.params.grammar is not None]
        if constrained:
            self._mask(logits, rows, constrained, last_tokens, awaiting)

    def _bias(self, logits: torch.Tensor, rows: list[CachedRequestState], index: list[int]) -> None:
        row_ids, token_ids, values = [], [], []
        for i, state in zip(index, rows):
            for token_id, bias in state.params.logit_bias:
                row_ids.append(i)
                token_ids.append(token_id)
                values.append(bias)
        where = (_to_device(row_ids, self.device), _to_device(token_ids, self.device))
        logits.index_put_(where, _to_device(values, self.device, torch.float32), accumulate=True)

    def _penalize(
        self,
        logits: torch.Tensor,
        rows: list[CachedRequestState],
        index: list[int],
        last_tokens: torch.Tensor,
    ) -> None:
        n, vocab, device = len(rows), logits.shape[1], self.device
        # Every known token but the last (the device has that one), as (row, token) pairs.
        out_rows, out_ids, seen_rows, seen_ids = [], [], [], []
        for r, state in enumerate(rows):
            known = state.token_ids[:-1]
            outputs = known[state.num_prompt_tokens :]
            out_rows += [r] * len(outputs)
            out_ids += outputs
            if state.params.repetition_penalty != 1.0:
                seen_rows += [r] * len(known)
                seen_ids += known
        last = last_tokens.index_select(0, _to_device(index, device))  # [n]
        last_is_output = _to_device([s.num_output_tokens > 0 for s in rows], device, torch.bool)
        counts = torch.zeros(n, vocab, dtype=torch.float32, device=device)
        if out_ids:
            where = (_to_device(out_rows, device), _to_device(out_ids, device))
            counts.index_put_(where, torch.ones(len(out_ids), device=device), accumulate=True)
        arange = torch.arange(n, device=device)
        counts.index_put_((arange, last), last_is_output.float(), accumulate=True)
        x = logits.index_select(0, _to_device(index, device))  # [n, vocab]
        rep = _to_device([s.params.repetition_penalty for s in rows], device, torch.float32)
        if seen_ids:
            seen = counts > 0
            if seen_ids:
                seen[_to_device(seen_rows, device), _to_device(seen_ids, device)] = True
            seen[arange, last] = True
            seen &= (rep != 1.0)[:, None]
            penalized = torch.where(x > 0, x / rep[:, None], x * rep[:, None])
            x = torch.where(seen, penalized, x)
        freq = _to_device([s.params.frequency_penalty for s in rows], device, torch.float32)
        pres = _to_device([s.params.presence_penalty for s in rows], device, torch.float32)
        x = x - freq[:, None] * counts - pres[:, None] * (counts > 0).float()
        logits.index_copy_(0, _to_device(index, device), x)

    def _mask(
        self,
        logits: torch.Tensor,
        rows: Sequence[CachedRequestState],
        index: list[int],
        last_tokens: torch.Tensor,
        awaiting: frozenset[str],
    ) -> None:
        if self.grammars is None:
            raise RuntimeError("a constrained request reached a runner without grammars")
        if self._masks is None:
            self._masks = GrammarMasks(logits.shape[1], self._max_rows, self.device)
        states = []
        for i in index:
            state = rows[i]
            if state.grammar is None:  # new, or resumed after a preemption
                assert state.params.grammar is not None
                state.grammar = self.grammars.matcher(state.params.grammar)
            outputs = state.token_ids[state.num_prompt_tokens :]
            if state.req_id in awaiting and outputs:
                # Its last token is still on the device (asynchronous scheduling): the one
                # host sync a constrained request adds, since the mask depends on it.
                outputs = [*outputs[:-1], int(last_tokens[i].item())]
            state.grammar.advance(outputs)
            states.append(state.grammar)
        self._masks.apply(logits, index, states)


class SampledLogprobs:
    """Logprobs of one sub-batch's sampled tokens, on the device, then on the host."""

    def __init__(
        self,
        raw_logits: torch.Tensor,  # [num_rows, vocab] the model's logits, before processing
        rows: Sequence[CachedRequestState],
    ) -> None:
        self.num_rows = len(rows)
        self.row_index = [i for i, s in enumerate(rows) if s.params.logprobs is not None]
        self.num_top = [rows[i].params.logprobs or 0 for i in self.row_index]
        k = max(self.num_top, default=0)
        index = _to_device(self.row_index, raw_logits.device)
        self._logprobs = torch.log_softmax(raw_logits.index_select(0, index), dim=-1)
        self.top = self._logprobs.topk(k, dim=-1) if k else None
        self.chosen: torch.Tensor | None = None
        self._host: list[torch.Tensor] = []

    @classmethod
    def wanted(cls, rows: Sequence[CachedRequestState]) -> bool:
        return any(s.params.logprobs is not None for s in rows)

    def record(self, tokens: torch.Tensor) -> None:
        """Gather the chosen tokens' logprobs (tokens: [num_rows] of the whole sub-batch)."""
        index = _to_device(self.row_index, tokens.device)
        chosen_ids = tokens.index_select(0, index)
        self.chosen = self._logprobs.gather(1, chosen_ids[:, None])[:, 0]
        del self._logprobs  # [rows, vocab]: not needed past this point

    def to_host(self) -> None:
        """Queue the copies to pinned host memory (before the step's ready event)."""
        assert self.chosen is not None
        tensors = [self.chosen]
        if self.top is not None:
            tensors += [self.top.values, self.top.indices]
        pin = self.chosen.device.type == "cuda"
        for t in tensors:
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=pin)
            host.copy_(t, non_blocking=pin)
            self._host.append(host)

    def entries(self, token_ids: Sequence[int]) -> dict[int, TokenLogprob]:
        """Row -> its `TokenLogprob` (after the step's sync); `token_ids` of the sub-batch."""
        chosen = self._host[0].tolist()
        values = self._host[1].tolist() if self.top is not None else None
        ids = self._host[2].tolist() if self.top is not None else None
        out = {}
        for j, (row, k) in enumerate(zip(self.row_index, self.num_top)):
            top = (
                ()
                if not k or ids is None or values is None
                else tuple(zip(ids[j][:k], values[j][:k]))
            )
            out[row] = TokenLogprob(token_ids[row], chosen[j], top)
        return out


def _to_device(
    values: Sequence[float], device: torch.device, dtype: torch.dtype = torch.int64
) -> torch.Tensor:
    """A small host list on the device without a host sync (pinned source, async copy)."""
    t = torch.tensor(values, dtype=dtype)
    return t if device.type == "cpu" else t.pin_memory().to(device, non_blocking=True)
