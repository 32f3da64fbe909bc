"""Pure conversions between the `sitsd.api.v1` proto messages and `sitsd.types`.

No I/O, no engine, no gRPC context: each function maps values and fills proto defaults. Range
checks stay with the engine (`sitsd.engine.validation`), which names the field it rejects;
which gRPC status an error becomes is `sitsd.api.interceptors`' business.
"""

from __future__ import annotations

from sitsd.api.v1 import admin_pb2, inference_pb2
from sitsd.engine.validation import default_max_tokens
from sitsd.outputs import EngineStatus, ModelInfo, TierStats
from sitsd.types import FinishReason, RequestDelta, SamplingParams, Tier
from sitsd.weights.progress import SwapProgress
from sitsd.weights.versions import VersionState, WeightVersion

TIER_FROM_PROTO: dict[int, Tier | None] = {
    inference_pb2.TIER_UNSPECIFIED: None,
    inference_pb2.TIER_GOLD: Tier.GOLD,
    inference_pb2.TIER_SILVER: Tier.SILVER,
    inference_pb2.TIER_BRONZE: Tier.BRONZE,
}
TIER_TO_PROTO: dict[Tier | None, int] = {tier: value for value, tier in TIER_FROM_PROTO.items()}

FINISH_REASON_TO_PROTO: dict[FinishReason | None, inference_pb2.FinishReason] = {
    None: inference_pb2.FINISH_REASON_UNSPECIFIED,
    FinishReason.STOP: inference_pb2.FINISH_REASON_STOP,
    FinishReason.LENGTH: inference_pb2.FINISH_REASON_LENGTH,
    FinishReason.ABORT: inference_pb2.FINISH_REASON_ABORT,
    FinishReason.ERROR: inference_pb2.FINISH_REASON_ERROR,
}

DAEMON_STATE_TO_PROTO: dict[str, admin_pb2.DaemonState] = {
    "loading": admin_pb2.DAEMON_STATE_LOADING,
    "serving": admin_pb2.DAEMON_STATE_SERVING,
    "draining": admin_pb2.DAEMON_STATE_DRAINING,
}

POLICY_FROM_PROTO: dict[int, str] = {
    admin_pb2.SWAP_POLICY_UNSPECIFIED: "",  # the daemon's default
    admin_pb2.SWAP_POLICY_MIGRATE: "migrate",
    admin_pb2.SWAP_POLICY_DRAIN: "drain",
    admin_pb2.SWAP_POLICY_RESTART: "restart",
}

VERSION_STATE_TO_PROTO: dict[VersionState, admin_pb2.VersionState] = {
    VersionState.STAGED: admin_pb2.VERSION_STATE_STAGED,
    VersionState.VALIDATED: admin_pb2.VERSION_STATE_VALIDATED,
    VersionState.ACTIVE: admin_pb2.VERSION_STATE_ACTIVE,
    VersionState.RETIRED: admin_pb2.VERSION_STATE_RETIRED,
    VersionState.REJECTED: admin_pb2.VERSION_STATE_REJECTED,
}

# The proto defaults of unset sampling fields (documented in inference.proto).
DEFAULT_TEMPERATURE = 1.0
DEFAULT_TOP_P = 1.0
DEFAULT_TOP_K = 0


def tier_from_proto(value: int) -> Tier | None:
    """`Tier` of a proto enum value; None (the daemon's default) for unspecified or unknown."""
    # An enum value this daemon does not know (a newer client) falls back to the default tier
    # rather than failing the request: tiers are a scheduling hint.
    return TIER_FROM_PROTO.get(value)


def sampling_params_from_proto(
    request: inference_pb2.GenerateRequest,
    *,
    num_prompt_tokens: int,
    max_model_len: int,
    max_tokens_default: int,
) -> SamplingParams:
    """Build the engine's `SamplingParams` from a `GenerateRequest`, filling unset fields.

    An unset `max_tokens` becomes `max_tokens_default` capped by the room left in the context, so
    a long prompt with no explicit limit still runs. Values are not range-checked here.

    Args:
        request: the client's request.
        num_prompt_tokens: length of the tokenized prompt.
        max_model_len: the model's context length.
        max_tokens_default: the daemon's default completion length.
    """
    sampling = request.sampling
    if sampling.HasField("max_tokens"):
        max_tokens = sampling.max_tokens
    else:
        max_tokens = default_max_tokens(num_prompt_tokens, max_model_len, max_tokens_default)
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=(
            sampling.temperature if sampling.HasField("temperature") else DEFAULT_TEMPERATURE
        ),
        top_k=sampling.top_k if sampling.HasField("top_k") else DEFAULT_TOP_K,
        top_p=sampling.top_p if sampling.HasField("top_p") else DEFAULT_TOP_P,
        seed=sampling.seed if sampling.HasField("seed") else None,
        stop=tuple(request.stop),
        stop_token_ids=tuple(request.stop_token_ids),
        ignore_eos=request.ignore_eos,
    )


def chat_messages_from_proto(chat: inference_pb2.ChatMessages) -> list[dict[str, str]]:
    """The conversation in the form chat templates take: `[{"role": ..., "content": ...}]`."""
    return [{"role": m.role, "content": m.content} for m in chat.messages]


