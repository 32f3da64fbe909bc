"""Proto <-> internal conversions: defaults of unset fields, enums, usage, status."""

from __future__ import annotations

import pytest

from sitsd.api import convert
from sitsd.api.v1 import admin_pb2
from sitsd.api.v1 import inference_pb2 as pb
from sitsd.outputs import EngineStatus
from sitsd.types import FinishReason, RequestDelta, SamplingParams, Tier, Usage


def params_of(request: pb.GenerateRequest, num_prompt_tokens: int = 10) -> SamplingParams:
    return convert.sampling_params_from_proto(
        request, num_prompt_tokens=num_prompt_tokens, max_model_len=100, max_tokens_default=32
    )


def test_unset_sampling_fields_get_the_documented_defaults():
    assert params_of(pb.GenerateRequest()) == SamplingParams(
        max_tokens=32, temperature=1.0, top_k=0, top_p=1.0, seed=None
    )


def test_explicit_zeros_are_kept_not_replaced_by_defaults():
    sampling = pb.SamplingParams(max_tokens=0, temperature=0.0, top_k=0, top_p=0.0, seed=0)
    params = params_of(pb.GenerateRequest(sampling=sampling))
    assert (params.max_tokens, params.temperature, params.top_p, params.seed) == (0, 0.0, 0.0, 0)


@pytest.mark.parametrize(("num_prompt_tokens", "expected"), [(10, 32), (90, 10), (99, 1), (120, 1)])
def test_default_max_tokens_is_capped_by_the_room_in_the_context(num_prompt_tokens, expected):
    assert params_of(pb.GenerateRequest(), num_prompt_tokens).max_tokens == expected


def test_explicit_max_tokens_is_not_capped_so_the_engine_can_refuse_it():
    request = pb.GenerateRequest(sampling=pb.SamplingParams(max_tokens=500))
    assert params_of(request).max_tokens == 500


@pytest.mark.parametrize(
    ("value", "tier"),
    [
        (pb.TIER_UNSPECIFIED, None),
        (pb.TIER_GOLD, Tier.GOLD),
        (pb.TIER_SILVER, Tier.SILVER),
        (pb.TIER_BRONZE, Tier.BRONZE),
        (42, None),
    ],
)
def test_tier_from_proto(value, tier):
    assert convert.tier_from_proto(value) is tier


def test_every_finish_reason_has_a_proto_value():
    assert set(convert.FINISH_REASON_TO_PROTO) == {None, *FinishReason}
    assert len(set(convert.FINISH_REASON_TO_PROTO.values())) == len(FinishReason) + 1


def test_delta_without_usage_leaves_usage_unset():
    response = convert.delta_to_response(
        RequestDelta("r", [5, 6], "ab", weights_version="v"), model="m"
    )
    assert not response.HasField("usage")
    assert (response.request_id, response.text, list(response.token_ids)) == ("r", "ab", [5, 6])
    assert response.finish_reason == pb.FINISH_REASON_UNSPECIFIED


def test_last_delta_carries_finish_reason_and_usage():
    delta = RequestDelta("r", finish_reason=FinishReason.LENGTH, usage=Usage(3, 4, 2))
    response = convert.delta_to_response(delta, model="m")
    assert response.finish_reason == pb.FINISH_REASON_LENGTH
    assert response.usage == pb.Usage(prompt_tokens=3, completion_tokens=4, cached_tokens=2)


def test_status_while_loading_has_state_and_no_engine_counters():
    response = convert.status_response(None, state="loading", uptime_s=1.5, version="9.9")
    assert response == admin_pb2.StatusResponse(
        state=admin_pb2.DAEMON_STATE_LOADING, uptime_s=1.5, version="9.9"
    )


def test_status_carries_every_tier_and_leaves_p99s_without_samples_unset():
    from tests.api.fake_engine import FAKE_TIERS

    status = EngineStatus("m", "v", 0, 0, 0, 1, 16, 0, 0, 0, 0, "tiers", FAKE_TIERS)
    response = convert.status_response(status, state="serving", uptime_s=0.0, version="x")
    assert response.scheduling_policy == "tiers"
    gold, silver, bronze = response.tiers
    assert (gold.tier, gold.batch_cap, gold.num_refused, gold.num_shed) == ("gold", 32, 3, 1)
    assert gold.ttft_p99_s == pytest.approx(0.095)
    assert gold.ttft_p99_target_s == pytest.approx(0.08)
    assert not silver.HasField("ttft_p99_s")
    assert not silver.HasField("itl_p99_s")
    assert (bronze.num_waiting, bronze.num_preempted, bronze.max_queue_wait_s) == (2, 5, 0.5)


def test_status_copies_every_engine_counter():
    status = EngineStatus("m", "v2", 1, 2, 3, 4, 16, 5, 6, 7, 8)
    response = convert.status_response(status, state="serving", uptime_s=0.0, version="x")
    assert response.state == admin_pb2.DAEMON_STATE_SERVING
    assert [
        response.model,
        response.weights_version,
        response.num_running,
        response.num_waiting,
        response.num_blocks_used,
        response.num_blocks_total,
        response.block_size,
        response.prefix_cache_queries,
        response.prefix_cache_hits,
        response.num_preemptions,
        response.num_steps,
    ] == ["m", "v2", 1, 2, 3, 4, 16, 5, 6, 7, 8]
