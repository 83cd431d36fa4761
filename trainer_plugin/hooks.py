"""The trainer hooks. Point slime or miles at them by dotted path (see deploy/slime/README.md):

    --custom-generate-function-path       swerl.trainer_plugin.generate
                                          (miles' class-based rollout: .miles_generate)
    --custom-rm-path                      swerl.trainer_plugin.reward_func
    --custom-rollout-log-function-path    swerl.trainer_plugin.log_rollout_data
    --custom-eval-rollout-log-function-path  swerl.trainer_plugin.log_eval_rollout_data
    --dynamic-sampling-filter-path        swerl.trainer_plugin.filter_infra_failures
    --custom-reward-post-process-path     swerl.trainer_plugin.post_process_rewards

`generate` is a thin client: one `RunEpisode` stream per call to an agent service, which does
the work (sandbox, policy turns, evaluation, reward). Nothing here imports the framework; what
is read from it goes through framework.py.
"""

from __future__ import annotations

import asyncio
import copy
import uuid
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import structlog
from google.protobuf import struct_pb2

from swerl.agent import client as agent_client
from swerl.agent.v1 import agent_pb2
from swerl.exec.sweinstance import InstanceError, sample_instance
from swerl.trainer_plugin import (
    branching,
    convert,
    framework,
    metrics,
    refusals,
    reruns,
    rewards,
)
from swerl.trainer_plugin.episode import AgentDirectory, EpisodeOutcome, run_episode
from swerl.trainer_plugin.prefetch import prefetcher
from swerl.trainer_plugin.replay import (
    ROUTING_REPLAY_FLAG,
    ReplaySpec,
    RoutingReplayError,
    TopPReplayError,
)
from swerl.trainer_plugin.settings import PluginSettings, plugin_settings

INVALID_INSTANCE = "INVALID_INSTANCE"
# Reasons of the dynamic-sampling filter (logged by the framework as drop_<reason>).
DROP_INFRA_ERROR = "swerl_infra_error"
DROP_ABORTED = "swerl_aborted"

_log = structlog.get_logger("swerl.trainer_plugin")


class PluginConfigError(ValueError):
    """The framework's arguments or the plugin settings cannot describe an episode (a setup
    mistake, refused at the first generate call before any episode runs)."""


@dataclass(frozen=True)
class GenerateCall:
    """What one generate call runs under, passed as one: the framework's arguments, whether it
    is an evaluation, the framework and its state (None: the framework's singleton), and the
    plugin settings read from the arguments."""

    args: Any
    evaluation: bool
    framework_name: str
    state: Any | None
    settings: PluginSettings

    @property
    def per_turn(self) -> bool:
        """Dynamic history: one sample per turn (never for evaluation)."""
        return self.settings.dynamic_history and not self.evaluation

    @property
    def chains(self) -> bool:
        """Whether a trimmed whole trajectory may come back as a list of chains (never for
        evaluation, whose counts are per episode; see refusals.lists_allowed)."""
        return not self.evaluation and refusals.lists_allowed(self.args, self.framework_name)

    def aborted(self) -> bool:
        """The framework's abort flag (of `state`, or its singleton)."""
        return framework.abort_requested(self.framework_name, self.state)


async def generate(
    args: Any, sample: Any, sampling_params: dict[str, Any], evaluation: bool = False
) -> Any:
    """Runs one agent episode for `sample` and returns its training sample(s).

    Returns one Sample in whole-trajectory mode and always a list in dynamic-history mode
    (`swerl_dynamic_history` / `SWERL_PLUGIN_DYNAMIC_HISTORY`), never a mix. Evaluation calls
    always return one Sample per episode, so eval rewards count episodes, not turns. The
    sample passed in and `sampling_params` are left untouched. The framework's abort flag is
    its GenerateState singleton (slime; miles with its legacy rollout).
    """
    settings = plugin_settings(args)
    name = framework.find(settings.framework)
    if framework.miles_class_rollout(name):
        raise PluginConfigError(
            "miles' class-based rollout passes its abort flag only to generate functions that "
            "take `input`: point --custom-generate-function-path at "
            "swerl.trainer_plugin.miles_generate (or set "
            f"{framework.MILES_LEGACY_ROLLOUT_ENV}=1 for miles' legacy rollout)"
        )
    return await run_generate(args, sample, sampling_params, evaluation, name, state=None)


