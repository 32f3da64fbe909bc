"""Test doubles and in-process peers that the test suite and the benchmarks share; never
imported by the daemon.

- `otlp_receiver`: an OTLP/gRPC receiver (traces and logs) standing in for the OpenTelemetry
  Collector, keeping what the daemon's real exporters send it.

Doubles that only the tests use stay under `tests/`.
"""
