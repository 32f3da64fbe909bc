"""`sitsctl` as a user runs it: a separate process against a daemon (here a fake engine)."""

from __future__ import annotations

import json
import os
import re
import select
import signal
import subprocess
import threading
import time
from concurrent import futures

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from sitsd.types import SamplingParams, Tier
from tests.api.fake_engine import FakeEngine
from tests.api.harness import ADMIN_TOKEN, MAX_TOKENS_DEFAULT, ServerThread
from tests.api.test_inference import wait_for
from tests.ctl.conftest import ctl_command


def only_request(engine: FakeEngine):
    (recorded,) = engine.requests.values()
    return recorded


def test_generate_prints_exactly_the_streamed_text_and_a_final_newline(engine, run_ctl):
    engine.completion = "It is Paris."

    result = run_ctl("generate", "The capital of France?")

    assert result.returncode == 0, result.stderr
    assert result.stdout == "It is Paris.\n"
    assert result.stderr == ""
    assert only_request(engine).prompt_token_ids[1:] == [ord(c) for c in "The capital of France?"]


def test_generate_adds_no_newline_when_the_text_ends_with_one(engine, run_ctl):
    engine.completion = "one line\n"
    result = run_ctl("generate", "x")
    assert result.stdout == "one line\n"


def test_generate_sends_every_sampling_flag(engine, run_ctl):
    result = run_ctl(
        "generate",
        "--max-tokens",
        "3",
        "--temperature",
        "0",
        "--top-p",
        "0.5",
        "--top-k",
        "4",
        "--seed",
        "7",
        "--stop",
        "X",
        "--stop",
        "YZ",
        "--ignore-eos",
        "--tier",
        "gold",
        "prompt",
    )

    assert result.returncode == 0, result.stderr
    assert result.stdout == engine.completion[:3] + "\n"
    recorded = only_request(engine)
    assert recorded.params == SamplingParams(
        max_tokens=3, temperature=0.0, top_k=4, top_p=0.5, seed=7, stop=("X", "YZ"), ignore_eos=True
    )
    assert recorded.tier is Tier.GOLD


def test_generate_without_flags_leaves_the_defaults_to_the_daemon(engine, run_ctl):
    run_ctl("generate", "prompt")
    assert only_request(engine).params == SamplingParams(max_tokens=MAX_TOKENS_DEFAULT)
    assert only_request(engine).tier is None


def test_verbose_reports_on_stderr_only(engine, run_ctl):
    plain = run_ctl("generate", "hi")
    verbose = run_ctl("generate", "--verbose", "hi")

    assert verbose.returncode == 0, verbose.stderr
    assert verbose.stdout == plain.stdout == engine.completion + "\n"
    report = verbose.stderr
    assert "request_id: fake-1" in report
    assert "weights: fake-v1" in report
    assert "finish_reason: stop" in report
    assert f"usage: prompt 3, completion {len(engine.completion)}, cached 0 tokens" in report
    assert "ttft: " in report
    assert "tokens/s" in report


def test_chat_goes_through_the_chat_template(engine, run_ctl):
    result = run_ctl("chat", "--system", "Be terse.", "--max-tokens", "4", "Hi!")

    assert result.returncode == 0, result.stderr
    assert result.stdout == engine.completion[:4] + "\n"
    assert engine.tokenizer.rendered == ["<system>Be terse.\n<user>Hi!\n<assistant>"]


def test_bad_input_exits_1_with_the_status_and_the_field(engine, run_ctl):
    result = run_ctl("generate", "--top-p", "1.5", "x")

    assert result.returncode == 1
    assert result.stdout == ""
    assert result.stderr == "sitsctl: error: INVALID_ARGUMENT: top_p: must be in (0, 1], got 1.5\n"


def test_unknown_model_exits_1_with_not_found(engine, run_ctl):
    result = run_ctl("generate", "--model", "nope", "x")
    assert result.returncode == 1
    assert result.stderr.startswith("sitsctl: error: NOT_FOUND: model: 'nope'")


def test_failure_mid_stream_keeps_the_text_and_reports_the_error(engine, run_ctl):
    engine.fail_after = 3

    result = run_ctl("generate", "x")

    assert result.returncode == 1
    assert result.stdout == engine.completion[:3] + "\n"
    assert result.stderr == "sitsctl: error: INTERNAL: fake model step failed\n"


