"""An episode's outcome as slime samples, obeying every invariant slime's trainer relies on.

Whole-trajectory mode gives one sample per chain (services/agent/policy/tokens.py): the chain's
first prompt, then every response (mask 1, the policy's logprobs) and observation (mask 0, logprob
0.0). An untrimmed episode is one chain and one sample; after a context trim the episode is a
list of samples, each exactly what the policy saw and sampled, each with the episode's reward
(evaluation takes the last chain alone: an eval call must give one sample). Dynamic-history mode
gives one sample per turn: the exact prompt the policy saw that turn and that turn's response.
Every sample has `tokens == prompt + response`, `len(loss_mask) == len(rollout_log_probs) ==
response_length >= 1`, a prompt of at least one token, and a reward.

`Sample.rollout_id` is set only on the samples of a returned list of two or more, all alike: both
frameworks require siblings to share one (slime observability/rollout_data_utils.py:92-121,
miles ray/rollout/rollout_data_conversion.py:54-72), and miles treats any batch carrying one as
compact and then computes no dynamic global batch size (rollout_data_conversion.py:30-41), which
`--use-dynamic-global-batch-size` and multi-LoRA assert on (train_data_conversion.py:154-155).
A lone sample leaves it None (slime then assigns a fresh id, ray/rollout.py:647-656). The
episode's id for swerl's own grouping is always in `metadata["rollout_id"]`.

Status mapping: SUBMITTED and SANDBOX_BROKEN (the policy broke its sandbox, reward -1) →
COMPLETED, as is HARNESS_FAILED (graded on its sandbox); LIMIT_* and HARNESS_TIMEOUT →
TRUNCATED; CANCELLED / ABORTED → ABORTED with reward 0.0 (slime computes no reward for ABORTED
samples but the trainer needs one); INFRA_ERROR, and any outcome without a
usable trajectory or reward → one placeholder with `remove_sample=True`, reward 0.0,
`loss_mask=[0]` and `metadata["infra_error"] = True`, for the dynamic-sampling filter to drop its
group. Infra failures are never scored as wrong answers.

Replay (replay.py): with top-p replay every sample, placeholders included, carries
`rollout_top_p_token_ids/offsets` (the records' own, or empty spans); with routing replay every
sample carries `rollout_routed_experts`, and a trainable record without them stops the run with
an error naming the flag (every chain's last call routed the whole chain, so a trimmed episode
has them too).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any

from google.protobuf import json_format

from swerl.agent.v1 import agent_pb2
from swerl.trainer_plugin import framework, replay
from swerl.trainer_plugin.episode import EpisodeOutcome
from swerl.trainer_plugin.replay import ReplaySpec

# Token of placeholder samples. Any valid id does: a placeholder is never trained on.
PLACEHOLDER_TOKEN_ID = 0

S = agent_pb2.EpisodeStatus
_SLIME_STATUS = {
    S.EPISODE_STATUS_SUBMITTED: "COMPLETED",
    S.EPISODE_STATUS_LIMIT_TURNS: "TRUNCATED",
    S.EPISODE_STATUS_LIMIT_CONTEXT: "TRUNCATED",
    S.EPISODE_STATUS_LIMIT_TIME: "TRUNCATED",
    S.EPISODE_STATUS_CANCELLED: "ABORTED",
    S.EPISODE_STATUS_ABORTED: "ABORTED",
    # The policy's own command broke its sandbox: a failed attempt (reward -1), trained on.
    S.EPISODE_STATUS_SANDBOX_BROKEN: "COMPLETED",
    # A harness (EpisodeOptions.harness) that failed on its own: graded on its sandbox, trained
    # on like a submission; one that outlived its budget: cut short, like LIMIT_TIME.
    S.EPISODE_STATUS_HARNESS_FAILED: "COMPLETED",
    S.EPISODE_STATUS_HARNESS_TIMEOUT: "TRUNCATED",
}

# Metadata keys the plugin writes on every sample (the filter, metrics and post-process read
# them; they are also what a researcher finds in slime's debug dumps).
EPISODE_ID = "episode_id"
ROLLOUT_ID = "rollout_id"
EPISODE_STATUS = "episode_status"
INFRA_ERROR = "infra_error"
OUTCOME_REWARD = "outcome_reward"
REWARD = "reward"
AGENT_METRICS = "agent_metrics"
EVAL_REPORT = "eval_report"
PATCH = "patch"
ARTIFACT_DIR = "artifact_dir"
ERROR_REASON = "error_reason"
ERROR_MESSAGE = "error_message"
TURN_INDEX = "turn_index"
NUM_TURNS = "num_turns"
PRM_SCORES = "prm_scores"
AGENT_ADDRESS = "agent_address"
CANCELLED_BY = "cancelled_by"
# Branching rollouts (branching.py): the branch a sample comes from, its sampling seed, the
# turn of the fork, the id of the group's one episode, and whether the sample is one of the
# trunk's shared turns (dynamic history emits those once per group).
BRANCH = "branch"
SAMPLING_SEED = "sampling_seed"
# Whether the engine honoured sampling_seed: SGLang samples by the seed only with deterministic
# inference on (slime/miles `--sglang-enable-deterministic-inference`); otherwise the seed was
# sent but the sample is not reproducible from it.
SAMPLING_SEED_EFFECTIVE = "sampling_seed_effective"
BRANCH_AT_TURN = "branch_at_turn"
BRANCH_EPISODE_ID = "branch_episode_id"
BRANCH_TRUNK = "branch_trunk"

# Failure reason of a group member whose branch never ran because the trunk was cancelled or
# aborted before the fork: an aborted sample, not an infra failure.
TRUNK_CANCELLED = "TRUNK_CANCELLED_BEFORE_FORK"

Decoder = Callable[[list[int]], str]


def status_name(status: int) -> str:
    return agent_pb2.EpisodeStatus.Name(status).removeprefix("EPISODE_STATUS_")


def outcome_to_samples(
    template: Any,
    outcome: EpisodeOutcome,
    *,
    per_turn: bool,
    decode: Decoder | None = None,
    spec: ReplaySpec | None = None,
    chains: bool = True,
) -> Any:
    """The samples of one episode: a list when `per_turn`, else one sample per chain (a list
    when there are several; with `chains` False, as evaluation wants, the last chain alone).

    `template` is the sample slime passed to generate; it is never modified (every returned
    sample is a clone), so its prompt, label, indices and dataset metadata carry over. Raises
    RoutingReplayError when `spec` asks for routed experts a trainable record lacks.
    """
    spec = spec or ReplaySpec()
    result = outcome.result
    if result is None:
        aborted = outcome.cancelled_by == "abort" or outcome.failure_reason == TRUNK_CANCELLED
        failure = (outcome.failure_reason, outcome.failure_message)
        samples = [_placeholder(template, outcome, *failure, aborted=aborted, spec=spec)]
        return samples if per_turn else samples[0]
    if result.status == S.EPISODE_STATUS_INFRA_ERROR or result.status not in _SLIME_STATUS:
        reason = result.error_reason or f"EPISODE_{status_name(result.status)}"
        failure = (reason, result.error_message)
        samples = [_placeholder(template, outcome, *failure, aborted=False, spec=spec)]
        return samples if per_turn else samples[0]

    aborted = _SLIME_STATUS[result.status] == "ABORTED"
    if per_turn:
        records = list(result.turns)
        turn_indices: list[int | None] = list(range(len(records)))
    elif result.chains:
        records = list(result.chains) if chains else [result.chains[-1]]
        turn_indices = [None] * len(records)
    else:
        records = [result.trajectory] if result.HasField("trajectory") else []
        turn_indices = [None] * len(records)
    usable = [(i, r) for i, r in zip(turn_indices, records, strict=True) if _trainable(r)]
    problem = _record_problem(records, usable, result, aborted) or _replay_problem(
        usable, outcome, spec, per_turn=per_turn
    )
    if problem is not None:
        samples = [_placeholder(template, outcome, *problem, aborted=aborted, spec=spec)]
        return samples if per_turn else samples[0]

    samples = []
    for turn_index, record in usable:
        if aborted:
            reward = 0.0
        elif record.HasField("reward"):
            reward = record.reward
        else:
            reward = result.reward
        sample = framework.clone_sample(template)
        _fill_tokens(sample, record, decode)
        _fill_replay(sample, record, spec)
        _fill_prefix_cache(sample, record)
        sample.status = framework.status(template, _SLIME_STATUS[result.status])
        sample.reward = float(reward)
        sample.remove_sample = False
        sample.weight_versions = list(record.weight_versions)
        sample.metadata.update(_episode_metadata(template, outcome, turn_index))
        sample.metadata[REWARD] = float(reward)
        _set_common(sample, outcome)
        samples.append(sample)
    set_sibling_rollout_ids(samples)
    return samples if per_turn or len(samples) > 1 else samples[0]


def set_sibling_rollout_ids(samples: list[Any]) -> None:
    """`Sample.rollout_id` as the frameworks' rules ask (see the module docstring): the
    episode's id on every sample of a list of two or more, None on a lone sample."""
    for sample in samples:
        sample.rollout_id = sample.metadata[ROLLOUT_ID] if len(samples) > 1 else None


