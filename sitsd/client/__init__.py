"""A Python client for trainers: push weights into a running sitsd while it keeps serving.

    from sitsd.client import WeightsClient

    client = WeightsClient("localhost:50051")  # the admin token: $SITSD_ADMIN_TOKEN or its file
    result = client.push(model.state_dict(), version="step-1200")
    print(result.version, result.timings, result.pause_ms)

`WeightsClient.push` sends over gRPC, CUDA IPC (same GPU) or a weight group (`WeightGroup`,
torch.distributed), chosen from where the tensors are (`sitsd.client.weights`). It needs torch,
grpc and the generated stubs, nothing else of the daemon (no FastAPI, no OpenTelemetry).
"""

from __future__ import annotations

from sitsd.client.group import WeightGroup
from sitsd.client.weights import PushError, PushProgress, PushResult, WeightsClient

__all__ = ["PushError", "PushProgress", "PushResult", "WeightGroup", "WeightsClient"]
