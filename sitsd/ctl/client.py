"""What every sitsctl command shares: the channel and stubs, the admin token, error wording.

Commands get a `Client` and raise `CtlError` for anything the user must fix; `sitsd.ctl.main`
turns both `CtlError` and `grpc.RpcError` into one line on stderr and exit status 1.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping
from pathlib import Path

import grpc
from google.protobuf import json_format
from google.protobuf.message import Message

from sitsd.api.v1 import admin_pb2_grpc, inference_pb2_grpc
from sitsd.config import ADMIN_TOKEN_FILE_NAME, default_state_dir

ADDRESS_ENV = "SITSD_ADDRESS"
TOKEN_ENV = "SITSD_ADMIN_TOKEN"
DEFAULT_ADDRESS = "localhost:50051"
DEFAULT_UNARY_TIMEOUT_S = 10.0  # status, models, tokenize: answered at once by a live daemon
_CONNECTED_PROBE_S = 0.2  # how long to look for a live connection when explaining UNAVAILABLE


class CtlError(Exception):
    """A problem the user must fix; printed as `sitsctl: error: <message>`."""


def read_admin_token(token_file: str, environ: Mapping[str, str]) -> str:
    """The admin token: `--token-file`, else `$SITSD_ADMIN_TOKEN`, else the daemon's default file.

    Raises:
        CtlError: the file is missing, unreadable or empty.
    """
    if not token_file and environ.get(TOKEN_ENV):
        return environ[TOKEN_ENV].strip()
    path = Path(token_file or Path(default_state_dir(environ)) / ADMIN_TOKEN_FILE_NAME)
    try:
        token = path.expanduser().read_text().strip()
    except OSError as exc:
        raise CtlError(
            f"cannot read the admin token from {path}: {exc.strerror or exc}; pass --token-file "
            f"or set {TOKEN_ENV}"
        ) from None
    if not token:
        raise CtlError(f"the admin token file {path} is empty")
    return token


def to_json(message: Message) -> str:
    """`message` as indented JSON: every field, in .proto order, 64-bit integers as numbers."""
    fields = json_format.MessageToDict(
        message,
        preserving_proto_field_name=True,
        always_print_fields_with_no_presence=True,
        unquote_int64_if_possible=True,
    )
    ordered = {f.name: fields[f.name] for f in message.DESCRIPTOR.fields if f.name in fields}
    return json.dumps(ordered, indent=2)


class Client:
    """A channel to one daemon, its stubs, and the options every command honours."""

    def __init__(self, args: argparse.Namespace, environ: Mapping[str, str]) -> None:
        """Args:
        args: the parsed global options (`address`, `token_file`, `timeout`).
        environ: the environment (for the admin token).
        """
        self.address: str = args.address
        self.timeout: float | None = args.timeout
        self._token_file: str = args.token_file
        self._environ = environ
        self.channel = grpc.insecure_channel(self.address)
        self.inference = inference_pb2_grpc.InferenceStub(self.channel)
        self.admin = admin_pb2_grpc.AdminStub(self.channel)

    @property
    def unary_timeout(self) -> float:
        """Deadline of a unary call: `--timeout`, or a default so a stuck daemon cannot hang us."""
        return self.timeout if self.timeout is not None else DEFAULT_UNARY_TIMEOUT_S

    def admin_metadata(self) -> list[tuple[str, str]]:
        """Call metadata that authenticates an Admin RPC."""
        token = read_admin_token(self._token_file, self._environ)
        return [("authorization", f"Bearer {token}")]

    def describe(self, error: grpc.RpcError) -> str:
        """One line explaining a failed call."""
        code: grpc.StatusCode = error.code()
        details: str = error.details() or ""
        if code is grpc.StatusCode.UNAVAILABLE and not self._connected():
            return (
                f"cannot reach sitsd at {self.address} (is it running? set --address or "
                f"{ADDRESS_ENV}): {details}"
            )
        return f"{code.name}: {details}"

    def _connected(self) -> bool:
        # UNAVAILABLE is also what a live daemon answers while it loads or drains; only a
        # channel that cannot connect means the daemon is not there.
        try:
            grpc.channel_ready_future(self.channel).result(timeout=_CONNECTED_PROBE_S)
        except grpc.FutureTimeoutError:
            return False
        return True

    def close(self) -> None:
        self.channel.close()