async def miles_generate(input: Any) -> Any:
    """`generate` for miles' class-based rollout (its default; miles picks this API by the
    parameter's name, `input`): takes miles' `GenerateFnInput`
    (state, sample, sampling_params, evaluation) and answers its `GenerateFnOutput`. The abort
    flag and the tokenizer are those of the state miles passes in."""
    args = input.state.args
    name = framework.find(plugin_settings(args).framework)
    samples = await run_generate(
        args, input.sample, input.sampling_params, input.evaluation, name, state=input.state
    )
    return framework.generate_fn_output(name, samples)


async def run_generate(
    args: Any,
    sample: Any,
    sampling_params: Mapping[str, Any],
    evaluation: bool,
    framework_name: str,
    *,
    state: Any | None,
) -> Any:
    """One episode as `generate` returns it, under `framework_name`, watching the abort flag of
    `state` (None: the framework's singleton). With `branch_at_turn` the call joins its prompt
    group's one branching episode (branching.py)."""
    settings = plugin_settings(args)
    check_rollout_mode(args, settings, framework_name)
    check_context_budget(args, settings)
    call = GenerateCall(args, evaluation, framework_name, state, settings)
    dataset = eval_dataset_name(args, sample) if evaluation else ""
    size = branch_group_size(args, settings, evaluation, dataset)
    if size >= 2:
        return await _generate_in_group(call, sample, sampling_params, size)
    return await _generate_alone(call, sample, sampling_params)


async def _generate_alone(
    call: GenerateCall,
    sample: Any,
    sampling_params: Mapping[str, Any],
    attempts: reruns.Attempts | None = None,
) -> Any:
    """One unbranched episode for one sample, re-run while the infrastructure fails it
    (reruns.py; `attempts`: those a branching group already spent on this member)."""
    params = copy.deepcopy(dict(sampling_params))
    spec = ReplaySpec.for_call(call.args, params, call.evaluation)

    def attempt(episode_id: str, avoid: list[str]) -> Any:
        return _run_one_episode(
            call, sample, params, episode_id=episode_id, spec=spec, avoid_node_ids=avoid
        )

    outcome, attempts = await reruns.run_with_reruns(
        attempt, new_episode_id(sample), call.settings.episode_attempts, call.aborted, attempts
    )
    decode = _decoder(call.settings, call.framework_name, call.state)

    def to_samples() -> Any:
        out = convert.outcome_to_samples(
            sample, outcome, per_turn=call.per_turn, decode=decode, spec=spec, chains=call.chains
        )
        attempts.annotate(out if isinstance(out, list) else [out])
        return out

    # Cloning samples and decoding long responses is CPU work: keep it off the event loop.
    return await asyncio.to_thread(to_samples)


async def _run_one_episode(
    call: GenerateCall,
    sample: Any,
    params: dict[str, Any],
    *,
    episode_id: str,
    spec: ReplaySpec,
    branch: tuple[int, int] | None = None,
    avoid_node_ids: list[str] | None = None,
) -> EpisodeOutcome:
    """Builds the start message (a row that cannot be one is an INVALID_INSTANCE outcome), adds
    its image to the prefetcher, runs the episode (branching at `branch` = (at_turn, count)
    when given) and checks the outcome against what the trainer asked for."""
    settings = call.settings
    binding = await framework.adapter_binding(call.framework_name, sample)
    if binding is None:  # miles would not send it: its adapter left the sampleable set
        outcome = EpisodeOutcome(
            episode_id=episode_id,
            address="",
            failure_reason=framework.ADAPTER_GONE,
            failure_message=f"adapter {sample.adapter.name!r} is no longer sampleable",
            cancelled_by="abort",
        )
        _log_outcome(outcome)
        return outcome
    try:
        start = build_start(
            call.args,
            sample,
            params,
            settings,
            episode_id=episode_id,
            per_turn=call.per_turn,
            evaluation=call.evaluation,
            spec=spec,
            binding=binding,
        )
    except InstanceError as err:
        outcome = EpisodeOutcome(
            episode_id=episode_id,
            address="",
            failure_reason=INVALID_INSTANCE,
            failure_message=str(err),
        )
    else:
        if branch is not None:
            start.options.branch.at_turn, start.options.branch.count = branch
        start.options.avoid_node_ids.extend(avoid_node_ids or [])
        found = prefetcher(settings)
        if found is not None:
            found.add(start.instance.image_name)
        outcome = await run_episode(start, agent_directory(settings), settings, call.aborted)
    _log_outcome(outcome)
    if spec.routed_experts:
        check_routing_replay(outcome)
    if spec.top_p:
        check_top_p_replay(outcome)
    return outcome