def _trainable(record: agent_pb2.TokenRecord) -> bool:
    n = len(record.response_ids)
    return (
        len(record.prompt_ids) >= 1
        and n >= 1
        and len(record.loss_mask) == n
        and len(record.logprobs) == n
    )


def _record_problem(
    records: list[agent_pb2.TokenRecord],
    usable: list[tuple[int | None, agent_pb2.TokenRecord]],
    result: agent_pb2.EpisodeResult,
    aborted: bool,
) -> tuple[str, str] | None:
    bad = [r for r in records if len(r.response_ids) and not _trainable(r)]
    if bad:
        r = bad[0]
        return (
            "INVALID_TOKEN_RECORD",
            f"prompt {len(r.prompt_ids)}, response {len(r.response_ids)}, "
            f"mask {len(r.loss_mask)}, logprobs {len(r.logprobs)} tokens",
        )
    if not usable:
        # A cancel before the first policy turn, or an agent without token data (OpenAI mode).
        return ("NO_TRAJECTORY", "the episode returned no response tokens")
    if not aborted and not result.HasField("reward"):
        return ("NO_REWARD", "the episode ended without a graded reward")
    return None


def _replay_problem(
    usable: list[tuple[int | None, agent_pb2.TokenRecord]],
    outcome: EpisodeOutcome,
    spec: ReplaySpec,
    *,
    per_turn: bool,
) -> tuple[str, str] | None:
    """Why the records cannot carry the replay data the trainer asks for (None: they can).

    Routed experts missing from a record that should have them raise: every episode of the run
    would lack them, and the trainer would fail only after the rollout.
    """
    for _, record in usable:
        try:
            replay.top_p_sets(record)
        except replay.InvalidReplayRecord as err:
            return ("INVALID_TOKEN_RECORD", str(err))
        if spec.top_p and not record.top_p_token_offsets:
            raise replay.TopPReplayError(
                f"--rollout-top-p < 1 but episode {outcome.episode_id} came back without top-p"
                " sets: the policy engine returns none (stock SGLang; only slime's patched"
                " SGLang does); use --rollout-top-p 1.0 or slime's SGLang build"
            )
        if not spec.routed_experts:
            continue
        if not record.routed_experts:
            raise replay.RoutingReplayError(
                f"{replay.ROUTING_REPLAY_FLAG} is on but episode {outcome.episode_id} came back"
                " without routed experts: the agent must run SGLANG_GENERATE against engines"
                " started with routed-expert capture (--enable-return-routed-experts)"
            )
        try:
            replay.routed_experts(record, spec)
        except replay.InvalidReplayRecord as err:
            return ("INVALID_TOKEN_RECORD", str(err))
    return None


