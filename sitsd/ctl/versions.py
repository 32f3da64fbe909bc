"""Weight versions from the command line: `sitsctl manifest`, `deploy`, `swap`, `rollback`,
`versions`.

`manifest DIR` runs here, with no daemon: it hashes every file of a version directory and writes
its `manifest.json` (a progress bar while hashing). The others call the Admin RPCs (the admin
token): deploy, swap and rollback draw their streamed progress as a tqdm bar on stderr (bytes
hashed, checked and copied; canary; migration) and print one summary line on stdout; a
rejected version or a refused swap is an error line and exit 1, like every sitsctl failure.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Iterator
from typing import Any

from sitsd.api.v1 import admin_pb2
from sitsd.ctl.client import Client, CtlError, to_json

POLICIES: dict[str, admin_pb2.SwapPolicy] = {
    "migrate": admin_pb2.SWAP_POLICY_MIGRATE,
    "drain": admin_pb2.SWAP_POLICY_DRAIN,
    "restart": admin_pb2.SWAP_POLICY_RESTART,
}
_STAGE_TEXT = {"verify": "verify", "validate": "validate", "stage": "copy", "canary": "canary"}


def register(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    manifest = commands.add_parser(
        "manifest",
        help="write a version directory's manifest.json (runs locally)",
        description="Hash every file of DIR and write DIR/manifest.json (name, size, sha256).",
    )
    manifest.add_argument("directory", metavar="DIR")
    manifest.add_argument("--model", default="", help="model name to record in the manifest")
    _add_progress_flag(manifest)
    manifest.set_defaults(run=run_manifest)

    deploy = commands.add_parser(
        "deploy",
        help="register and stage a weight version (admin token)",
        description="Register the version in PATH (a directory on the daemon's host, with a "
        "manifest.json) and stage it: verify, validate, copy into the standby slot, canary.",
    )
    deploy.add_argument("path", metavar="PATH")
    deploy.add_argument("--version", default="", help="its id (default: the directory name)")
    _add_progress_flag(deploy)
    deploy.set_defaults(run=run_deploy)

    swap = commands.add_parser(
        "swap",
        help="make a weight version active (admin token)",
        description="Stage VERSION if needed, then commit it between two engine steps.",
    )
    swap.add_argument("version", metavar="VERSION")
    _add_policy_flag(swap)
    _add_progress_flag(swap)
    swap.set_defaults(run=run_swap)

    rollback = commands.add_parser(
        "rollback",
        help="go back to the previous weight version (admin token)",
        description="Commit the version that was active before the current one.",
    )
    _add_policy_flag(rollback)
    _add_progress_flag(rollback)
    rollback.set_defaults(run=run_rollback)

    versions = commands.add_parser(
        "versions",
        help="list the weight versions (admin token)",
        description="List every weight version the daemon knows: state, slot, reason.",
    )
    versions.add_argument("--json", action="store_true", help="print the response as JSON")
    versions.set_defaults(run=run_versions)


def _add_policy_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--policy",
        choices=sorted(POLICIES),
        default=None,
        help="what happens to requests in flight (default: the daemon's --swap-policy)",
    )


def _add_progress_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


# ------------------------------------------------------------------------------- commands


def run_manifest(args: argparse.Namespace, client: Client) -> int:
    from sitsd.weights.manifest import ManifestError, write_manifest

    bar = _bar(args, "hash")
    try:
        manifest = write_manifest(
            args.directory,
            model=args.model,
            on_progress=bar.bytes if bar else None,
            workers=min(4, os.cpu_count() or 1),
        )
    except (ManifestError, OSError) as exc:
        raise CtlError(str(exc)) from None
    finally:
        if bar:
            bar.close()
    print(
        f"wrote {args.directory}/manifest.json: {len(manifest.files)} files, "
        f"{manifest.total_bytes / 2**20:.1f} MiB, sha256 {manifest.digest[:16]}"
    )
    return 0


def run_deploy(args: argparse.Namespace, client: Client) -> int:
    request = admin_pb2.DeployRequest(path=args.path, version=args.version)
    stream = client.admin.Deploy(request, metadata=client.admin_metadata(), timeout=client.timeout)
    last = _follow(stream, args)
    print(
        f"staged {last.version}: validated and in the standby slot; commit with "
        f"`sitsctl swap {last.version}`"
    )
    return 0


def run_swap(args: argparse.Namespace, client: Client) -> int:
    request = admin_pb2.SwapRequest(version=args.version, policy=_policy(args))
    stream = client.admin.Swap(request, metadata=client.admin_metadata(), timeout=client.timeout)
    print(_committed(_follow(stream, args)))
    return 0


def run_rollback(args: argparse.Namespace, client: Client) -> int:
    request = admin_pb2.RollbackRequest(policy=_policy(args))
    stream = client.admin.Rollback(
        request, metadata=client.admin_metadata(), timeout=client.timeout
    )
    print(_committed(_follow(stream, args)))
    return 0


def run_versions(args: argparse.Namespace, client: Client) -> int:
    response = client.admin.ListVersions(
        admin_pb2.ListVersionsRequest(),
        metadata=client.admin_metadata(),
        timeout=client.unary_timeout,
    )
    print(to_json(response) if args.json else format_versions(response))
    return 0


def format_versions(response: admin_pb2.ListVersionsResponse) -> str:
    """A table of the versions, newest last, and a line about the slots."""
    rows = [["VERSION", "STATE", "SLOT", "PRECISION", "WEIGHTS", "SOURCE", "UPDATED",
             "PATH / REASON"]]  # fmt: skip
    for v in response.versions:
        state = admin_pb2.VersionState.Name(v.state).removeprefix("VERSION_STATE_").lower()
        updated = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(v.updated_at))
        size = f"{v.weight_bytes / 2**20:.1f} MiB" if v.weight_bytes else "-"
        rows.append([v.version, state, v.slot or "-", v.precision or "-", size, v.source,
                     updated, v.reason or v.path])  # fmt: skip
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    lines = ["  ".join([*(c.ljust(w) for c, w in zip(row, widths)), row[-1]]) for row in rows]
    busy = (
        f"; in progress: {response.operation_in_progress}" if response.operation_in_progress else ""
    )
    lines.append(
        f"model {response.model}: {response.num_weight_slots} weight slot(s), "
        f"rollback to {response.previous_version or '-'}{busy}"
    )
    return "\n".join(lines)


# -------------------------------------------------------------------------------- helpers


def _policy(args: argparse.Namespace) -> admin_pb2.SwapPolicy:
    return POLICIES[args.policy] if args.policy else admin_pb2.SWAP_POLICY_UNSPECIFIED


def _follow(stream: Iterator[admin_pb2.SwapProgress], args: argparse.Namespace) -> Any:
    """Draw the progress; return the last message (a failure raises grpc.RpcError)."""
    bar = _bar(args, "")
    last = None
    try:
        for last in stream:
            if bar:
                bar.show(last)
    finally:
        if bar:
            bar.close()
    if last is None:
        raise CtlError("the daemon sent no progress")
    return last


def _committed(last: admin_pb2.SwapProgress) -> str:
    if last.message == "already active":
        return f"{last.version} is already active"
    return (
        f"committed {last.version} ({last.policy}): serving pause {last.pause_ms:.2f} ms, "
        f"{last.num_migrating} migrated, {last.num_restarted} restarted, "
        f"{last.num_draining} draining"
    )


class _Bar:
    """A tqdm bar on stderr that follows the stages of a swap."""

    def __init__(self, desc: str) -> None:
        from tqdm import tqdm

        self._tqdm = tqdm(
            total=0,
            desc=desc,
            unit="B",
            unit_scale=True,
            unit_divisor=1024,
            file=sys.stderr,
            dynamic_ncols=True,
            leave=False,
        )
        self._stage = ""

    def bytes(self, done: int, total: int) -> None:
        self._tqdm.total = total
        self._tqdm.n = done
        self._tqdm.refresh()

    def show(self, progress: admin_pb2.SwapProgress) -> None:
        if progress.stage != self._stage:
            self._stage = progress.stage
            self._tqdm.set_description(_STAGE_TEXT.get(progress.stage, progress.stage))
        if progress.bytes_total:
            self.bytes(progress.bytes_done, progress.bytes_total)
        elif progress.stage == "commit" and progress.num_migrating:
            self._tqdm.set_postfix_str(
                f"{progress.num_caught_up}/{progress.num_migrating} migrated", refresh=True
            )
        elif progress.message:
            self._tqdm.set_postfix_str(progress.message[:60], refresh=True)

    def close(self) -> None:
        self._tqdm.close()


def _bar(args: argparse.Namespace, desc: str) -> _Bar | None:
    return None if args.no_progress else _Bar(desc)
