"""The telemetry interceptor: a server span per sitsd RPC, and every failure classified.

`TelemetryInterceptor` runs outermost on the gRPC server. For each call to a sitsd service it

- continues the caller's trace from the W3C `traceparent`/`tracestate` metadata and starts a
  SERVER span `sitsd.api.v1.<Service>/<Method>` that is current while the servicer runs (the
  servicer hands it to the engine: `tracing.current_request_span()`), with the request's tier
  and the client's `request_id` from the start, so a call that fails before the engine sees
  it still says whose it was;
- maps the call's outcome to an error class (`error_class`): invalid_argument, not_found,
  resource_exhausted, deadline, cancelled, unavailable, unauthenticated, aborted, internal, ...;
  a client that leaves at its deadline is `deadline`, not `cancelled` (`sitsd.api.deadlines`);
- counts it (`sitsd_requests_total`, `sitsd_request_errors_total{error_class}`: every sitsd
  method, tier and error class is created at 0 when the interceptor is built), logs a failure
  inside the span (so the log line carries its trace id; failures a client can cause at a
  bounded rate per method and class) and sets the span's status.

Which status a failure becomes is `sitsd.api.interceptors`' decision; this module only watches.
What is recorded where is observability's: the daemon hands in its `Metrics` and tracer.
Health and reflection calls pass untouched.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import grpc.aio
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from sitsd.api.deadlines import CallDeadline
from sitsd.api.interceptors import SITSD_METHOD_PREFIX, Behavior, replace_behavior
from sitsd.api.v1 import admin_pb2, inference_pb2
from sitsd.observability.log_limit import RateLimitedLog
from sitsd.observability.metrics import Metrics
from sitsd.types import TIER_ORDER, Tier

log = logging.getLogger("sitsd.rpc")

DEFAULT_TIER = Tier.SILVER.value  # the engine's default for requests that name no tier

ERROR_CLASSES: dict[grpc.StatusCode, str] = {
    grpc.StatusCode.INVALID_ARGUMENT: "invalid_argument",
    grpc.StatusCode.OUT_OF_RANGE: "invalid_argument",
    grpc.StatusCode.FAILED_PRECONDITION: "invalid_argument",
    grpc.StatusCode.NOT_FOUND: "not_found",
    grpc.StatusCode.ALREADY_EXISTS: "invalid_argument",
    grpc.StatusCode.RESOURCE_EXHAUSTED: "resource_exhausted",
    grpc.StatusCode.DEADLINE_EXCEEDED: "deadline",
    grpc.StatusCode.CANCELLED: "cancelled",
    grpc.StatusCode.UNAVAILABLE: "unavailable",
    grpc.StatusCode.UNAUTHENTICATED: "unauthenticated",
    grpc.StatusCode.PERMISSION_DENIED: "unauthenticated",
    grpc.StatusCode.ABORTED: "aborted",
    grpc.StatusCode.UNIMPLEMENTED: "unimplemented",
}
# Failures that are the client's doing, logged at INFO; the others at WARNING.
CLIENT_ERROR_CLASSES = frozenset({"invalid_argument", "not_found", "cancelled", "unauthenticated"})
# A client that left (or ran out of time): the call's span says so as its finish reason.
LEAVING_CLASSES = frozenset({"cancelled", "deadline"})

_TIER_NAMES = {
    value: name.removeprefix("TIER_").lower() for name, value in inference_pb2.Tier.items()
}
GENERATE = "Inference/Generate"  # the one method with a tier


def sitsd_methods() -> list[str]:
    """Every sitsd RPC as the metrics name it: "<Service>/<Method>"."""
    services = [*inference_pb2.DESCRIPTOR.services_by_name.values(),
                *admin_pb2.DESCRIPTOR.services_by_name.values()]  # fmt: skip
    return [f"{service.name}/{method.name}" for service in services for method in service.methods]


def error_class_of(code: grpc.StatusCode | None) -> str | None:
    """The error class of a final status; None for OK (or no status set)."""
    if code is None or code == grpc.StatusCode.OK:
        return None
    return ERROR_CLASSES.get(code, "internal")


def request_tier(request: Any) -> str:
    """The tier label of a request message ("" for RPCs without a tier)."""
    if not isinstance(request, inference_pb2.GenerateRequest):
        return ""
    name = _TIER_NAMES.get(request.tier, "unspecified")
    return DEFAULT_TIER if name == "unspecified" else name


def request_id_of(request: Any) -> str:
    """The client's `request_id` of a request message ("" when it names none)."""
    return request.request_id if isinstance(request, inference_pb2.GenerateRequest) else ""


def _operation_name(request: Any) -> str:
    if isinstance(request, inference_pb2.GenerateRequest):
        return "chat" if request.WhichOneof("prompt") == "chat" else "text_completion"
    return ""


