"""A tiny OTLP/gRPC receiver (traces and logs) on 127.0.0.1 that keeps what it is sent.

Stands in for the OpenTelemetry Collector in the tests (`tests/e2e`) and in
`bench.bench_telemetry`: the daemon's real exporters send to it over real gRPC.
"""

from __future__ import annotations

import threading
from concurrent import futures

import grpc
from opentelemetry.proto.collector.logs.v1 import logs_service_pb2, logs_service_pb2_grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.logs.v1.logs_pb2 import LogRecord
from opentelemetry.proto.trace.v1.trace_pb2 import Span


class OtlpReceiver(
    trace_service_pb2_grpc.TraceServiceServicer, logs_service_pb2_grpc.LogsServiceServicer
):
    """Collects exported spans and log records with their resource attributes."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._spans: list[tuple[dict[str, object], Span]] = []
        self._logs: list[tuple[dict[str, object], LogRecord]] = []
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self._server)
        logs_service_pb2_grpc.add_LogsServiceServicer_to_server(self, self._server)
        self.port = self._server.add_insecure_port("127.0.0.1:0")
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._server.start()

    def stop(self) -> None:
        self._server.stop(0)

    def Export(self, request, context):
        if isinstance(request, trace_service_pb2.ExportTraceServiceRequest):
            with self._lock:
                for rs in request.resource_spans:
                    resource = attributes(rs.resource.attributes)
                    self._spans += [(resource, s) for ss in rs.scope_spans for s in ss.spans]
            return trace_service_pb2.ExportTraceServiceResponse()
        with self._lock:
            for rl in request.resource_logs:
                resource = attributes(rl.resource.attributes)
                self._logs += [(resource, r) for sl in rl.scope_logs for r in sl.log_records]
        return logs_service_pb2.ExportLogsServiceResponse()

    @property
    def spans(self) -> list[Span]:
        with self._lock:
            return [s for _, s in self._spans]

    @property
    def logs(self) -> list[LogRecord]:
        with self._lock:
            return [r for _, r in self._logs]

    def span_resources(self) -> list[dict[str, object]]:
        with self._lock:
            return [r for r, _ in self._spans]


def attributes(kvs) -> dict[str, object]:
    """OTLP KeyValues as a dict of plain Python values."""
    out: dict[str, object] = {}
    for kv in kvs:
        value = kv.value
        kind = value.WhichOneof("value")
        if kind == "array_value":
            out[kv.key] = tuple(getattr(v, v.WhichOneof("value")) for v in value.array_value.values)
        elif kind is not None:
            out[kv.key] = getattr(value, kind)
    return out
