"""`sitsctl bench --openai URL`: the same load sent to any OpenAI-compatible server.

`sitsctl bench` draws every request (tier, prompt length, output length, where in the corpus
the prompt starts) from one seeded `Plan`; with `--openai` the same draws go to
`URL/completions` through the official `openai` client, streamed, instead of to gRPC
`Generate`, and the report is the same (`sitsd.ctl.bench_report`). So sitsd and another engine
serving the same model are measured by one tool, on one workload.

Another server has its own tokenizer and may not take token ids, so a prompt is text: the
corpus's words from the drawn offset, `WORDS_PER_TOKEN` words for each drawn token (English
text runs about 1.3 tokens a word in the BPE vocabularies of current models). The report counts
the prompt and output tokens the server's own `usage` gives (`stream_options.include_usage`).
Each request is greedy with `ignore_eos` (an extra field that sitsd, vLLM, SGLang and llama.cpp
read), so outputs run to their drawn length. The tier goes in sitsd's `x-sitsd-tier` header and
`--deadline` in `x-sitsd-timeout-ms` as well as the client's timeout (other servers ignore the
headers). A failure is recorded under the gRPC status name the report counts (429 is
RESOURCE_EXHAUSTED, a refusal). Inter-token times are those between the stream's chunks, one
token each on sitsd and on vLLM.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from sitsd.ctl.bench_report import Draw, RequestRecord
from sitsd.ctl.client import CtlError

if TYPE_CHECKING:
    import openai

WORDS_PER_TOKEN = 1 / 1.3
TIER_HEADER = "x-sitsd-tier"
TIMEOUT_HEADER = "x-sitsd-timeout-ms"
# HTTP statuses under the gRPC names `sitsd.ctl.bench_report` counts; others are HTTP_<code>.
STATUS_NAMES = {
    400: "INVALID_ARGUMENT",
    401: "UNAUTHENTICATED",
    404: "NOT_FOUND",
    429: "RESOURCE_EXHAUSTED",
    499: "CANCELLED",
    500: "INTERNAL",
    503: "UNAVAILABLE",
    504: "DEADLINE_EXCEEDED",
}


def add_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("another OpenAI-compatible server")
    group.add_argument(
        "--openai",
        default="",
        metavar="URL",
        help="send the load to this OpenAI-compatible API (e.g. http://HOST:8000/v1) "
        "instead of the daemon's gRPC port",
    )
    group.add_argument(
        "--model",
        default="",
        metavar="NAME",
        help="the model to ask for with --openai (default: the first of GET /v1/models)",
    )
    group.add_argument(
        "--api-key-file",
        default="",
        metavar="PATH",
        help="file with the API key sent as 'Authorization: Bearer' with --openai",
    )


def words_of(text: str, min_words: int) -> list[str]:
    """The words of `text`, repeated until there are at least `min_words`."""
    words = text.split()
    while len(words) < min_words:
        words += words
    return words


def prompt_text(words: Sequence[str], start: int, num_tokens: int) -> str:
    """About `num_tokens` tokens of text: the words from `start`."""
    count = max(1, round(num_tokens * WORDS_PER_TOKEN))
    return " ".join(words[start : start + count])


def status_name(http_status: int) -> str:
    return STATUS_NAMES.get(http_status, f"HTTP_{http_status}")


class OpenAiTarget:
    """The official async client on `--openai` (`async with`), sending a plan's draws."""

    def __init__(self, args: argparse.Namespace, words: Sequence[str]) -> None:
        self._args = args
        self._words = words
        self._client: openai.AsyncOpenAI | None = None
        self.model = args.model

    async def __aenter__(self) -> OpenAiTarget:
        """Open the client and learn the model's name (the first listed unless `--model`).

        Raises:
            CtlError: no `openai` package, an unreadable key file, or no model served.
        """
        try:
            import openai
        except ImportError:
            needed = "--openai needs the openai package: pip install 'sitsd[bench]'"
            raise CtlError(needed) from None
        key = "none"
        if self._args.api_key_file:
            try:
                with open(self._args.api_key_file) as f:
                    key = f.read().strip()
            except OSError as exc:
                raise CtlError(f"--api-key-file: {exc}") from None
        self._client = openai.AsyncOpenAI(
            base_url=self._args.openai, api_key=key, max_retries=0, timeout=None
        )
        if not self.model:
            try:
                page = await self._client.models.list()
            except openai.APIError as exc:
                await self._client.close()
                raise CtlError(f"GET {self._args.openai}/models failed: {exc}") from None
            if not page.data:
                await self._client.close()
                raise CtlError(f"{self._args.openai}/models lists no model; pass --model")
            self.model = page.data[0].id
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        if self._client is not None:
            await self._client.close()

    async def send(self, draw: Draw, t0: float) -> RequestRecord:
        """Send one streamed completion for `draw` and time its chunks."""
        import openai

        assert self._client is not None, "used outside `async with`"
        deadline = self._args.deadline
        headers = {TIER_HEADER: draw.tier}
        if deadline is not None:
            headers[TIMEOUT_HEADER] = str(round(deadline * 1e3))
        record = RequestRecord(
            draw.tier, draw.num_prompt_tokens, draw.max_tokens, time.perf_counter() - t0
        )
        usage = None
        try:
            stream = await self._client.completions.create(
                model=self.model, max_tokens=draw.max_tokens, temperature=0.0,
                prompt=prompt_text(self._words, draw.start, draw.num_prompt_tokens),
                stream=True, stream_options={"include_usage": True},
                extra_body={"ignore_eos": True}, extra_headers=headers, timeout=deadline,
            )  # fmt: skip
            async for chunk in stream:
                now = time.perf_counter() - t0
                if chunk.choices and chunk.choices[0].text:
                    if record.first_token_at is None:
                        record.first_token_at = now
                    record.token_times.append(now)
                if chunk.usage is not None:
                    usage = chunk.usage
            record.status = "OK"
        except openai.APIStatusError as exc:
            record.status = status_name(exc.status_code)
        except openai.APITimeoutError:
            record.status = "DEADLINE_EXCEEDED"
        except openai.APIConnectionError:
            record.status = "UNAVAILABLE"
        except openai.APIError:  # an error event mid-stream
            record.status = "INTERNAL"
        record.ended_at = time.perf_counter() - t0
        record.num_output_tokens = len(record.token_times)
        if usage is not None:
            record.num_prompt_tokens = usage.prompt_tokens
            record.num_output_tokens = usage.completion_tokens
        return record