class TelemetryInterceptor(grpc.aio.ServerInterceptor):
    """Server spans, error classes, RPC counters and failure logs; see the module docstring."""

    def __init__(self, metrics: Metrics, tracer: trace.Tracer | None = None) -> None:
        self._metrics = metrics
        self._tracer = tracer or trace.NoOpTracer()
        self._limited = RateLimitedLog(log)
        self._propagator = TraceContextTextMapPropagator()
        others = [m for m in sitsd_methods() if m != GENERATE]
        metrics.declare_calls("grpc", [GENERATE], [t.value for t in TIER_ORDER])
        metrics.declare_calls("grpc", others, [""])  # `request_tier`: no tier

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or not method.startswith(SITSD_METHOD_PREFIX):
            return handler
        carrier = {
            k: v for k, v in handler_call_details.invocation_metadata or () if isinstance(v, str)
        }
        call = _Call(self, method[1:], carrier)
        return replace_behavior(handler, call.wrap_unary, call.wrap_stream)

    # ---------------------------------------------------------------- one call's telemetry

    def start(self, rpc_name: str, carrier: dict[str, str], request: Any) -> Span:
        service, _, method = rpc_name.rpartition("/")
        attributes = {"rpc.system": "grpc", "rpc.service": service, "rpc.method": method}
        operation = _operation_name(request)
        if operation:
            attributes["gen_ai.operation.name"] = operation
            attributes["gen_ai.provider.name"] = "sitsd"
            attributes["sitsd.tier"] = request_tier(request)
        if request_id_of(request):
            attributes["sitsd.request_id"] = request_id_of(request)
        return self._tracer.start_span(
            rpc_name,
            context=self._propagator.extract(carrier),
            kind=SpanKind.SERVER,
            attributes=attributes,
        )

    def finish(
        self,
        span: Span,
        rpc_name: str,
        request: Any,
        context: grpc.aio.ServicerContext,
        exc: BaseException | None,
        deadline: CallDeadline,
    ) -> None:
        tier = request_tier(request)
        code = _final_code(context, exc, deadline)
        error_class = error_class_of(code)
        short_name = rpc_name.removeprefix(SITSD_METHOD_PREFIX[1:])
        self._metrics.count_rpc(short_name, tier, error_class)
        span.set_attribute("rpc.grpc.status_code", (code or grpc.StatusCode.OK).value[0])
        if error_class is not None:
            message = _details(context, exc)
            span.set_attribute("error.type", error_class)
            if error_class in LEAVING_CLASSES:  # the engine hears of it after the call ended
                span.set_attribute("sitsd.finish_reason", error_class)
            if error_class not in CLIENT_ERROR_CLASSES:
                span.set_status(Status(StatusCode.ERROR, message))
            level = logging.INFO if error_class in CLIENT_ERROR_CLASSES else logging.WARNING
            fields = {
                "rpc_method": short_name,
                "error_class": error_class,
                "grpc_code": code.name if code is not None else "UNKNOWN",
                "grpc_message": message,
                "tier": tier,
                "request_id": request_id_of(request),
            }
            if error_class == "internal":
                log.log(level, "rpc failed", extra=fields)
            else:  # a failure a client can cause (or repeat at will): at a bounded rate
                self._limited.log(level, (short_name, error_class), "rpc failed", extra=fields)
        span.end()


class _Call:
    """Wraps one call's behavior: span current while it runs, outcome recorded at the end."""

    def __init__(self, owner: TelemetryInterceptor, rpc_name: str, carrier: dict[str, str]):
        self.owner = owner
        self.rpc_name = rpc_name
        self.carrier = carrier

    def wrap_unary(self, behavior: Behavior) -> Behavior:
        async def observed(request: Any, context: grpc.aio.ServicerContext) -> Any:
            span = self.owner.start(self.rpc_name, self.carrier, request)
            token = otel_context.attach(trace.set_span_in_context(span))
            deadline = CallDeadline.after(context.time_remaining())
            failure: BaseException | None = None
            try:
                return await behavior(request, context)
            except BaseException as exc:
                failure = exc
                raise
            finally:
                try:  # inside the span's context: the failure log line carries its trace id
                    self.owner.finish(span, self.rpc_name, request, context, failure, deadline)
                finally:
                    _detach(token)

        return observed

    def wrap_stream(self, behavior: Behavior) -> Behavior:
        if not inspect.isasyncgenfunction(behavior):
            return behavior  # writes through context.write(); none of sitsd's does

        async def observed_stream(
            request: Any, context: grpc.aio.ServicerContext
        ) -> AsyncIterator[Any]:
            span = self.owner.start(self.rpc_name, self.carrier, request)
            token = otel_context.attach(trace.set_span_in_context(span))
            deadline = CallDeadline.after(context.time_remaining())
            failure: BaseException | None = None
            try:
                async for response in behavior(request, context):
                    yield response
            except BaseException as exc:
                failure = exc
                raise
            finally:
                try:  # inside the span's context: the failure log line carries its trace id
                    self.owner.finish(span, self.rpc_name, request, context, failure, deadline)
                finally:
                    _detach(token)

        return observed_stream


def _detach(token: object) -> None:
    otel_context.detach(token)  # type: ignore[arg-type]


def _final_code(
    context: grpc.aio.ServicerContext, exc: BaseException | None, deadline: CallDeadline
) -> grpc.StatusCode | None:
    """The status the call ends with: what the servicer set, or what the exception means (a
    cancellation at the call's deadline is the deadline)."""
    code = context.code()
    if isinstance(code, int):  # grpc.aio may hand back the raw enum value
        code = next((c for c in grpc.StatusCode if c.value[0] == code), None)
    if code not in (None, grpc.StatusCode.OK):
        return code
    if exc is None or isinstance(exc, GeneratorExit):
        return None
    if isinstance(exc, asyncio.CancelledError):
        if deadline.explains_leaving():
            return grpc.StatusCode.DEADLINE_EXCEEDED
        return grpc.StatusCode.CANCELLED
    return grpc.StatusCode.UNKNOWN


def _details(context: grpc.aio.ServicerContext, exc: BaseException | None) -> str:
    details = context.details()
    if isinstance(details, bytes):
        details = details.decode(errors="replace")
    if details:
        return str(details)
    return "" if exc is None else f"{type(exc).__name__}: {exc}"