def delta_to_response(delta: RequestDelta, *, model: str) -> inference_pb2.GenerateResponse:
    """One `GenerateResponse` for one engine delta; usage only when the delta carries it."""
    response = inference_pb2.GenerateResponse(
        request_id=delta.req_id,
        text=delta.text,
        token_ids=delta.new_token_ids,
        finish_reason=FINISH_REASON_TO_PROTO[delta.finish_reason],
        weights_version=delta.weights_version,
        model=model,
    )
    if delta.usage is not None:
        response.usage.prompt_tokens = delta.usage.prompt_tokens
        response.usage.completion_tokens = delta.usage.completion_tokens
        response.usage.cached_tokens = delta.usage.cached_tokens
    return response


def model_card(info: ModelInfo) -> inference_pb2.ModelCard:
    """What `ListModels` says about the served model."""
    return inference_pb2.ModelCard(
        name=info.name,
        max_model_len=info.max_model_len,
        vocab_size=info.vocab_size,
        architecture=info.architecture,
        dtype=info.dtype,
        device=info.device,
    )


def status_response(
    status: EngineStatus | None, *, state: str, uptime_s: float, version: str
) -> admin_pb2.StatusResponse:
    """`Admin.Status`'s answer; `status` is None while the model loads (counters stay zero).

    Args:
        status: the engine's snapshot, or None when there is no engine yet.
        state: "loading", "serving" or "draining".
        uptime_s: seconds since the daemon started.
        version: the sitsd version.
    """
    response = admin_pb2.StatusResponse(
        state=DAEMON_STATE_TO_PROTO[state], uptime_s=uptime_s, version=version
    )
    if status is not None:
        response.model = status.model
        response.weights_version = status.weights_version
        response.num_running = status.num_running
        response.num_waiting = status.num_waiting
        response.num_blocks_used = status.num_blocks_used
        response.num_blocks_total = status.num_blocks_total
        response.block_size = status.block_size
        response.prefix_cache_queries = status.prefix_cache_queries
        response.prefix_cache_hits = status.prefix_cache_hits
        response.num_preemptions = status.num_preemptions
        response.num_steps = status.num_steps
        response.scheduling_policy = status.scheduling_policy
        response.tiers.extend(tier_status(t) for t in status.tiers)
        if status.active_slot < len(status.slot_precisions):
            response.weights_precision = status.slot_precisions[status.active_slot]
            response.weight_bytes = status.slot_weight_bytes[status.active_slot]
    return response


def tier_status(stats: TierStats) -> admin_pb2.TierStatus:
    """One tier of `Admin.Status`; P99s stay unset while the window is empty."""
    message = admin_pb2.TierStatus(
        tier=stats.tier,
        ttft_p99_target_s=stats.ttft_p99_target_s,
        itl_p99_target_s=stats.itl_p99_target_s,
        max_queue_wait_s=stats.max_queue_wait_s,
        batch_cap=stats.batch_cap,
        num_running=stats.num_running,
        num_waiting=stats.num_waiting,
        num_samples=stats.num_samples,
        num_refused=stats.num_refused,
        num_shed=stats.num_shed,
        num_preempted=stats.num_preempted,
    )
    if stats.ttft_p99_s is not None:
        message.ttft_p99_s = stats.ttft_p99_s
    if stats.itl_p99_s is not None:
        message.itl_p99_s = stats.itl_p99_s
    return message


def policy_from_proto(value: int) -> str:
    """The swap policy name of a proto enum value ("" = the daemon's default)."""
    return POLICY_FROM_PROTO.get(value, "")


def swap_progress(progress: SwapProgress) -> admin_pb2.SwapProgress:
    """One message of a Deploy / Swap / Rollback stream."""
    message = admin_pb2.SwapProgress(
        stage=progress.stage,
        version=progress.version,
        bytes_done=progress.bytes_done,
        bytes_total=progress.bytes_total,
        message=progress.message,
        policy=progress.policy,
        num_migrating=progress.num_migrating,
        num_caught_up=progress.num_caught_up,
        num_restarted=progress.num_restarted,
        num_draining=progress.num_draining,
        pause_ms=progress.pause_s * 1e3,
        flip_ms=progress.flip_s * 1e3,
    )
    if progress.canary_kl >= 0:
        message.canary_kl = progress.canary_kl
        message.canary_ppl_ratio = progress.canary_ppl_ratio
    return message


def weight_version(record: WeightVersion, slot: str) -> admin_pb2.WeightVersion:
    """One version of `ListVersions`; `slot` is "active", "standby" or ""."""
    return admin_pb2.WeightVersion(
        version=record.version,
        path=record.path,
        state=VERSION_STATE_TO_PROTO[record.state],
        reason=record.reason,
        manifest_sha256=record.manifest_digest,
        source=record.source,
        created_at=record.created_at,
        updated_at=record.updated_at,
        active=record.state is VersionState.ACTIVE,
        slot=slot,
        precision=record.precision,
        weight_bytes=record.weight_bytes,
    )
