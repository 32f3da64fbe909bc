"""The benchmarks' load process ends when the benchmark that started it is gone."""

from __future__ import annotations

import multiprocessing
import socket
from pathlib import Path


def test_the_load_process_ends_when_its_parent_closes_the_pipe_without_stop(monkeypatch):
    # The root on the import path: the spawned child imports `bench.load` by name too.
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1]))
    from bench.load import LoadSpec, _child

    with socket.socket() as s:  # a port nothing listens on: every request fails at once
        s.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{s.getsockname()[1]}"
    spec = LoadSpec(address, prompts=[[5, 6, 7]], clients=4, seed=0, timeout_s=5.0)
    context = multiprocessing.get_context("spawn")
    parent, child = context.Pipe()
    process = context.Process(target=_child, args=(spec, child), daemon=True)
    process.start()
    try:
        child.close()
        assert parent.recv() == "ready"
        parent.close()  # as a killed parent's end closes
        process.join(300)  # a last guard: it ends as soon as it sees the pipe closed
        assert process.exitcode == 0
    finally:
        if process.is_alive():
            process.kill()
