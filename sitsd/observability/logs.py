"""Logging: structlog-rendered JSON lines on stdout, and the OTel logs pipeline to a collector.

sitsd's modules log through the standard `logging` module. `setup_logging` gives the root
logger two handlers:

- stdout: `structlog.stdlib.ProcessorFormatter` renders each record as one JSON object (or a
  console line) with `timestamp`, `level`, `logger`, `event`, the record's `extra` fields and,
  inside a traced request, its `trace_id` and `span_id`;
- OTLP (when a logger provider is given): the `LoggingHandler` of
  `opentelemetry-instrumentation-logging`, which sends the record with its trace context and
  its extra fields as attributes (Loki keeps them as structured metadata).

The root logger is process-global by nature (the `logging` module's design); nothing else here
is: the logger provider is passed in, never installed globally. OTel's own loggers are kept off
the OTLP handler, so an export failure cannot feed itself.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import MutableMapping
from typing import Any, TextIO

import structlog
from opentelemetry import trace

LOG_FORMATS = ("json", "console")


def add_trace_ids(
    logger: Any, method_name: str, event_dict: MutableMapping[str, Any]
) -> MutableMapping[str, Any]:
    """structlog processor: `trace_id` and `span_id` of the current span, when there is one."""
    ctx = trace.get_current_span().get_span_context()
    if ctx.is_valid:
        event_dict["trace_id"] = format(ctx.trace_id, "032x")
        event_dict["span_id"] = format(ctx.span_id, "016x")
    return event_dict


def stdout_formatter(log_format: str) -> logging.Formatter:
    """The formatter of the stdout handler: JSON lines or readable console lines."""
    if log_format not in LOG_FORMATS:
        raise ValueError(f"log format must be one of {', '.join(LOG_FORMATS)}; got {log_format!r}")
    renderer: Any = (
        structlog.processors.JSONRenderer()
        if log_format == "json"
        else structlog.dev.ConsoleRenderer(colors=False)
    )
    return structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=[
            structlog.stdlib.add_log_level,
            structlog.stdlib.add_logger_name,
            structlog.stdlib.ExtraAdder(),
            add_trace_ids,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
        ],
        processors=[
            structlog.stdlib.ProcessorFormatter.remove_processors_meta,
            structlog.processors.format_exc_info,
            renderer,
        ],
    )


class _NotFromOpenTelemetry(logging.Filter):
    """Keeps the OTel SDK's own records (export retries, ...) off the OTLP handler."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.name.startswith("opentelemetry")


def setup_logging(
    level: str = "info",
    log_format: str = "json",
    logger_provider: Any | None = None,
    stream: TextIO | None = None,
) -> list[logging.Handler]:
    """Route every log record to stdout (rendered by structlog) and, if given, to OTLP.

    Args:
        level: root level (debug, info, warning, error).
        log_format: json or console.
        logger_provider: an OTel SDK `LoggerProvider`; None = no OTLP logs.
        stream: where the rendered lines go; default stdout.

    Returns:
        The handlers installed on the root logger (they replace any before).
    """
    stdout = logging.StreamHandler(stream or sys.stdout)
    stdout.setFormatter(stdout_formatter(log_format))
    handlers: list[logging.Handler] = [stdout]
    if logger_provider is not None:
        from opentelemetry.instrumentation.logging.handler import LoggingHandler

        otlp = LoggingHandler(logger_provider=logger_provider)
        otlp.addFilter(_NotFromOpenTelemetry())
        handlers.append(otlp)
    root = logging.getLogger()
    root.handlers[:] = handlers
    root.setLevel(level.upper())
    return handlers


def build_logger_provider(resource: Any, endpoint: str, insecure: bool, headers: Any) -> Any:
    """An OTel `LoggerProvider` batching records to an OTLP/gRPC endpoint."""
    from opentelemetry.exporter.otlp.proto.grpc._log_exporter import OTLPLogExporter
    from opentelemetry.sdk._logs import LoggerProvider
    from opentelemetry.sdk._logs.export import BatchLogRecordProcessor

    provider = LoggerProvider(resource=resource)
    exporter = OTLPLogExporter(endpoint=endpoint, insecure=insecure, headers=headers or None)
    provider.add_log_record_processor(BatchLogRecordProcessor(exporter))
    return provider
