"""`sitsctl generate PROMPT` and `sitsctl chat MESSAGE`: stream a completion to stdout.

stdout gets the completion's text as it arrives and nothing else (plus a final newline when the
text has none), so it can be piped; `--verbose` reports request id, weights version, time to
first token, throughput, usage and finish reason on stderr. Ctrl-C cancels the call, which
aborts the request in the daemon.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import TextIO

from sitsd.api.v1 import inference_pb2 as pb
from sitsd.ctl.client import Client

TIERS = {"gold": pb.TIER_GOLD, "silver": pb.TIER_SILVER, "bronze": pb.TIER_BRONZE}


def register(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    generate = commands.add_parser(
        "generate",
        help="stream the completion of a prompt",
        description="Stream the completion of PROMPT to stdout.",
    )
    generate.add_argument("prompt", metavar="PROMPT", help="the prompt text, sent as is")
    _add_sampling_flags(generate)
    generate.set_defaults(run=run_generate)

    chat = commands.add_parser(
        "chat",
        help="stream the model's reply to a message (chat template)",
        description="Stream the model's reply to MESSAGE, rendered with its chat template.",
    )
    chat.add_argument("message", metavar="MESSAGE", help="the user's message")
    chat.add_argument(
        "--system",
        default=None,
        metavar="TEXT",
        help="a system message before it (default: the template's own, if any)",
    )
    _add_sampling_flags(chat)
    chat.set_defaults(run=run_chat)


def _unsigned(text: str) -> int:
    # The proto fields are unsigned: a negative value could not even be sent.
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _add_sampling_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        default="",
        metavar="NAME",
        help="the model to run (default: the one the daemon serves)",
    )
    parser.add_argument(
        "--max-tokens",
        type=_unsigned,
        default=None,
        metavar="N",
        help="tokens to generate at most (default: the daemon's default)",
    )
    parser.add_argument(
        "--temperature", type=float, default=None, metavar="T", help="0 = greedy (default: 1.0)"
    )
    parser.add_argument(
        "--top-p",
        type=float,
        default=None,
        metavar="P",
        help="nucleus sampling threshold in (0, 1] (default: 1.0, off)",
    )
    parser.add_argument(
        "--top-k",
        type=_unsigned,
        default=None,
        metavar="K",
        help="sample among the K most likely tokens (default: 0, off)",
    )
    parser.add_argument(
        "--seed",
        type=_unsigned,
        default=None,
        metavar="S",
        help="seed for reproducible sampling (default: chosen by the daemon)",
    )
    parser.add_argument(
        "--stop",
        action="append",
        default=[],
        metavar="TEXT",
        help="stop at this text; repeatable (default: none)",
    )
    parser.add_argument(
        "--ignore-eos",
        action="store_true",
        help="keep going past end-of-sequence tokens (default: stop there)",
    )
    parser.add_argument(
        "--tier", choices=sorted(TIERS), default=None, help="SLA tier (default: the daemon's)"
    )
    parser.add_argument(
        "--verbose",
        "-v",
        action="store_true",
        help="report request id, timings and usage on stderr",
    )


def build_request(args: argparse.Namespace, **prompt: object) -> pb.GenerateRequest:
    """A `GenerateRequest` from the sampling flags, with `prompt` as its prompt oneof."""
    sampling = pb.SamplingParams()
    for field in ("max_tokens", "temperature", "top_p", "top_k", "seed"):
        value = getattr(args, field)
        if value is not None:
            # Out-of-range values go to the daemon as they are: it names the field it refuses.
            setattr(sampling, field, value)
    return pb.GenerateRequest(
        model=args.model,
        sampling=sampling,
        stop=args.stop,
        ignore_eos=args.ignore_eos,
        tier=TIERS[args.tier] if args.tier else pb.TIER_UNSPECIFIED,
        **prompt,  # type: ignore[arg-type]
    )


def run_generate(args: argparse.Namespace, client: Client) -> int:
    return stream_completion(client, build_request(args, text=args.prompt), verbose=args.verbose)


def run_chat(args: argparse.Namespace, client: Client) -> int:
    messages = [pb.ChatMessage(role="system", content=args.system)] if args.system else []
    messages.append(pb.ChatMessage(role="user", content=args.message))
    request = build_request(args, chat=pb.ChatMessages(messages=messages))
    return stream_completion(client, request, verbose=args.verbose)


def stream_completion(
    client: Client,
    request: pb.GenerateRequest,
    *,
    verbose: bool,
    out: TextIO | None = None,
    err: TextIO | None = None,
) -> int:
    """Print the completion's text to `out` as it streams in; stats to `err` if `verbose`."""
    out = out or sys.stdout
    err = err or sys.stderr
    started = time.monotonic()
    first_token_at: float | None = None
    last: pb.GenerateResponse | None = None
    text_ends_line = True  # nothing written yet: no newline owed
    call = client.inference.Generate(request, timeout=client.timeout)
    try:
        for response in call:
            if first_token_at is None and response.token_ids:
                first_token_at = time.monotonic()
            if response.text:
                out.write(response.text)
                out.flush()
                text_ends_line = response.text.endswith("\n")
            last = response
    except BaseException:  # Ctrl-C, a closed stdout pipe, ...
        call.cancel()  # the daemon aborts the request and frees its KV cache
        raise
    finally:
        if not text_ends_line:
            out.write("\n")
            out.flush()
    if verbose and last is not None:
        _report(err, last, time.monotonic() - started, first_token_at, started)
    return 0


def _report(
    err: TextIO,
    last: pb.GenerateResponse,
    elapsed: float,
    first_token_at: float | None,
    started: float,
) -> None:
    usage = last.usage
    finish_reason = pb.FinishReason.Name(last.finish_reason).removeprefix("FINISH_REASON_")
    lines = [
        f"request_id: {last.request_id}",
        f"model: {last.model}  weights: {last.weights_version}",
        f"finish_reason: {finish_reason.lower()}",
        f"usage: prompt {usage.prompt_tokens}, completion {usage.completion_tokens}, "
        f"cached {usage.cached_tokens} tokens",
    ]
    if first_token_at is not None:
        ttft = first_token_at - started
        decode_s = started + elapsed - first_token_at
        # Throughput after the first token: the prefill is in TTFT already.
        rate = (usage.completion_tokens - 1) / decode_s if decode_s > 0 else 0.0
        lines.append(
            f"ttft: {ttft * 1e3:.0f} ms  total: {elapsed:.2f} s  decode: {rate:.1f} tokens/s"
        )
    err.write("".join(f"{line}\n" for line in lines))
    err.flush()
