"""`sitsd serve`'s observability flags, and `ObservabilityConfig` from them plus the standard
`OTEL_*` variables (the flags win). Part of the command line: `sitsd.cli` is what calls it, with
the environment it read."""

from __future__ import annotations

import argparse
from collections.abc import Mapping

from sitsd.config import ObservabilityConfig
from sitsd.flag_types import fraction_or_zero, int_at_least, key_values, positive_float

LOG_LEVELS = ("debug", "info", "warning", "error")
LOG_FORMATS = ("json", "console")


def add_observability_flags(group: argparse._ArgumentGroup) -> None:
    d = ObservabilityConfig()
    group.add_argument(
        "--log-level",
        default=d.log_level,
        choices=LOG_LEVELS,
        help="log verbosity (default: %(default)s)",
    )
    group.add_argument(
        "--log-format",
        default=None,
        choices=LOG_FORMATS,
        help="stdout log lines: json objects or console text (default: console on a terminal, "
        "json otherwise)",
    )
    group.add_argument(
        "--metrics-port",
        type=int_at_least(0, 65535),
        default=d.metrics_port,
        metavar="PORT",
        help="Prometheus /metrics port; 0 = a free one, logged at start-up (default: %(default)s)",
    )
    group.add_argument(
        "--metrics-host",
        default=d.metrics_host,
        metavar="HOST",
        help="address of /metrics (default: the --host address)",
    )
    group.add_argument(
        "--no-metrics", action="store_true", help="do not serve /metrics (default: served)"
    )
    group.add_argument(
        "--otlp-endpoint",
        default=None,
        metavar="URL",
        help="OTLP/gRPC collector for traces and logs, e.g. http://localhost:4317 (default: "
        "$OTEL_EXPORTER_OTLP_ENDPOINT, else nothing is exported)",
    )
    group.add_argument(
        "--service-name",
        default=None,
        metavar="NAME",
        help="OTel service.name (default: $OTEL_SERVICE_NAME, else sitsd)",
    )
    group.add_argument(
        "--trace-sample-ratio",
        type=fraction_or_zero,
        default=None,
        metavar="FRACTION",
        help="fraction of new traces kept; a caller's sampling decision is kept (default: "
        "$OTEL_TRACES_SAMPLER_ARG, else 1)",
    )
    group.add_argument(
        "--no-step-spans",
        action="store_true",
        help="no engine.step span per step (default: one per step, linked to its requests)",
    )
    group.add_argument(
        "--slow-step-ms",
        type=positive_float,
        default=d.slow_step_ms,
        metavar="MS",
        help="log a warning for an engine step this long and --slow-step-factor times the "
        "recent median, with what it carried (default: %(default)s)",
    )
    group.add_argument(
        "--slow-step-factor",
        type=positive_float,
        default=d.slow_step_factor,
        metavar="X",
        help="see --slow-step-ms (default: %(default)s)",
    )
    group.add_argument(
        "--loop-lag-warn-ms",
        type=positive_float,
        default=d.loop_lag_warn_ms,
        metavar="MS",
        help="log a warning when the event loop wakes this late: every stream waited "
        "(default: %(default)s)",
    )
    group.add_argument(
        "--stall-warn-every-s",
        type=positive_float,
        default=d.stall_warn_every_s,
        metavar="SECONDS",
        help="at most one slow-step and one loop-stall warning per this long (default: "
        "%(default)s)",
    )
    group.add_argument(
        "--gil-hold-warn-ms",
        type=positive_float,
        default=None,
        metavar="MS",
        help="log a warning when a thread keeps the Python interpreter this long while others "
        "wait, with where the busy threads were (a probe thread wakes every 2 ms; default: off)",
    )


def observability_config(
    args: argparse.Namespace, environ: Mapping[str, str], *, stdout_is_tty: bool = False
) -> ObservabilityConfig:
    """Observability settings: the flags first, then the standard `OTEL_*` variables."""
    endpoint = args.otlp_endpoint
    if endpoint is None:
        endpoint = environ.get("OTEL_EXPORTER_OTLP_ENDPOINT", "")
    if environ.get("OTEL_SDK_DISABLED", "").lower() == "true":
        endpoint = ""
    if endpoint.startswith("https://"):
        insecure = False
    elif endpoint.startswith("http://"):
        insecure = True
    else:  # no scheme: plaintext unless told otherwise (the collector is usually a sidecar)
        insecure = environ.get("OTEL_EXPORTER_OTLP_INSECURE", "true").lower() != "false"
    ratio = args.trace_sample_ratio
    if ratio is None:
        ratio = 1.0
        if environ.get("OTEL_TRACES_SAMPLER_ARG"):
            ratio = fraction_or_zero(environ["OTEL_TRACES_SAMPLER_ARG"])
    log_format = args.log_format or ("console" if stdout_is_tty else "json")
    return ObservabilityConfig(
        metrics_enabled=not args.no_metrics,
        metrics_host=args.metrics_host,
        metrics_port=args.metrics_port,
        otlp_endpoint=endpoint,
        otlp_insecure=insecure,
        otlp_headers=key_values(environ.get("OTEL_EXPORTER_OTLP_HEADERS", "")),
        service_name=args.service_name or environ.get("OTEL_SERVICE_NAME") or "sitsd",
        resource_attributes=key_values(environ.get("OTEL_RESOURCE_ATTRIBUTES", "")),
        trace_sample_ratio=ratio,
        step_spans=not args.no_step_spans,
        log_format=log_format,
        log_level=args.log_level,
        slow_step_ms=args.slow_step_ms,
        slow_step_factor=args.slow_step_factor,
        loop_lag_warn_ms=args.loop_lag_warn_ms,
        stall_warn_every_s=args.stall_warn_every_s,
        gil_hold_warn_ms=args.gil_hold_warn_ms or 0.0,
    )
