"""A field-compatible STAND-IN of the slime pieces the plugin touches — not slime itself.

Mirrors THUDM/slime at commit 624b824a898ab0ec1fcb4d373004c7f3852bf515 (2026-08-21; the hooks
and fields below are unchanged since v0.3.1). slime cannot be installed here (it is not on PyPI;
it ships in its own CUDA Docker image), so the contract tests install these classes under
slime's real module names in `sys.modules`:

- `slime.utils.types.Sample`: the dataclass fields slime's trainer reads (names, defaults and
  the `Status` values), the top-p / routing replay fields, `rollout_id` and `session_id`, and
  `get_reward_value(args)`, which reads `args.reward_key` (args without it raise, as in slime);
- `slime.utils.misc.SingletonMeta` and `slime.rollout.sglang_rollout.GenerateState(args)`: the
  singleton registry, the `aborted` flag slime sets at the end of every rollout, the tokenizer
  it loads itself from `args.hf_checkpoint`, and its sampling params (with the request for the
  top-p sets when `--rollout-top-p < 1`);
- `slime.rollout.filter_hub.base_types`: `DynamicFilterOutput(keep, reason,
  keep_when_insufficient=False)` and `call_dynamic_filter` (which wraps any other return value
  as `keep=value`);
- `slime.observability.logging_utils.log` / `metric_utils.compute_rollout_step` (recording).

`Rollout` drives the hooks the way slime's rollout manager does: generate (with `evaluation`
only when declared), reward, filter, reward post-process (slime's own default formula when no
hook is set), the train-data checks (top-p replay and routed experts included), and the rollout
and eval loggers with their custom-hook protocol.
"""

from __future__ import annotations

import itertools
import sys
import types
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from testkit import standin_common, standin_data_source
from testkit.standin_common import LOGGED, declares_evaluation, flat_samples, load_function

NAME = "slime"
GENERATE_HOOK = "swerl.trainer_plugin.generate"
# Estimators slime normalises per group, and those it also divides by the group's std.
NORMALISED = ("grpo", "gspo", "cispo", "reinforce_plus_plus_baseline")
STD_DIVIDED = ("grpo", "gspo", "cispo")


@dataclass
class Sample:
    """Stand-in of slime.utils.types.Sample (training-relevant fields only)."""

    group_index: int | None = None
    index: int | None = None
    rollout_id: int | None = None
    prompt: str | list[dict[str, str]] = ""
    tokens: list[int] = field(default_factory=list)
    response: str = ""
    response_length: int = 0
    label: str | None = None
    reward: float | dict[str, Any] | None = None
    loss_mask: list[int] | None = None
    weight_versions: list[str] = field(default_factory=list)
    rollout_log_probs: list[float] | None = None
    rollout_top_p_token_ids: Any = None
    rollout_top_p_token_offsets: Any = None
    rollout_routed_experts: Any = None
    remove_sample: bool = False
    teacher_log_probs: list[float] | None = None
    prefix_cache_info: standin_common.PrefixCacheInfo = field(
        default_factory=standin_common.PrefixCacheInfo
    )

    class Status(Enum):
        PENDING = "pending"
        COMPLETED = "completed"
        TRUNCATED = "truncated"
        ABORTED = "aborted"
        FAILED = "failed"

    status: Status = Status.PENDING
    metadata: dict = field(default_factory=dict)
    generate_function_path: str | None = None
    custom_rm_path: str | None = None
    train_metadata: dict | None = None
    session_id: str | None = None
    non_generation_time: float = 0.0

    def get_reward_value(self, args: Any) -> Any:
        key = args.reward_key  # slime reads the attribute unconditionally
        return self.reward[key] if key else self.reward


class SingletonMeta(type):
    """Stand-in of slime.utils.misc.SingletonMeta."""

    _instances: dict[type, Any] = {}

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        if cls not in cls._instances:
            cls._instances[cls] = super().__call__(*args, **kwargs)
        return cls._instances[cls]


class GenerateState(metaclass=SingletonMeta):
    """Stand-in of slime.rollout.sglang_rollout.GenerateState: built from args alone."""

    def __init__(self, args: Any) -> None:
        self.args = args
        self.tokenizer = standin_common.load_tokenizer(args.hf_checkpoint, trust_remote_code=True)
        self.sampling_params: dict[str, Any] = {
            "temperature": args.rollout_temperature,
            "top_p": args.rollout_top_p,
            "top_k": args.rollout_top_k,
            "max_new_tokens": args.rollout_max_response_len,
            "stop": args.rollout_stop,
            "stop_token_ids": args.rollout_stop_token_ids,
            "skip_special_tokens": args.rollout_skip_special_tokens,
            "no_stop_trim": True,
            "spaces_between_special_tokens": False,
        }
        if args.rollout_top_p != 1.0:
            self.sampling_params["custom_params"] = {"return_top_p_token_ids": True}
        self.reset()

    def reset(self) -> None:
        self.remaining_batch_size = 0
        self.aborted = False