# -- branching rollouts (branching.py) -------------------------------------------------------


def branch_group_size(
    args: Any, settings: PluginSettings, evaluation: bool, dataset: str = ""
) -> int:
    """n when the call's prompt group shares one branching episode, else 0 (an eval group's
    size is its dataset's)."""
    if settings.branch_at_turn <= 0 or (evaluation and not settings.branch_in_eval):
        return 0
    return branching.group_size(args, evaluation=evaluation, dataset=dataset)


async def _generate_in_group(
    call: GenerateCall, sample: Any, sampling_params: Mapping[str, Any], size: int
) -> Any:
    member = branching.Member(sample, copy.deepcopy(dict(sampling_params)))
    evaluation = call.evaluation
    dataset = eval_dataset_name(call.args, sample) if evaluation else ""
    key = branching.group_key(call.args, sample, size, evaluation=evaluation, dataset=dataset)

    def run(group: branching.BranchGroup) -> Any:
        return run_branch_group(group, call)

    group = branching.rendezvous().join(key, size, member, run)
    if group is None:
        _log.warning(
            "branch.late_member",
            group_index=getattr(sample, "group_index", None),
            index=getattr(sample, "index", None),
            detail="the group's episode had started; this sample runs its own episode",
        )
        answer: Any = branching.RUN_ALONE
    else:
        answer = await group.wait(member)
    if answer is branching.RUN_ALONE:
        return await _generate_alone(call, sample, sampling_params)
    if isinstance(answer, reruns.RerunAlone):
        return await _generate_alone(call, sample, answer.sampling_params, answer.attempts)
    return answer


async def run_branch_group(group: branching.BranchGroup, call: GenerateCall) -> None:
    """The runner of one prompt group: waits for its members, runs their one branching
    episode, and answers every member (a sample or list, RUN_ALONE, or the exception)."""
    settings = call.settings
    members: list[branching.Member] = []
    try:
        members, was_aborted = await group.assemble(
            settings.branch_rendezvous_timeout_s, settings.abort_poll_interval_s, call.aborted
        )
        if len(members) < group.size and members and not was_aborted:
            _log.warning(
                "branch.group_incomplete",
                group=str(group.key[-1]),
                present=len(members),
                expected=group.size,
                waited_s=settings.branch_rendezvous_timeout_s,
            )
        if not members:
            return
        if was_aborted:
            answers = await asyncio.to_thread(_aborted_before_start, members, call)
        elif len(members) == 1:
            answers = [branching.RUN_ALONE]
        else:
            answers = await _run_branched(members, call)
        for member, answer in zip(members, answers, strict=True):
            if not member.answer.done():
                member.answer.set_result(answer)
    except asyncio.CancelledError:
        for member in members or group.members:
            member.answer.cancel()
        raise
    except Exception as err:  # every member's call raises it (e.g. RoutingReplayError)
        for member in members or group.members:
            if not member.answer.done() and not member.left:  # nobody reads a leaver's
                member.answer.set_exception(err)


