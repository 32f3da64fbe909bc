"""A steady load of concurrent streaming Generate calls against a daemon, recorded token by token.

`StreamLoad(address, prompts)` runs `num_clients` asyncio gRPC clients on a thread of its own;
each sends one greedy request after another (token-id prompts drawn from `prompts`) until
`stop()`. Every request is recorded: its prompt, each response's tokens and weights version,
and the gRPC status it ended with.
"""

from __future__ import annotations

import asyncio
import random
import threading
import time
from dataclasses import dataclass, field

import grpc

from sitsd.api.v1 import inference_pb2 as pb
from sitsd.api.v1 import inference_pb2_grpc
from tests.e2e.daemon_process import LAST_GUARD_S


@dataclass
class Record:
    """One request of the load."""

    prompt: list[int]
    max_tokens: int
    started: float  # time.monotonic() when sent
    tokens: list[tuple[int, str]] = field(default_factory=list)  # (token id, weights version)
    token_times: list[float] = field(default_factory=list)  # time.monotonic() of each token
    status: str = ""  # "OK" or the gRPC status code name
    finish_reason: int = 0

    @property
    def ok(self) -> bool:
        return self.status == "OK" and self.finish_reason == pb.FINISH_REASON_LENGTH

    @property
    def token_ids(self) -> list[int]:
        return [t for t, _ in self.tokens]

    @property
    def versions(self) -> list[str]:
        return [v for _, v in self.tokens]


class StreamLoad:
    """Concurrent streaming clients on their own event loop (see the module docstring)."""

    def __init__(
        self,
        address: str,
        prompts: list[list[int]],
        *,
        num_clients: int = 6,
        max_tokens: tuple[int, int] = (16, 48),
        seed: int | None = None,
    ) -> None:
        self.address = address
        self.prompts = prompts
        self.num_clients = num_clients
        self.max_tokens = max_tokens
        self.records: list[Record] = []
        self._rng = random.Random(seed)
        self._stop = threading.Event()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> StreamLoad:
        self._thread.start()
        return self

    def stop(self, timeout: float = LAST_GUARD_S) -> list[Record]:
        """Let every client finish its request in flight; return all the records."""
        self._stop.set()
        self._thread.join(timeout)
        assert not self._thread.is_alive(), "the load did not stop"
        return self.records

    def in_flight(self, min_tokens: int = 1) -> list[Record]:
        """Requests still streaming that have at least `min_tokens` tokens."""
        return [r for r in list(self.records) if not r.status and len(r.tokens) >= min_tokens]

    def _run(self) -> None:
        self._loop.run_until_complete(self._clients())

    async def _clients(self) -> None:
        async with grpc.aio.insecure_channel(self.address) as channel:
            stub = inference_pb2_grpc.InferenceStub(channel)
            await asyncio.gather(*(self._client(stub) for _ in range(self.num_clients)))

    async def _client(self, stub: inference_pb2_grpc.InferenceStub) -> None:
        while not self._stop.is_set():
            prompt = self._rng.choice(self.prompts)
            record = Record(list(prompt), self._rng.randint(*self.max_tokens), time.monotonic())
            self.records.append(record)
            request = pb.GenerateRequest(
                token_ids=pb.TokenIds(ids=prompt),
                sampling=pb.SamplingParams(max_tokens=record.max_tokens, temperature=0),
                ignore_eos=True,
            )
            try:
                async for response in stub.Generate(request, timeout=LAST_GUARD_S):
                    now = time.monotonic()
                    for token in response.token_ids:
                        record.tokens.append((token, response.weights_version))
                        record.token_times.append(now)
                    record.finish_reason = response.finish_reason
                record.status = "OK"
            except grpc.aio.AioRpcError as exc:
                record.status = exc.code().name