def _fill_replay(sample: Any, record: agent_pb2.TokenRecord, spec: ReplaySpec) -> None:
    sets = replay.top_p_sets(record)
    if sets is not None:
        sample.rollout_top_p_token_ids, sample.rollout_top_p_token_offsets = sets
    if spec.routed_experts:
        sample.rollout_routed_experts = replay.routed_experts(record, spec)


def _fill_tokens(sample: Any, record: agent_pb2.TokenRecord, decode: Decoder | None) -> None:
    prompt = list(record.prompt_ids)
    response = list(record.response_ids)
    sample.tokens = prompt + response
    sample.response_length = len(response)
    sample.loss_mask = list(record.loss_mask)
    sample.rollout_log_probs = [float(x) for x in record.logprobs]
    sample.response = decode(response) if decode is not None else ""


def _fill_prefix_cache(sample: Any, record: agent_pb2.TokenRecord) -> None:
    """`Sample.prefix_cache_info` from the engine's counts over the record's calls, which the
    frameworks sum into `prefix_cache_hit_rate` (slime observability/rollout_metrics.py:202-210,
    miles ray/rollout/metrics.py:209-216). A Sample without the field (older releases) is left
    as it is."""
    info = getattr(sample, "prefix_cache_info", None)
    if info is None:
        return
    info.cached_tokens = int(record.cached_tokens)
    info.total_prompt_tokens = int(record.engine_prompt_tokens)