def _aborted_before_start(members: list[branching.Member], call: GenerateCall) -> list[Any]:
    per_turn = call.per_turn
    answers = []
    for member in members:
        outcome = EpisodeOutcome(
            episode_id=new_episode_id(member.sample),
            address="",
            failure_reason="ABORTED_BEFORE_START",
            failure_message="the rollout was aborted while the prompt group was gathering",
            cancelled_by="abort",
        )
        spec = ReplaySpec.for_call(call.args, member.sampling_params, call.evaluation)
        answers.append(
            convert.outcome_to_samples(member.sample, outcome, per_turn=per_turn, spec=spec)
        )
    return answers


async def _run_branched(members: list[branching.Member], call: GenerateCall) -> list[Any]:
    """One RunEpisode with EpisodeOptions.branch for the members; their answers in order."""
    leader = members[0]
    per_turn = call.per_turn
    spec = ReplaySpec.for_call(call.args, leader.sampling_params, call.evaluation)
    episode_id = new_episode_id(leader.sample)
    at_turn = call.settings.branch_at_turn
    _log.info(
        "branch.group_started",
        episode_id=episode_id,
        group_index=getattr(leader.sample, "group_index", None),
        branches=len(members),
        at_turn=at_turn,
    )

    def attempt(attempt_id: str, avoid: list[str]) -> Any:
        params = reruns.group_params(leader.sampling_params, episode_id, attempt_id)
        return _run_one_episode(
            call,
            leader.sample,
            params,
            episode_id=attempt_id,
            spec=spec,
            branch=(at_turn, len(members)),
            avoid_node_ids=avoid,
        )

    # A trunk that failed (or a stream that broke) before the fork re-runs the group's episode.
    max_attempts = call.settings.episode_attempts
    outcome, attempts = await reruns.run_with_reruns(
        attempt, episode_id, max_attempts, call.aborted, group=True
    )
    episode_id = outcome.episode_id
    splits = branching.split_outcome(outcome, len(members))
    decode = _decoder(call.settings, call.framework_name, call.state)
    branched = any(r.HasField("branch") for r in outcome.results)
    # A branch that failed after the fork: its member runs again on its own (same seed).
    alone = (
        {}
        if call.aborted() or not branched
        else reruns.member_reruns(
            splits, [m.sampling_params for m in members], attempts, max_attempts
        )
    )

    def convert_all() -> list[Any]:
        lists: dict[int, list[Any]] = {}
        for i, (member, split) in enumerate(zip(members, splits, strict=True)):
            if isinstance(split, branching.RunAlone) or i in alone:
                continue
            out = convert.outcome_to_samples(
                member.sample,
                split,
                per_turn=per_turn,
                decode=decode,
                spec=spec,
                chains=call.chains,
            )
            lists[i] = out if isinstance(out, list) else [out]
            branching.annotate(
                lists[i],
                split,
                episode_id,
                at_turn,
                i if branched else None,
                seed_effective=seed_honoured(call.args),
            )
            attempts.annotate(lists[i])
        if per_turn and branched:
            # Every member keeps its own copy of the trunk's turns (one loss weight per
            # member; branching.py's docstring).
            branching.mark_trunk_turns(list(lists.values()), at_turn)
        return [
            alone[i]
            if i in alone
            else branching.RUN_ALONE
            if i not in lists
            else (lists[i] if per_turn or len(lists[i]) > 1 else lists[i][0])
            for i in range(len(members))
        ]

    return await asyncio.to_thread(convert_all)


def check_rollout_mode(args: Any, settings: PluginSettings, framework_name: str) -> None:
    """Refuses rollout modes the plugin's output cannot go through.

    slime's fully-async rollout sorts the entries of each group by `.index`, which on the
    per-turn lists of dynamic history is a bound method (TypeError after a whole rollout); it
    also applies no dynamic filter, so infra placeholders reach training there, where they are
    loss-masked (`remove_sample`) and left out of the reward statistics by post_process_rewards.
    """
    refused = refusals.refusal(args, framework_name, dynamic_history=settings.dynamic_history)
    if refused is not None:
        raise PluginConfigError(refused)
    if framework_name == "miles" or not settings.dynamic_history:
        return
    path = str(getattr(args, "rollout_function_path", "") or "")
    if "fully_async" in path:
        raise PluginConfigError(
            f"--rollout-function-path {path} (slime's fully-async rollout) cannot take the "
            "per-turn sample lists of dynamic history (it orders group entries by .index): "
            "turn swerl_dynamic_history off, or use slime's default rollout"
        )


