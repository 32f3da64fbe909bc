"""`sitsctl models` (Inference.ListModels) and `sitsctl tokenize TEXT` (Inference.Tokenize)."""

from __future__ import annotations

import argparse
import json

from sitsd.api.v1 import inference_pb2 as pb
from sitsd.ctl.client import Client, to_json

_COLUMNS = ("name", "max_model_len", "vocab_size", "architecture", "dtype", "device")


def register(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    models = commands.add_parser(
        "models", help="list the served models", description="List the models the daemon serves."
    )
    models.add_argument("--json", action="store_true", help="print the response as JSON")
    models.set_defaults(run=run_models)

    tokenize = commands.add_parser(
        "tokenize",
        help="print the token ids of a text",
        description="Print the token ids the daemon's model gives TEXT, space-separated.",
    )
    tokenize.add_argument("text", metavar="TEXT")
    tokenize.add_argument(
        "--json", action="store_true", help='print {"token_ids": [...], "num_tokens": N}'
    )
    tokenize.set_defaults(run=run_tokenize)


def run_models(args: argparse.Namespace, client: Client) -> int:
    response = client.inference.ListModels(pb.ListModelsRequest(), timeout=client.unary_timeout)
    if args.json:
        print(to_json(response))
        return 0
    rows = [[c.upper() for c in _COLUMNS]]
    rows += [[str(getattr(card, c)) for c in _COLUMNS] for card in response.models]
    widths = [max(len(row[i]) for row in rows) for i in range(len(_COLUMNS))]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())
    return 0


def run_tokenize(args: argparse.Namespace, client: Client) -> int:
    response = client.inference.Tokenize(
        pb.TokenizeRequest(text=args.text), timeout=client.unary_timeout
    )
    if args.json:
        print(
            json.dumps({"token_ids": list(response.token_ids), "num_tokens": response.num_tokens})
        )
    else:
        print(" ".join(map(str, response.token_ids)))
    return 0
