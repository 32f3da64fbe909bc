"""Telemetry overhead: decode throughput of the real engine with full telemetry on vs off.

One engine (SmolLM2-135M-Instruct, the real scheduler, runner, sampler, detokenizer and asyncio
bridge, in process, no gRPC), one workload, runs alternating between:

- on:  the engine observer records every metric (histograms with trace-id exemplars), makes
       the request's SERVER span, its queue/prefill/decode children and one `engine.step` span
       per step linked to its requests, exported by the batch span processor over real OTLP/gRPC
       to an in-process receiver (whose decoding also runs on these cores); one JSON log line
       per request, also exported over OTLP; a scraper pulls /metrics (OpenMetrics) every
       SCRAPE_INTERVAL seconds (5, as deploy/ configures Prometheus; each scrape costs ~7 ms).
- off: the same engine with the no-op observer, no spans, no exports, no scrapes.

Workloads: 16 concurrent requests x NEW_TOKENS (aggregate output tokens/s over the wall time),
and batch 1 (decode tokens/s after the first token), REPEATS pairs of runs, on and off back to
back (the order alternates). The overhead is the median over pairs of 1 - on/off, so a drift in
the machine's load between pairs cancels; its min-max over pairs is the spread. Prints a table
last.

    make bench-telemetry      # or: .venv/bin/python -m bench.bench_telemetry [--repeats 5]
"""

from __future__ import annotations

import argparse
import asyncio
import io
import logging
import os
import statistics
import threading
import urllib.request

import torch
from opentelemetry.trace import SpanKind

from bench.bench_cpu import prompts_ids
from bench.timing import now
from sitsd.builder import launch_engine
from sitsd.config import CacheConfig, ObservabilityConfig, SitsdConfig
from sitsd.engine.observer import NullObserver
from sitsd.observability import Observability
from sitsd.observability.logs import setup_logging
from sitsd.observability.metrics import MetricsServer
from sitsd.testing.otlp_receiver import OtlpReceiver
from sitsd.types import SamplingParams
from sitsd.weights import load_checkpoint, resolve_model_path


class Switch:
    """The engine's observer: forwards to the telemetry (on) or to a no-op (off)."""

    def __init__(self, on, off) -> None:
        self.on, self.off = on, off
        self.target = off

    def on_engine_started(self, model: str, weights_version: str) -> None:
        self.on.on_engine_started(model, weights_version)  # labels, weights version: once

    def __getattr__(self, name):
        return getattr(self.target, name)


class Scraper:
    """Pulls /metrics in the OpenMetrics format every `interval` seconds, as Prometheus does."""

    def __init__(self, url: str, interval: float = 1.0) -> None:
        self.url, self.interval = url, interval
        self.num_scrapes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        request = urllib.request.Request(
            self.url, headers={"Accept": "application/openmetrics-text"}
        )
        while not self._stop.wait(self.interval):
            with urllib.request.urlopen(request, timeout=10) as r:
                r.read()
            self.num_scrapes += 1

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)


async def measure(engine, obs, prompts, new_tokens: int, traced: bool) -> tuple[float, float]:
    """(aggregate tok/s of all prompts at once, batch-1 decode tok/s)."""
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)

    async def one(ids: list[int]) -> tuple[float, float, float]:
        span = obs.tracer.start_span("generate", kind=SpanKind.SERVER) if traced else None
        t0, first = now(), None
        async for _ in engine.add_request(ids, params, trace_context=span):
            first = first or now()
        if span is not None:
            span.end()
        return t0, first, now()

    t0 = now()
    await asyncio.gather(*(one(p) for p in prompts))
    concurrent = len(prompts) * new_tokens / (now() - t0)
    _, first, end = await one(prompts[0])
    return concurrent, (new_tokens - 1) / (end - first)


async def run(args: argparse.Namespace) -> dict[str, dict[str, list[float]]]:
    path = resolve_model_path("default")
    prompts = prompts_ids(load_checkpoint(path, load_tensors=False).tokenizer)
    receiver = OtlpReceiver()
    config = ObservabilityConfig(otlp_endpoint=receiver.endpoint, log_format="json")
    obs = Observability.create(config)
    # JSON lines to a sink (a terminal would measure the terminal) and to OTLP.
    setup_logging("info", "json", obs.logger_provider, stream=io.StringIO())
    switch = Switch(obs.telemetry, NullObserver())
    engine = await launch_engine(
        SitsdConfig(cache=CacheConfig(kv_cache_memory=512 * 2**20)), observer=switch
    )
    server = MetricsServer(obs.metrics, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.port}/metrics"
    results: dict[str, dict[str, list[float]]] = {
        mode: {"concurrent": [], "decode": []} for mode in ("on", "off")
    }
    switch.target = obs.telemetry
    await measure(engine, obs, prompts[:4], 16, traced=True)  # warm-up, both paths
    switch.target = switch.off
    await measure(engine, obs, prompts[:4], 16, traced=False)
    for i in range(args.repeats):
        # Alternate which mode goes first, so a drift in machine load hits both alike.
        for mode in ("on", "off") if i % 2 == 0 else ("off", "on"):
            on = mode == "on"
            switch.target = obs.telemetry if on else switch.off
            scraper = Scraper(url, args.scrape_interval) if on else None
            concurrent, decode = await measure(engine, obs, prompts, args.new_tokens, traced=on)
            if scraper is not None:
                scraper.stop()
            results[mode]["concurrent"].append(concurrent)
            results[mode]["decode"].append(decode)
            print(
                f"  run {i + 1} {mode:>3}: 16 concurrent {concurrent:7.1f} tok/s, "
                f"batch 1 decode {decode:6.1f} tok/s",
                flush=True,
            )
    await engine.shutdown(1.0)
    server.close()
    obs.tracer_provider.force_flush()
    obs.logger_provider.force_flush()
    print(
        f"  exported: {len(receiver.spans)} spans, {len(receiver.logs)} log records",
        flush=True,
    )
    obs.shutdown()
    receiver.stop()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--scrape-interval", type=float, default=5.0)
    args = parser.parse_args()
    logging.getLogger().setLevel(logging.WARNING)
    print(
        f"SmolLM2-135M-Instruct, 16 prompts, {args.new_tokens} new tokens each, torch "
        f"{torch.__version__}, {torch.get_num_threads()} threads, load average "
        f"{os.getloadavg()[0]:.2f}",
        flush=True,
    )
    results = asyncio.run(run(args))
    print(
        f"\n{'workload':<24}{'off':>8}{'on':>8}{'overhead':>10}{'pairs min..max':>18}"
        "   off min-max / on min-max (tok/s)"
    )
    for key, name in (("concurrent", "16 concurrent, tok/s"), ("decode", "batch 1 decode, tok/s")):
        off, on = results["off"][key], results["on"][key]
        paired = [(1 - a / b) * 100 for a, b in zip(on, off)]
        print(
            f"{name:<24}{statistics.median(off):>8.1f}{statistics.median(on):>8.1f}"
            f"{statistics.median(paired):>9.2f}%{min(paired):>8.2f}..{max(paired):.2f}%"
            f"   {min(off):.1f}-{max(off):.1f} / {min(on):.1f}-{max(on):.1f}"
        )


if __name__ == "__main__":
    main()