# The args objects (by id, with a weak reference to tell a reused id) already checked.
_context_checked: dict[int, weakref.ref[Any]] = {}


def check_context_budget(args: Any, settings: PluginSettings) -> None:
    """Once per run (per args object): refuses `--sglang-allow-auto-truncate` with a budget over
    the engine's context (refusals.auto_truncate_refusal), and says so when the episodes'
    context budget is larger than the policy engine's context length
    (refusals.context_budget_note)."""
    key = id(args)
    seen = _context_checked.get(key)
    if seen is not None and seen() is args:
        return
    try:
        _context_checked[key] = weakref.ref(args, lambda _: _context_checked.pop(key, None))
    except TypeError:  # not weak-referenceable: checked on every call
        pass
    budget = settings.max_context_tokens or int(getattr(args, "rollout_max_context_len", 0) or 0)
    engine = refusals.engine_context_length(args)
    refused = refusals.auto_truncate_refusal(args, budget, engine)
    if refused is not None:
        _context_checked.pop(key, None)  # refused on every call, not only the first
        raise PluginConfigError(refused)
    note = refusals.context_budget_note(budget, engine)
    if note is not None:
        _log.warning("context_budget.over_engine", detail=note)


def check_top_p_replay(outcome: EpisodeOutcome) -> None:
    """Stops the run when `--rollout-top-p < 1` meets an engine that returns no top-p sets
    (stock SGLang; only slime's patched v0.5.15.post1 returns them): the agent ends every such
    episode INFRA_ERROR, and dropping them would resample forever."""
    result = outcome.result
    if (
        result is not None
        and result.status == agent_pb2.EPISODE_STATUS_INFRA_ERROR
        and "top_p_token_ids" in result.error_message
    ):
        raise TopPReplayError(
            "--rollout-top-p < 1 but the policy engine returns no top-p sets (stock SGLang; "
            f"only slime's patched SGLang does): {result.error_reason}; use --rollout-top-p 1.0"
        )


