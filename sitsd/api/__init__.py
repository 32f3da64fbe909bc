"""The daemon's gRPC front end.

`server` assembles a `grpc.aio` server: the `Inference` servicer (`inference`), the `Admin`
servicer (`admin`), health and reflection, and the interceptors (`interceptors`: admin auth and
the one mapping from engine exceptions to gRPC statuses; `telemetry`: server spans, error
classes and RPC counters, recorded with the metrics and tracer the daemon hands in). `convert`
turns proto messages into `sitsd.types` and back. The engine itself, and the rules a request
must meet (`sitsd.engine.validation`), are `sitsd.engine`'s business; these modules only
translate, call those rules where a refusal must name the request's own field, and stream.
"""
