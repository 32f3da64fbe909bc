"""Logging: structlog JSON lines with trace ids on the stream, the same records through OTLP."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator

import pytest
from opentelemetry.sdk._logs import LoggerProvider
from opentelemetry.sdk._logs.export import InMemoryLogRecordExporter, SimpleLogRecordProcessor
from opentelemetry.sdk.trace import TracerProvider

from sitsd.observability.logs import setup_logging


@pytest.fixture
def root_restored() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


def lines(stream: io.StringIO) -> list[dict]:
    return [json.loads(line) for line in stream.getvalue().splitlines()]


def test_json_lines_carry_extras_and_the_current_trace_and_span_ids(root_restored):
    stream = io.StringIO()
    setup_logging("info", "json", stream=stream)
    tracer = TracerProvider().get_tracer("t")
    logging.getLogger("sitsd.test").debug("not shown at info")
    logging.getLogger("sitsd.test").info("outside any span")
    with tracer.start_as_current_span("work") as span:
        logging.getLogger("sitsd.test").warning("inside %s", "a span", extra={"req_id": "r-7"})
    outside, inside = lines(stream)
    assert outside["event"] == "outside any span"
    assert "trace_id" not in outside
    ctx = span.get_span_context()
    assert inside["event"] == "inside a span"
    assert inside["level"] == "warning"
    assert inside["logger"] == "sitsd.test"
    assert inside["req_id"] == "r-7"
    assert inside["trace_id"] == format(ctx.trace_id, "032x")
    assert inside["span_id"] == format(ctx.span_id, "016x")
    assert inside["timestamp"].endswith("Z")


def test_exceptions_are_rendered_into_the_json_line(root_restored):
    stream = io.StringIO()
    setup_logging("info", "json", stream=stream)
    try:
        raise KeyError("boom")
    except KeyError:
        logging.getLogger("sitsd.test").exception("failed")
    (line,) = lines(stream)
    assert "KeyError: 'boom'" in line["exception"]


def test_console_format_is_one_readable_line(root_restored):
    stream = io.StringIO()
    setup_logging("info", "console", stream=stream)
    logging.getLogger("sitsd.test").info("hello %d", 42)
    (line,) = stream.getvalue().splitlines()
    assert "hello 42" in line
    assert not line.startswith("{")


def test_records_reach_the_otel_logs_pipeline_with_their_trace_context(root_restored):
    exporter = InMemoryLogRecordExporter()
    provider = LoggerProvider()
    provider.add_log_record_processor(SimpleLogRecordProcessor(exporter))
    setup_logging("info", "json", logger_provider=provider, stream=io.StringIO())
    tracer = TracerProvider().get_tracer("t")
    with tracer.start_as_current_span("work") as span:
        logging.getLogger("sitsd.test").info("in the span", extra={"tier": "gold"})
    logging.getLogger("opentelemetry.exporter").warning("export failed")  # kept off OTLP
    (data,) = exporter.get_finished_logs()
    record = data.log_record
    assert record.body == "in the span"
    assert record.trace_id == span.get_span_context().trace_id
    assert record.span_id == span.get_span_context().span_id
    assert record.attributes["tier"] == "gold"


def test_an_unknown_format_is_refused(root_restored):
    with pytest.raises(ValueError, match="log format"):
        setup_logging("info", "xml", stream=io.StringIO())
