"""`sitsctl status` shows the last weight push a trainer made, with its stage times."""

from __future__ import annotations

import random
import re

from sitsd.api.v1 import admin_pb2
from sitsd.ctl.status import format_status


def rows(status: admin_pb2.StatusResponse) -> dict[str, str]:
    return dict(
        re.split(r"\s{2,}", line, maxsplit=1) for line in format_status(status).splitlines()
    )


def test_status_shows_the_last_weight_push_with_its_stage_times():
    receive = random.uniform(0.1, 9)
    update = admin_pb2.WeightUpdate(
        version="step-12", transport="ipc", outcome="committed", receive_s=receive,
        validate_s=0.01, canary_s=0.0, commit_s=0.2, total_s=receive + 0.21, pause_ms=0.31,
    )  # fmt: skip
    status = admin_pb2.StatusResponse(weight_push=admin_pb2.WeightPushStatus(last_update=update))
    assert rows(status)["last weight push"] == (
        f"step-12 over ipc: committed in {receive + 0.21:.2f} s (receive {receive:.2f} s, "
        "validate 0.01 s, canary 0.00 s, commit 0.20 s, pause 0.31 ms)"
    )
    rejected = admin_pb2.WeightUpdate(version="step-13", transport="grpc", outcome="rejected",
                                      message="x holds NaN or Inf values", total_s=1.5)  # fmt: skip
    status.weight_push.last_update.CopyFrom(rejected)
    assert rows(status)["last weight push"].startswith(
        "step-13 over grpc: rejected: x holds NaN or Inf values in 1.50 s (receive 0.00 s"
    )
    assert "last weight push" not in rows(admin_pb2.StatusResponse())
