"""Observability flags and the standard OTEL_* variables -> `ObservabilityConfig`."""

from __future__ import annotations

import pytest

from sitsd.cli import build_parser, config_from_args
from sitsd.config import ObservabilityConfig


def obs_of(*flags: str, environ: dict[str, str] | None = None, tty: bool = False):
    args = build_parser().parse_args(["serve", *flags])
    return config_from_args(args, environ or {}, stdout_is_tty=tty).observability


def test_defaults_export_nothing_and_serve_metrics_on_9464():
    assert obs_of() == ObservabilityConfig()
    assert obs_of().metrics_port == 9464
    assert obs_of().otlp_endpoint == ""


def test_every_observability_flag_reaches_its_field():
    cfg = obs_of(
        "--metrics-port", "0", "--metrics-host", "0.0.0.0", "--otlp-endpoint",
        "https://collector:4317", "--service-name", "sitsd-eu", "--log-format", "console",
        "--log-level", "debug", "--trace-sample-ratio", "0.25", "--no-step-spans",
        "--slow-step-ms", "8", "--slow-step-factor", "1.5", "--loop-lag-warn-ms", "4",
        "--stall-warn-every-s", "0.05", "--gil-hold-warn-ms", "12",
    )  # fmt: skip
    assert cfg == ObservabilityConfig(
        metrics_host="0.0.0.0",
        metrics_port=0,
        otlp_endpoint="https://collector:4317",
        otlp_insecure=False,
        service_name="sitsd-eu",
        trace_sample_ratio=0.25,
        step_spans=False,
        log_format="console",
        log_level="debug",
        slow_step_ms=8.0,
        slow_step_factor=1.5,
        loop_lag_warn_ms=4.0,
        stall_warn_every_s=0.05,
        gil_hold_warn_ms=12.0,
    )
    assert not obs_of("--no-metrics").metrics_enabled


def test_standard_otel_variables_fill_what_no_flag_set():
    env = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": "http://otel-collector:4317",
        "OTEL_SERVICE_NAME": "sitsd-a",
        "OTEL_RESOURCE_ATTRIBUTES": "deployment.environment=prod,k8s.pod.name=sitsd%2D0",
        "OTEL_EXPORTER_OTLP_HEADERS": "x-tenant=acme",
        "OTEL_TRACES_SAMPLER_ARG": "0.5",
    }
    cfg = obs_of(environ=env)
    assert cfg.otlp_endpoint == "http://otel-collector:4317"
    assert cfg.otlp_insecure
    assert cfg.service_name == "sitsd-a"
    assert cfg.resource_attributes == (
        ("deployment.environment", "prod"),
        ("k8s.pod.name", "sitsd-0"),
    )
    assert cfg.otlp_headers == (("x-tenant", "acme"),)
    assert cfg.trace_sample_ratio == 0.5
    flagged = obs_of("--otlp-endpoint", "http://other:4317", "--service-name", "b", environ=env)
    assert (flagged.otlp_endpoint, flagged.service_name) == ("http://other:4317", "b")


def test_otel_sdk_disabled_turns_export_off():
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317", "OTEL_SDK_DISABLED": "true"}
    assert obs_of(environ=env).otlp_endpoint == ""


def test_log_format_defaults_to_console_on_a_terminal_and_json_otherwise():
    assert obs_of(tty=True).log_format == "console"
    assert obs_of(tty=False).log_format == "json"


@pytest.mark.parametrize("flags", [["--metrics-port", "70000"], ["--trace-sample-ratio", "2"]])
def test_out_of_range_values_are_refused(flags, capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", *flags])


def test_the_stall_warning_flags_reach_the_engine_telemetry_s_slow_step_log():
    from sitsd.observability.stack import Observability

    cfg = obs_of("--slow-step-ms", "8", "--slow-step-factor", "1.5", "--stall-warn-every-s", "0.05")
    slow = Observability.create(cfg).telemetry.slow_steps
    assert (slow.min_s, slow.factor, slow.warn_every_s) == (0.008, 1.5, 0.05)
    default = Observability.create(ObservabilityConfig()).telemetry.slow_steps
    assert (default.min_s, default.factor, default.warn_every_s) == (0.02, 3.0, 1.0)
