"""The slime hooks. Point slime at them by dotted path (see deploy/slime/README.md):

    --custom-generate-function-path       swerl.trainer_plugin.generate
    --custom-rm-path                      swerl.trainer_plugin.reward_func
    --custom-rollout-log-function-path    swerl.trainer_plugin.log_rollout_data
    --dynamic-sampling-filter-path        swerl.trainer_plugin.filter_infra_failures
    --custom-reward-post-process-path     swerl.trainer_plugin.post_process_rewards

`generate` is a thin client: one `RunEpisode` stream per call to an agent service, which does
the work (sandbox, policy turns, evaluation, reward). Nothing here imports slime.
"""

from __future__ import annotations

import asyncio
import copy
import uuid
from collections.abc import Mapping
from typing import Any

import structlog
from google.protobuf import struct_pb2

from swerl.agent.v1 import agent_pb2
from swerl.chassis.timeconv import duration_pb
from swerl.trainer_plugin import convert, metrics, rewards, slime_glue
from swerl.trainer_plugin.episode import AgentDirectory, EpisodeOutcome, run_episode
from swerl.trainer_plugin.instance import InstanceError, sample_instance
from swerl.trainer_plugin.settings import PluginSettings, plugin_settings

INVALID_INSTANCE = "INVALID_INSTANCE"

_log = structlog.get_logger("swerl.trainer_plugin")


class PluginConfigError(ValueError):
    """slime's arguments or the plugin settings cannot describe an episode (a setup mistake)."""


async def generate(
    args: Any, sample: Any, sampling_params: dict[str, Any], evaluation: bool = False
) -> Any:
    """Runs one agent episode for `sample` and returns its training sample(s).

    Returns one Sample in whole-trajectory mode and always a list in dynamic-history mode
    (`swerl_dynamic_history` / `SWERL_PLUGIN_DYNAMIC_HISTORY`), never a mix. Evaluation calls
    always return one Sample per episode, so eval rewards count episodes, not turns. The
    sample passed in and `sampling_params` are left untouched.
    """
    settings = plugin_settings(args)
    per_turn = settings.dynamic_history and not evaluation
    episode_id = new_episode_id(sample)
    try:
        start = build_start(
            args,
            sample,
            copy.deepcopy(sampling_params),
            settings,
            episode_id=episode_id,
            per_turn=per_turn,
            evaluation=evaluation,
        )
    except InstanceError as err:
        outcome = EpisodeOutcome(
            episode_id=episode_id,
            address="",
            failure_reason=INVALID_INSTANCE,
            failure_message=str(err),
        )
    else:
        outcome = await run_episode(
            start, agent_directory(settings), settings, slime_glue.abort_requested
        )
    _log_outcome(outcome)
    decode = _decoder(settings)
    # Cloning samples and decoding long responses is CPU work: keep it off slime's event loop.
    return await asyncio.to_thread(
        convert.outcome_to_samples, sample, outcome, per_turn=per_turn, decode=decode
    )


def _log_outcome(outcome: EpisodeOutcome) -> None:
    result = outcome.result
    if result is None:
        _log.warning(
            "episode.no_result",
            episode_id=outcome.episode_id,
            agent=outcome.address,
            reason=outcome.failure_reason,
            detail=outcome.failure_message,
            cancelled_by=outcome.cancelled_by,
            elapsed_s=round(outcome.elapsed_s, 3),
        )
    elif result.status == agent_pb2.EPISODE_STATUS_INFRA_ERROR:
        _log.warning(
            "episode.infra_error",
            episode_id=outcome.episode_id,
            agent=outcome.address,
            reason=result.error_reason,
            detail=result.error_message,
            elapsed_s=round(outcome.elapsed_s, 3),
        )


async def reward_func(args: Any, sample_or_samples: Any, **kwargs: Any) -> Any:
    """The reward `generate` already set (slime calls this only for samples without one).

    Accepts one sample or a list (when generate returned lists) and answers in kind.
    """
    if isinstance(sample_or_samples, (list, tuple)):
        return [await reward_func(args, s, **kwargs) for s in sample_or_samples]
    sample = sample_or_samples
    if sample.reward is not None:
        return sample.reward
    stored = (sample.metadata or {}).get(convert.REWARD)
    return float(stored) if stored is not None else 0.0


def log_rollout_data(
    rollout_id: int,
    args: Any,
    samples: Any,
    rollout_extra_metrics: dict[str, Any] | None,
    rollout_time: float,
) -> bool:
    """Adds the `agent/*` metrics to slime's rollout metrics; slime then logs as usual."""
    if rollout_extra_metrics is not None:
        rollout_extra_metrics.update(metrics.agent_metrics(samples))
    return False