def test_unreachable_daemon_exits_1_with_a_clear_message(ctl_env):
    result = subprocess.run(
        ctl_command("127.0.0.1:1", "models"),
        capture_output=True,
        text=True,
        env=ctl_env,
        timeout=60,
    )
    assert result.returncode == 1
    assert result.stdout == ""
    assert result.stderr.startswith("sitsctl: error: cannot reach sitsd at 127.0.0.1:1")
    assert result.stderr.count("\n") == 1


def test_status_is_human_readable_with_the_token_file(engine, run_ctl, token_file):
    result = run_ctl("--token-file", str(token_file), "status")

    assert result.returncode == 0, result.stderr
    lines = dict(re.split(r"\s{2,}", line, maxsplit=1) for line in result.stdout.splitlines())
    assert lines["state"] == "serving"
    assert lines["model"] == "fake-model"
    assert lines["weights version"] == "fake-v1"
    assert lines["requests"] == "0 running, 0 waiting"
    assert lines["kv cache"] == "0/128 blocks used (0.0%), 4 tokens per block"
    assert lines["prefix cache"] == "4/10 prompt tokens hit (40.0%)"
    assert lines["scheduling"] == "tiers"
    assert lines["tier gold"] == (
        "cap 32, 1 running, 0 waiting, TTFT P99 95/80 ms, ITL P99 41/80 ms, "
        "refused 3, shed 1, preempted 0"
    )
    assert lines["tier bronze"].startswith("cap 4, 0 running, 2 waiting, TTFT P99 -/1000 ms")


def test_status_json_has_every_field_as_numbers(engine, run_ctl, ctl_env):
    env = {**ctl_env, "SITSD_ADMIN_TOKEN": ADMIN_TOKEN}
    result = run_ctl("status", "--json", env=env)

    assert result.returncode == 0, result.stderr
    status = json.loads(result.stdout)
    assert status["state"] == "DAEMON_STATE_SERVING"
    assert status["num_blocks_total"] == 128
    assert status["num_steps"] == 7
    assert status["prefix_cache_queries"] == 10
    assert [t["tier"] for t in status["tiers"]] == ["gold", "silver", "bronze"]
    assert status["tiers"][0]["ttft_p99_s"] == 0.095
    assert "ttft_p99_s" not in status["tiers"][1]  # no samples: unset, not a fake zero


def test_status_uses_the_default_token_file_in_the_state_dir(engine, run_ctl, ctl_env):
    state_dir = ctl_env["SITSD_STATE_DIR"]
    os.makedirs(state_dir)
    with open(os.path.join(state_dir, "admin-token"), "w") as f:
        f.write(ADMIN_TOKEN)
    assert run_ctl("status").returncode == 0


def test_status_without_a_token_says_where_it_looked(engine, run_ctl, ctl_env):
    result = run_ctl("status")
    assert result.returncode == 1
    assert "cannot read the admin token from" in result.stderr
    assert ctl_env["SITSD_STATE_DIR"] in result.stderr


def test_status_with_a_wrong_token_is_unauthenticated(engine, run_ctl, tmp_path):
    wrong = tmp_path / "wrong"
    wrong.write_text("not-the-token")
    result = run_ctl("--token-file", str(wrong), "status")
    assert result.returncode == 1
    assert result.stderr.startswith("sitsctl: error: UNAUTHENTICATED: ")


def test_models_lists_the_served_model(engine, run_ctl):
    table = run_ctl("models")
    assert table.returncode == 0, table.stderr
    header, row = table.stdout.splitlines()
    assert header.split() == [
        "NAME",
        "MAX_MODEL_LEN",
        "VOCAB_SIZE",
        "ARCHITECTURE",
        "DTYPE",
        "DEVICE",
    ]
    assert row.split() == ["fake-model", "64", "512", "llama", "float32", "cpu"]

    as_json = json.loads(run_ctl("models", "--json").stdout)
    assert as_json["models"][0]["max_model_len"] == 64


def test_tokenize_prints_the_token_ids(engine, run_ctl):
    assert run_ctl("tokenize", "ab").stdout == "1 97 98\n"
    assert json.loads(run_ctl("tokenize", "--json", "ab").stdout) == {
        "token_ids": [1, 97, 98],
        "num_tokens": 3,
    }