@dataclass
class DynamicFilterOutput:
    """Stand-in of slime.rollout.filter_hub.base_types.DynamicFilterOutput."""

    keep: bool
    reason: str | None = None
    keep_when_insufficient: bool = False


def call_dynamic_filter(fn: Any, *args: Any, **kwargs: Any) -> DynamicFilterOutput:
    if fn is None:
        return DynamicFilterOutput(keep=True)
    output = fn(*args, **kwargs)
    if not isinstance(output, DynamicFilterOutput):
        output = DynamicFilterOutput(keep=output)
    return output


def install(monkeypatch: Any) -> None:
    """Puts the stand-in under slime's module names for the duration of a test."""
    names = (
        "slime",
        "slime.utils",
        "slime.utils.types",
        "slime.utils.misc",
        "slime.utils.processing_utils",
        "slime.rollout",
        "slime.rollout.sglang_rollout",
        "slime.rollout.filter_hub",
        "slime.rollout.filter_hub.base_types",
        "slime.observability",
        "slime.observability.logging_utils",
        "slime.observability.metric_utils",
    )
    modules = {name: types.ModuleType(name) for name in names}
    for name, module in modules.items():
        if "." in name:  # packages know their submodules, as after a real import
            parent, _, child = name.rpartition(".")
            setattr(modules[parent], child, module)
        else:
            module.__path__ = []
    modules["slime.utils.types"].Sample = Sample
    modules["slime.utils.misc"].SingletonMeta = SingletonMeta
    modules["slime.utils.misc"].load_function = load_function
    modules["slime.utils.processing_utils"].load_tokenizer = standin_common.load_tokenizer
    modules["slime.rollout.sglang_rollout"].GenerateState = GenerateState
    filters = modules["slime.rollout.filter_hub.base_types"]
    filters.DynamicFilterOutput = DynamicFilterOutput
    filters.call_dynamic_filter = call_dynamic_filter
    modules["slime.observability.logging_utils"].log = standin_common.log
    metric_utils = modules["slime.observability.metric_utils"]
    metric_utils.compute_rollout_step = standin_common.compute_rollout_step
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    standin_data_source.install(monkeypatch, sys.modules, NAME, Sample)
    monkeypatch.setattr(SingletonMeta, "_instances", {})
    LOGGED.clear()


def check_sample_invariants(sample: Any) -> None:
    standin_common.check_sample_invariants(Sample, sample)


def check_call_result(result: Any, *, per_turn: bool, chains: int = 1) -> list[Sample]:
    return standin_common.check_call_result(Sample, result, per_turn=per_turn, chains=chains)


# -- slime's rollout machinery around the hooks ---------------------------------------------


def state(args: Any) -> GenerateState:
    """The GenerateState singleton, created as slime's rollout does before any generate."""
    return GenerateState(args)


def abort(args: Any) -> None:
    """What slime does at the end of a rollout: set the abort flag."""
    state(args).aborted = True


async def generate(
    args: Any, sample: Any, sampling_params: dict[str, Any], evaluation: bool = False
) -> Any:
    """slime's call of the custom generate function (generate_and_rm's first half)."""
    state(args)
    fn = load_function(getattr(args, "custom_generate_function_path", None) or GENERATE_HOOK)
    if declares_evaluation(fn):
        return await fn(args, sample, sampling_params, evaluation=evaluation)
    return await fn(args, sample, sampling_params)


def filter_group(args: Any, group: list[Any]) -> DynamicFilterOutput:
    return call_dynamic_filter(load_function(args.dynamic_sampling_filter_path), args, group)


def default_post_process(args: Any, samples: list[Any]) -> tuple[list[float], list[float]]:
    """slime's own reward post-process (RolloutManager._post_process_rewards without a hook)."""
    return standin_common.group_post_process(args, samples, NORMALISED, STD_DIVIDED)