def filter_infra_failures(args: Any, samples: Any, **kwargs: Any) -> Any:
    """Dynamic-sampling filter: drops a prompt group holding an infra failure or an aborted
    episode, whose reward says nothing about the policy (the group is resampled)."""
    flat = metrics.flatten(samples)
    if any((s.metadata or {}).get(convert.INFRA_ERROR) for s in flat):
        return slime_glue.dynamic_filter_output(keep=False, reason="swerl_infra_error")
    aborted = slime_glue.status(flat[0], "ABORTED") if flat else None
    if any(s.status == aborted or getattr(s, "remove_sample", False) for s in flat):
        return slime_glue.dynamic_filter_output(keep=False, reason="swerl_aborted")
    return slime_glue.dynamic_filter_output(keep=True, reason=None)


def post_process_rewards(args: Any, samples: Any) -> tuple[list[float], list[float]]:
    """GRPO normalisation per prompt group with each episode counted once (see rewards.py)."""
    return rewards.normalise(args, samples)


# -- building the start request ------------------------------------------------------------


def new_episode_id(sample: Any) -> str:
    group = getattr(sample, "group_index", None)
    index = getattr(sample, "index", None)
    return f"g{group}-s{index}-{uuid.uuid4().hex[:12]}"


def build_start(
    args: Any,
    sample: Any,
    sampling_params: dict[str, Any],
    settings: PluginSettings,
    *,
    episode_id: str,
    per_turn: bool,
    evaluation: bool = False,
) -> agent_pb2.EpisodeStart:
    """The `start` message of one episode. Raises InstanceError for unusable sample metadata
    and PluginConfigError when slime's arguments lack the policy endpoint or tokenizer."""
    instance = sample_instance(sample.metadata, sample.prompt)
    params = struct_pb2.Struct()
    params.update(_jsonable({k: v for k, v in sampling_params.items() if v is not None}))
    context = settings.max_context_tokens or int(getattr(args, "rollout_max_context_len", 0) or 0)
    phase = "eval" if evaluation else "train"
    return agent_pb2.EpisodeStart(
        episode_id=episode_id,
        instance=instance,
        policy=agent_pb2.PolicyConfig(
            endpoint=policy_endpoint(args, settings),
            api=agent_pb2.POLICY_API_SGLANG_GENERATE,
            model=settings.policy_model,
            tokenizer_path=tokenizer_path(args, settings),
            sampling_params=params,
        ),
        limits=agent_pb2.EpisodeLimits(
            max_turns=settings.max_turns,
            max_context_tokens=context,
            max_new_tokens=settings.max_new_tokens,
            wall_timeout=_duration(settings.wall_timeout_s),
            command_timeout=_duration(settings.command_timeout_s),
            eval_timeout=_duration(settings.eval_timeout_s),
        ),
        prm=agent_pb2.PrmConfig(
            enabled=settings.prm_enabled,
            endpoint=settings.prm_endpoint,
            m=settings.prm_m,
            coef=settings.prm_coef,
            seed=settings.prm_seed,
        ),
        options=agent_pb2.EpisodeOptions(
            dynamic_history=per_turn,
            artifact_dir=settings.artifact_dir,
            config_name=settings.config_name,
            owner=f"{settings.owner_prefix}/{phase}/group-{getattr(sample, 'group_index', None)}",
        ),
    )


def policy_endpoint(args: Any, settings: PluginSettings) -> str:
    if settings.policy_endpoint:
        return settings.policy_endpoint
    ip = getattr(args, "sglang_router_ip", None)
    port = getattr(args, "sglang_router_port", None)
    if not ip or not port:
        raise PluginConfigError(
            "no policy endpoint: slime's sglang_router_ip/port are unset and so is "
            "swerl_policy_endpoint / SWERL_PLUGIN_POLICY_ENDPOINT"
        )
    return f"http://{ip}:{port}"


def tokenizer_path(args: Any, settings: PluginSettings) -> str:
    path = settings.tokenizer_path or str(getattr(args, "hf_checkpoint", "") or "")
    if not path:
        raise PluginConfigError(
            "no tokenizer: slime's hf_checkpoint is unset and so is swerl_tokenizer_path"
        )
    return path


_directories: dict[tuple[Any, ...], AgentDirectory] = {}


def agent_directory(settings: PluginSettings) -> AgentDirectory:
    """One directory per distinct agent configuration, shared by every generate call, so the
    in-flight counts that spread episodes cover all of this process's episodes."""
    token = settings.agent_token.get_secret_value() if settings.agent_token else None
    key = (
        tuple(settings.agent_addresses),
        token,
        settings.agent_tls_ca_file,
        settings.max_receive_message_bytes,
    )
    directory = _directories.get(key)
    if directory is None:
        directory = _directories[key] = AgentDirectory(settings.agent_addresses, settings)
    return directory


def _decoder(settings: PluginSettings) -> convert.Decoder | None:
    tokenizer = slime_glue.slime_tokenizer() if settings.decode_response_text else None
    if tokenizer is None:
        return None
    return lambda ids: tokenizer.decode(ids)


def _duration(seconds: float) -> Any:
    return duration_pb(seconds) if seconds > 0 else None


def _jsonable(value: Any) -> Any:
    """Sampling params as plain JSON types (numpy scalars and tuples do occur)."""
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if hasattr(value, "item") and callable(value.item):
        return value.item()
    return value