def test_ctrl_c_during_generate_cancels_the_request(server, engine, ctl_env):
    engine.stall_after = 2
    proc = subprocess.Popen(
        ctl_command(server.address, "generate", "x"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=ctl_env,
    )
    try:
        deadline = time.monotonic() + 300  # a last guard: sitsctl starts slowly on a busy CPU
        received = b""
        while len(received) < 2:  # the first two tokens' text has arrived: the call is live
            assert time.monotonic() < deadline, "no output from sitsctl"
            if select.select([proc.stdout], [], [], 0.1)[0]:
                received += os.read(proc.stdout.fileno(), 100)

        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=300)
    finally:
        proc.kill()

    assert proc.returncode == 130
    assert (received + stdout).decode() == "He\n"
    assert stderr.decode() == "sitsctl: interrupted\n"
    wait_for(lambda: len(engine.aborts) == 1)
    assert list(engine.aborts.values()) == ["cancelled by the client"]


def test_negative_counts_are_refused_before_sending(engine, run_ctl):
    result = run_ctl("generate", "--max-tokens", "-1", "x")
    assert result.returncode == 2
    assert "--max-tokens: must be >= 0, got -1" in result.stderr
    assert engine.requests == {}


def test_max_tokens_zero_reaches_the_daemon_which_names_the_field(engine, run_ctl):
    result = run_ctl("generate", "--max-tokens", "0", "x")
    assert result.returncode == 1
    assert result.stderr.startswith("sitsctl: error: INVALID_ARGUMENT: max_tokens: ")


def test_health_prints_serving_and_exits_0(engine, run_ctl):
    result = run_ctl("health")
    assert (result.returncode, result.stdout) == (0, "SERVING\n")
    result = run_ctl("health", "--service", "sitsd.api.v1.Inference")
    assert (result.returncode, result.stdout) == (0, "SERVING\n")


def test_health_while_loading_is_not_serving_and_exits_1(ctl_env):
    loading = ServerThread()
    try:
        started = time.monotonic()
        result = subprocess.run(
            ctl_command(loading.address, "health", "--wait", "0.5"),
            capture_output=True,
            text=True,
            env=ctl_env,
            timeout=60,
        )
        assert time.monotonic() - started >= 0.5  # it kept checking for the whole wait
        assert (result.returncode, result.stdout) == (1, "NOT_SERVING\n")
    finally:
        loading.stop()


def test_health_wait_returns_once_the_model_is_warm(ctl_env):
    loading = ServerThread()
    try:
        proc = subprocess.Popen(
            ctl_command(loading.address, "health", "--wait", "60"),
            stdout=subprocess.PIPE,
            text=True,
            env=ctl_env,
        )
        loading.attach(FakeEngine())
        stdout, _ = proc.communicate(timeout=60)
        assert (proc.returncode, stdout) == (0, "SERVING\n")
    finally:
        loading.stop()


def test_health_of_an_unknown_service_is_not_found(engine, run_ctl):
    result = run_ctl("health", "--wait", "30", "--service", "no.Such")
    assert result.returncode == 1
    assert result.stderr.startswith("sitsctl: error: NOT_FOUND")


class StalledHealth(health_pb2_grpc.HealthServicer):
    """A daemon whose event loop is stalled: Check answers only once released."""

    def __init__(self) -> None:
        self.calls = 0
        self.released = threading.Event()

    def Check(self, request, context):
        self.calls += 1
        self.released.wait(60)
        return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)


def test_health_wait_retries_a_check_that_hit_its_deadline(ctl_env):
    health = StalledHealth()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        proc = subprocess.Popen(
            ctl_command(f"127.0.0.1:{port}", "--timeout", "0.3", "health", "--wait", "120"),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=ctl_env,
        )
        deadline = time.monotonic() + 60
        while health.calls < 2:  # the first check ran past its deadline, and was tried again
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline
            time.sleep(0.05)
        health.released.set()
        stdout, stderr = proc.communicate(timeout=60)
        assert (proc.returncode, stdout) == (0, "SERVING\n"), stderr
    finally:
        health.released.set()
        server.stop(0)