def _placeholder(
    template: Any,
    outcome: EpisodeOutcome,
    reason: str,
    message: str,
    *,
    aborted: bool,
    spec: ReplaySpec,
) -> Any:
    """A minimal sample that is never trained on: ABORTED when the rollout was aborted (an
    episode cancelled before its first turn), otherwise FAILED and flagged as an infra error."""
    sample = framework.clone_sample(template)
    sample.tokens = [PLACEHOLDER_TOKEN_ID, PLACEHOLDER_TOKEN_ID]
    sample.response_length = 1
    sample.loss_mask = [0]
    sample.rollout_log_probs = [0.0]
    sample.response = ""
    sample.reward = 0.0
    sample.remove_sample = True
    status = "ABORTED" if aborted else _failed_status_name(template)
    sample.status = framework.status(template, status)
    sample.weight_versions = []
    if spec.top_p:
        ids, offsets = replay.empty_top_p_sets(sample.response_length)
        sample.rollout_top_p_token_ids, sample.rollout_top_p_token_offsets = ids, offsets
    if spec.routed_experts:
        rows = len(sample.tokens) - 1
        sample.rollout_routed_experts = replay.placeholder_routed_experts(rows, spec)
    sample.metadata.update(_episode_metadata(template, outcome, None))
    sample.metadata.update(
        {INFRA_ERROR: not aborted, ERROR_REASON: reason, ERROR_MESSAGE: message, REWARD: 0.0}
    )
    _set_common(sample, outcome)
    return sample


def _failed_status_name(template: Any) -> str:
    # FAILED exists in every slime release the contract covers; ABORTED is the older fallback.
    return "FAILED" if hasattr(type(template).Status, "FAILED") else "ABORTED"


def rollout_id_of(template: Any, episode_id: str) -> int:
    """The `Sample.rollout_id` of an episode's samples: the int slime's loss reducer groups
    siblings by. slime's own fan-out examples use the trajectory's `sample.index` (unique per
    generate call); without one, a stable int from the episode id."""
    index = getattr(template, "index", None)
    if isinstance(index, int):
        return index
    return int(hashlib.sha256(episode_id.encode()).hexdigest()[:15], 16)


def _episode_metadata(
    template: Any, outcome: EpisodeOutcome, turn_index: int | None
) -> dict[str, Any]:
    result = outcome.result
    meta: dict[str, Any] = {
        EPISODE_ID: outcome.episode_id,
        ROLLOUT_ID: rollout_id_of(template, outcome.episode_id),
        AGENT_ADDRESS: outcome.address,
        CANCELLED_BY: outcome.cancelled_by,
        TURN_INDEX: turn_index,
        INFRA_ERROR: False,
        ERROR_REASON: "",
        ERROR_MESSAGE: "",
    }
    if result is None:
        meta.update(
            {
                EPISODE_STATUS: "NO_RESULT",
                OUTCOME_REWARD: None,
                AGENT_METRICS: {},
                EVAL_REPORT: None,
                PATCH: "",
                ARTIFACT_DIR: "",
                NUM_TURNS: len(outcome.turns),
                PRM_SCORES: [],
            }
        )
        return meta
    meta.update(
        {
            EPISODE_STATUS: status_name(result.status),
            OUTCOME_REWARD: result.reward if result.HasField("reward") else None,
            AGENT_METRICS: dict(result.metrics),
            EVAL_REPORT: (
                json_format.MessageToDict(result.report, preserving_proto_field_name=True)
                if result.HasField("report")
                else None
            ),
            PATCH: result.patch.decode("utf-8", errors="replace"),
            ARTIFACT_DIR: result.artifact_dir,
            NUM_TURNS: int(result.metrics.get("turns", len(outcome.turns))),
            PRM_SCORES: [
                {
                    "turn_index": s.turn_index,
                    "score": s.score,
                    "valid_votes": s.valid_votes,
                    "state": agent_pb2.StepScoreState.Name(s.state).removeprefix(
                        "STEP_SCORE_STATE_"
                    ),
                }
                for s in result.step_scores
            ],
        }
    )
    if result.error_reason:
        meta[ERROR_REASON] = result.error_reason
        meta[ERROR_MESSAGE] = result.error_message
    return meta


def _set_common(sample: Any, outcome: EpisodeOutcome) -> None:
    # Sample.rollout_id: set_sibling_rollout_ids, once the list is known.
    sample.rollout_id = None
    metrics = outcome.result.metrics if outcome.result is not None else {}
    if "total_time" in metrics and "model_query_time_sum" in metrics:
        sample.non_generation_time = max(
            0.0, metrics["total_time"] - metrics["model_query_time_sum"]
        )
