"""`sitsctl health`: the daemon's `grpc.health.v1` status, optionally waiting for SERVING.

Prints SERVING or NOT_SERVING on stdout; exit status 0 only for SERVING, so scripts can
`sitsctl health --wait 300 && sitsctl chat ...` while the model loads.
"""

from __future__ import annotations

import argparse
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from sitsd.ctl.client import Client

_POLL_INTERVAL_S = 0.2
_SERVING = health_pb2.HealthCheckResponse.SERVING
_RETRIED = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


def register(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = commands.add_parser(
        "health",
        help="print SERVING or NOT_SERVING; exit 0 only when serving",
        description="Check the daemon's health (grpc.health.v1); exit 0 only when SERVING.",
    )
    parser.add_argument(
        "--wait",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="keep checking for up to this long until SERVING, also while the daemon cannot "
        "be reached yet or a check runs past --timeout (default: %(default)s, check once)",
    )
    parser.add_argument(
        "--service",
        default="",
        metavar="NAME",
        help="the service to check, e.g. sitsd.api.v1.Inference (default: the whole server)",
    )
    parser.set_defaults(run=run_health)


def run_health(args: argparse.Namespace, client: Client) -> int:
    stub = health_pb2_grpc.HealthStub(client.channel)
    request = health_pb2.HealthCheckRequest(service=args.service)
    deadline = time.monotonic() + args.wait
    while True:
        try:
            status = stub.Check(request, timeout=client.unary_timeout).status
        except grpc.RpcError as exc:
            # Not reachable yet (starting) or too busy to answer in time is worth waiting
            # for; an unknown service is not.
            if exc.code() not in _RETRIED or time.monotonic() >= deadline:
                raise
        else:
            if status == _SERVING or time.monotonic() >= deadline:
                print(health_pb2.HealthCheckResponse.ServingStatus.Name(status))
                return 0 if status == _SERVING else 1
        time.sleep(_POLL_INTERVAL_S)
