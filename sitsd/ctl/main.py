"""`sitsctl`: global options, the command registry, and turning failures into exit statuses.

Each command group is a module with `register(commands)`, which adds its subparsers and sets
`run=fn(args, client) -> exit code` on them; `COMMANDS` lists the modules. The commands
themselves live in those modules. This is sitsctl's only reader of the environment.

Exit statuses: 0 success, 1 an error (one `sitsctl: error: ...` line on stderr), 2 bad usage,
130 interrupted (Ctrl-C).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping, Sequence

import grpc

from sitsd import __version__
from sitsd.ctl import bench, generate, health, models, status, versions
from sitsd.ctl.client import ADDRESS_ENV, DEFAULT_ADDRESS, TOKEN_ENV, Client, CtlError

COMMANDS = (
    generate,  # generate, chat
    status,  # status
    models,  # models, tokenize
    health,  # health
    bench,  # bench
    versions,  # manifest, deploy, swap, rollback, versions
)


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
    return value


def build_parser(environ: Mapping[str, str]) -> argparse.ArgumentParser:
    """The `sitsctl` parser with the global options and every registered command."""
    parser = argparse.ArgumentParser(prog="sitsctl", description="Talk to a sitsd daemon.")
    parser.add_argument("--version", action="version", version=f"sitsctl {__version__}")
    parser.add_argument(
        "--address",
        default=environ.get(ADDRESS_ENV) or DEFAULT_ADDRESS,
        metavar="HOST:PORT",
        help=f"the daemon's gRPC address (default: ${ADDRESS_ENV}, else {DEFAULT_ADDRESS})",
    )
    parser.add_argument(
        "--token-file",
        default="",
        metavar="PATH",
        help=f"file with the admin token (default: ${TOKEN_ENV}, else the daemon's "
        "<state dir>/admin-token)",
    )
    parser.add_argument(
        "--timeout",
        type=_positive_seconds,
        default=None,
        metavar="SECONDS",
        help="deadline of each call (default: none for generate/chat, 10 s for the others)",
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module in COMMANDS:
        module.register(commands)
    return parser


def main(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> int:
    """Entry point of the `sitsctl` console script; returns the exit status."""
    environ = os.environ if environ is None else environ
    args = build_parser(environ).parse_args(argv)
    client = Client(args, environ)
    try:
        return int(args.run(args, client))
    except CtlError as exc:
        _error(str(exc))
    except grpc.RpcError as exc:
        _error(client.describe(exc))
    except KeyboardInterrupt:
        print("sitsctl: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # The reader went away (`sitsctl generate ... | head`): not an error worth a traceback.
        # Point stdout at /dev/null so Python's final flush does not fail again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    finally:
        client.close()
    return 1


def _error(message: str) -> None:
    print(f"sitsctl: error: {message}", file=sys.stderr)