def train_data(args: Any, groups: list[Any]) -> dict[str, Any]:
    """slime's conversion of a rollout's groups into train data, with its checks."""
    standin_common.check_rollout_ids(groups, Sample)  # slime ray/rollout.py:601
    samples = list(groups)
    while samples and isinstance(samples[0], list):
        samples = list(itertools.chain.from_iterable(samples))
    hook = load_function(getattr(args, "custom_reward_post_process_path", None))
    raw, rewards = hook(args, samples) if hook else default_post_process(args, samples)
    assert len(raw) == len(samples) and len(rewards) == len(samples)
    # slime ray/rollout.py:647-656: a sample without rollout_id gets the lowest unused int.
    rollout_ids = [s.rollout_id for s in samples]
    taken = {r for r in rollout_ids if r is not None}
    fresh = 0
    for i, rid in enumerate(rollout_ids):
        if rid is None:
            while fresh in taken:
                fresh += 1
            rollout_ids[i] = fresh
            taken.add(fresh)
    data: dict[str, Any] = {
        "tokens": [s.tokens for s in samples],
        "response_lengths": [s.response_length for s in samples],
        "rewards": rewards,
        "raw_reward": raw,
        "rollout_ids": rollout_ids,
    }
    for s in samples:
        assert len(s.loss_mask) == s.response_length
    data["loss_masks"] = [
        [0] * s.response_length if s.remove_sample else s.loss_mask for s in samples
    ]
    data["rollout_mask_sums"] = standin_common.rollout_mask_sums(rollout_ids, data["loss_masks"])
    if samples[0].rollout_log_probs is not None:
        data["rollout_log_probs"] = [s.rollout_log_probs for s in samples]
    if getattr(args, "rollout_top_p", 1.0) != 1.0:
        for s in samples:
            assert s.rollout_top_p_token_ids is not None
            assert s.rollout_top_p_token_offsets is not None
            assert len(s.rollout_top_p_token_offsets) == s.response_length + 1
            assert int(s.rollout_top_p_token_offsets[-1]) == len(s.rollout_top_p_token_ids)
        data["rollout_top_p_token_ids"] = [s.rollout_top_p_token_ids for s in samples]
        data["rollout_top_p_token_offsets"] = [s.rollout_top_p_token_offsets for s in samples]
    if samples[0].rollout_routed_experts is not None:
        experts = [s.rollout_routed_experts for s in samples]
        if getattr(args, "use_rollout_routing_replay", False):
            _check_routed_experts(args, samples, experts)
        data["rollout_routed_experts"] = experts
    return data


def _check_routed_experts(args: Any, samples: list[Any], experts: list[Any]) -> None:
    import numpy as np

    for sample, value in zip(samples, experts, strict=True):
        array = np.asarray(value)
        assert array.ndim == 3, array.shape
        assert array.shape[1:] == (args.num_layers, args.moe_router_topk), array.shape
        assert array.shape[0] == len(sample.tokens) - 1, (array.shape, len(sample.tokens))
        if args.moe_router_topk > 1:
            for layer in range(args.num_layers):
                assert np.count_nonzero(array[:, layer, :]), f"layer {layer} all zero"


def log_rollout(
    args: Any, rollout_id: int, samples: list[Any], metrics: dict[str, Any] | None
) -> dict[str, Any] | None:
    """slime's rollout logger: the custom hook first (True = it logged), then the default."""
    hook = load_function(getattr(args, "custom_rollout_log_function_path", None))
    if hook is not None and hook(rollout_id, args, samples, metrics, 1.0):
        return None
    log_dict = {
        **(metrics or {}),
        # compute_metrics_from_samples' prefix-cache part (see standin_common).
        **{
            f"rollout/{k}": v
            for k, v in standin_common.prefix_cache_metrics(flat_samples(samples)).items()
        },
        "rollout/step": standin_common.compute_rollout_step(args, rollout_id),
    }
    standin_common.log(args, log_dict, step_key="rollout/step")
    return log_dict


def log_eval(
    args: Any, rollout_id: int, data: dict[str, Any], extra: dict[str, Any] | None
) -> dict[str, Any] | None:
    """slime's eval logger: the custom hook first, then `eval/<dataset>` as the mean reward."""
    hook = load_function(getattr(args, "custom_eval_rollout_log_function_path", None))
    if hook is not None and hook(rollout_id, args, data, extra):
        return None
    log_dict = extra or {}
    for key, entry in data.items():
        rewards = entry["rewards"]
        log_dict[f"eval/{key}"] = sum(rewards) / len(rewards)
        if "truncated" in entry:
            log_dict[f"eval/{key}-truncated_ratio"] = sum(entry["truncated"]) / len(rewards)
        if getattr(args, "log_passrate", False):  # slime `observability/rollout_metrics.py:238-245`
            passrate = standin_common.compute_pass_rate(rewards, args.n_samples_per_eval_prompt)
            log_dict.update({f"eval/{key}-{k}": v for k, v in passrate.items()})
    log_dict["eval/step"] = standin_common.compute_rollout_step(args, rollout_id)
    standin_common.log(args, log_dict, step_key="eval/step")
    return log_dict