def check_routing_replay(outcome: EpisodeOutcome) -> None:
    """Stops the run when routing replay cannot work at all: the agent refused the request for
    routed experts, or the policy engine returned none. Every later episode would fail alike,
    and dropping them as infra failures would resample forever."""
    result = outcome.result
    if result is None:
        refused = "return_routed_experts" in outcome.failure_message
        if outcome.failure_reason == "RPC_INVALID_ARGUMENT" and refused:
            raise RoutingReplayError(
                f"{ROUTING_REPLAY_FLAG} is on but the agent refused to return routed experts: "
                f"{outcome.failure_message}"
            )
        return
    if result.status == agent_pb2.EPISODE_STATUS_INFRA_ERROR and (
        "routed_experts" in result.error_message or "routed experts" in result.error_message
    ):
        raise RoutingReplayError(
            f"{ROUTING_REPLAY_FLAG} is on but the policy returns no routed experts "
            f"({result.error_reason}: {result.error_message})"
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


async def reward_func(args: Any, sample: Any, **kwargs: Any) -> Any:
    """The reward `generate` already set (the framework calls this only for samples without).

    `sample` is one sample or a list (when generate returned lists; possibly empty), answered
    in kind.
    """
    if isinstance(sample, (list, tuple)):
        return [await reward_func(args, s, **kwargs) for s in sample]
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
    """Adds the `agent/*` metrics to the rollout's metrics; the framework then logs as usual.

    Rollout functions that return no metrics dict (slime's fully-async one) hand this hook None;
    the metrics are then logged with the framework's own logger at the rollout's step.
    """
    found = metrics.agent_metrics(samples)
    if rollout_extra_metrics is not None:
        rollout_extra_metrics.update(found)
    elif found:
        name = framework.find(plugin_settings(args).framework)
        if not framework.log_metrics(name, args, rollout_id, found, "rollout/step"):
            _log.info("rollout.agent_metrics", rollout_id=rollout_id, **found)
    return False


def log_eval_rollout_data(
    rollout_id: int, args: Any, data: dict[str, Any], extra_metrics: dict[str, Any] | None
) -> bool:
    """Evaluation without infra noise, on complete groups: before the framework averages
    `eval/<dataset>` (and, with `--log-passrate`, reshapes the rewards into groups of n and
    asserts `len == groups x n`), every prompt group of a dataset holding an episode that was
    never graded (infra failure, cancelled) is taken out of its rewards, truncation flags and
    samples. Groups are blocks of the dataset's own n by `index` (which restarts per dataset).
    The ungraded episodes are reported apart as `eval/<dataset>-infra_errors` and
    `-cancelled`, the groups left out as `-incomplete_groups` and the graded episodes they held
    as `-graded_left_out`. A dataset left with no complete group is reported by its counts
    alone (no mean over nothing).
    """
    counts: dict[str, float] = {}
    for key in list(data):
        entry = data[key]
        samples = entry.get("samples")
        if samples is None:
            continue
        size = branching.eval_group_size(args, key)
        groups = metrics.complete_groups(samples, size)
        counts[f"eval/{key}-infra_errors"] = float(groups.infra)
        counts[f"eval/{key}-cancelled"] = float(groups.cancelled)
        counts[f"eval/{key}-incomplete_groups"] = float(groups.incomplete)
        counts[f"eval/{key}-graded_left_out"] = float(groups.graded_left_out)
        if len(groups.kept) == len(samples):
            continue
        if not groups.kept:
            del data[key]
            continue
        for field in ("rewards", "truncated", "samples"):
            if isinstance(entry.get(field), list) and len(entry[field]) == len(samples):
                entry[field] = [entry[field][i] for i in groups.kept]
    if extra_metrics is not None:
        extra_metrics.update(counts)
    elif counts:
        name = framework.find(plugin_settings(args).framework)
        if not framework.log_metrics(name, args, rollout_id, counts, "eval/step"):
            _log.info("eval.excluded_episodes", rollout_id=rollout_id, **counts)
    return False


def filter_infra_failures(args: Any, samples: Any, **kwargs: Any) -> Any:
    """Dynamic-sampling filter: drops a prompt group holding an infra failure or an aborted
    episode, whose reward says nothing about the policy (the group is resampled). An infra
    failure here is one that outlasted its `episode_attempts` (generate re-runs it first,
    reruns.py), so one failure no longer costs its group."""
    name = framework.find(plugin_settings(args).framework)
    flat = metrics.flatten(samples)
    if any((s.metadata or {}).get(convert.INFRA_ERROR) for s in flat):
        return framework.dynamic_filter_output(name, keep=False, reason=DROP_INFRA_ERROR)
    aborted = framework.status(flat[0], "ABORTED") if flat else None
    if any(s.status == aborted or getattr(s, "remove_sample", False) for s in flat):
        return framework.dynamic_filter_output(name, keep=False, reason=DROP_ABORTED)
    return framework.dynamic_filter_output(name, keep=True, reason=None)


def post_process_rewards(args: Any, samples: Any) -> tuple[list[float], list[float]]:
    """Group normalisation per prompt group with each episode counted once (see rewards.py),
    for the estimators the framework in use normalises."""
    return rewards.normalise(args, samples, framework.find(plugin_settings(args).framework))


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
    spec: ReplaySpec | None = None,
    binding: framework.AdapterBinding | None = None,
) -> agent_pb2.EpisodeStart:
    """The `start` message of one episode. Raises InstanceError for unusable sample metadata
    and PluginConfigError when slime's arguments lack the policy endpoint or tokenizer."""
    instance = sample_instance(sample.metadata, sample.prompt)
    params = struct_pb2.Struct()
    params.update(_jsonable({k: v for k, v in sampling_params.items() if v is not None}))
    context = settings.max_context_tokens or int(getattr(args, "rollout_max_context_len", 0) or 0)
    return agent_client.episode_start(
        episode_id=episode_id,
        instance=instance,
        policy=agent_pb2.PolicyConfig(
            endpoint=policy_endpoint(args, settings, evaluation=evaluation),
            api=agent_pb2.POLICY_API_SGLANG_GENERATE,
            model=settings.policy_model,
            tokenizer_path=tokenizer_path(args, settings),
            sampling_params=params,
            return_routed_experts=bool(spec and spec.routed_experts),
            lora_path=framework.lora_path(framework.find(settings.framework), args, sample),
            request_id_prefix=binding.request_id_prefix if binding else "",
            cache_key=binding.cache_key if binding else "",
        ),
        limits=agent_client.episode_limits(
            max_turns=settings.max_turns,
            max_context_tokens=context,
            max_new_tokens=settings.max_new_tokens,
            wall_timeout_s=settings.wall_timeout_s,
            command_timeout_s=settings.command_timeout_s,
            eval_timeout_s=settings.eval_timeout_s,
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
            owner=lease_owner(args, sample, settings, evaluation=evaluation),
            harness=settings.harness,
        ),
    )


def lease_owner(args: Any, sample: Any, settings: PluginSettings, *, evaluation: bool) -> str:
    """Who holds the episode's sandbox lease, as operators read it in the pool:
    `<prefix>/train/group-<prompt group>` or `<prefix>/eval/<dataset>/sample-<index>`; the
    prefix names the framework in use (slime, miles) unless `owner_prefix` is set."""
    prefix = settings.owner_prefix or framework.find(settings.framework) or "trainer"
    if not evaluation:
        return f"{prefix}/train/group-{getattr(sample, 'group_index', None)}"
    index = getattr(sample, "index", None)
    return f"{prefix}/eval/{eval_dataset_name(args, sample)}/sample-{index}"


def seed_honoured(args: Any) -> bool:
    """Whether SGLang samples by `sampling_seed`: only with deterministic inference on
    (SLIME_CONTRACT.md, "Checked 2026-11-27")."""
    return bool(getattr(args, "sglang_enable_deterministic_inference", False))


def eval_dataset_name(args: Any, sample: Any) -> str:
    """The eval dataset a sample comes from. slime's eval rollout does not tell generate, so:
    the sample's source (`sample.source`, or `metadata["source_name"]`, slime's own source key,
    which an eval dataset's `metadata_overrides` can set), else the only configured eval
    dataset's name, else "eval"."""
    source = getattr(sample, "source", None) or (sample.metadata or {}).get("source_name")
    if source:
        return str(source)
    datasets = getattr(args, "eval_datasets", None) or []
    names = {getattr(d, "name", None) for d in datasets} - {None}
    if len(names) == 1:
        return str(names.pop())
    return "eval"


def policy_endpoint(args: Any, settings: PluginSettings, *, evaluation: bool = False) -> str:
    """The router the episode's policy calls go to: the configured endpoint, else the
    framework's router from `args`. miles' snapshot evaluation (`--eval-num-gpus` or a
    checkpoint eval function: `args.eval_uses_snapshots`, miles utils/arguments.py:81) hands
    each eval call a copy of `args` retargeted at the snapshot's engines
    (rollout/checkpoint_eval.py:35-47): there the router in `args` wins, or the training
    router's weights would be evaluated (issue 41 point 7)."""
    snapshot = evaluation and bool(getattr(args, "eval_uses_snapshots", False))
    ip = getattr(args, "sglang_router_ip", None)
    port = getattr(args, "sglang_router_port", None)
    if snapshot and ip and port:
        return f"http://{ip}:{port}"
    if settings.policy_endpoint:
        return settings.policy_endpoint
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


def _decoder(settings: PluginSettings, framework_name: str, state: Any) -> convert.Decoder | None:
    if not settings.decode_response_text:
        return None
    tokenizer = framework.tokenizer(framework_name, state)
    if tokenizer is None:
        return None
    return lambda ids: tokenizer.decode(ids)


def _jsonable(value: Any) -> Any:
    """Sampling params as plain JSON types (numpy scalars and tuples do occur)."""
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if hasattr(value, "item") and callable(value.item):
        return value.item()
    return value
