"""A field-compatible STAND-IN of the miles pieces the plugin touches — not miles itself.

Mirrors radixark/miles at commit 31f1ca961a94cb860cec3b2dea34ec332bfa8f76 (2026-08-21), the
framework of the swe-agent example swerl replaces. miles keeps slime's layout under the package
name `miles.` but has moved on in places the plugin meets:

- `miles.utils.types.Sample`: no top-p replay fields; `routing_key` instead of `session_id`;
  `rollout_routed_experts` as a numpy array; `get_reward_value(args)` reads `args.reward_key`;
- two rollouts. The default, class-based one
  (`miles.rollout.inference_rollout.inference_rollout_common`) keeps a plain `GenerateState`
  (not a singleton) and calls a generate function whose first parameter is named `input` with
  `miles.rollout.base_types.GenerateFnInput(state, sample, sampling_params, evaluation)`,
  expecting a `GenerateFnOutput`; any other generate function goes through an adapter that
  passes `(args, sample, sampling_params[, evaluation])` and no state. The legacy one
  (`MILES_USE_LEGACY_ROLLOUT_V1=1`) keeps slime's `GenerateState` singleton in
  `miles.rollout.sglang_rollout`;
- `miles.rollout.filter_hub.base_types.DynamicFilterOutput(keep, reason)` (no
  keep_when_insufficient) and `call_dynamic_filter`;
- `miles.utils.tracking_utils.tracking.log` and `miles.utils.metric_utils.compute_rollout_step`.
- the default reward post-process (`default_post_process`): per `group_index`, one value per
  rollout, no std division for a group of one or of std 0
  (miles/ray/rollout/train_data_conversion.py); cispo is not an `--advantage-estimator` choice;
- the default data source and prompt dataset (standin_data_source).

The module-level functions drive the hooks the way miles' rollout does; their names and
behaviour match slime_standin's, so the same tests run against either.
"""

from __future__ import annotations

import copy
import inspect
import itertools
import math
import os
import sys
import types
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from testkit import standin_common, standin_data_source
from testkit.standin_common import LOGGED, declares_evaluation, flat_samples, load_function

NAME = "miles"
LEGACY_ENV = "MILES_USE_LEGACY_ROLLOUT_V1"
GENERATE_HOOK = "swerl.trainer_plugin.miles_generate"
LEGACY_GENERATE_HOOK = "swerl.trainer_plugin.generate"
# miles' _post_process_rewards normalises these (miles/ray/rollout/train_data_conversion.py) and
# divides by the std for the first two. cispo is no miles estimator: `--advantage-estimator`
# accepts only ADVANTAGE_ESTIMATORS (miles/utils/arguments.py ~L1422-1431).
NORMALISED = ("grpo", "gspo", "reinforce_plus_plus_baseline")
STD_DIVIDED = ("grpo", "gspo")
ADVANTAGE_ESTIMATORS = (
    "grpo",
    "gspo",
    "reinforce_plus_plus",
    "reinforce_plus_plus_baseline",
    "ppo",
)


@dataclass(frozen=True)
class AdapterRef:
    """Stand-in of miles.utils.types.AdapterRef (utils/types.py:10-16): which LoRA adapter a
    sample is bound to, by name and controller slot."""

    name: str
    slot: int


@dataclass
class Sample:
    """Stand-in of miles.utils.types.Sample (training-relevant fields only)."""

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
    train_metadata: dict | None = None
    routing_key: str | None = None
    non_generation_time: float = 0.0
    # Multi-LoRA: the adapter the sample trains and samples with (utils/types.py:74-75).
    adapter: AdapterRef | None = None

    def get_reward_value(self, args: Any) -> Any:
        key = args.reward_key
        return self.reward[key] if key else self.reward


class SingletonMeta(type):
    """Stand-in of miles.utils.misc.SingletonMeta."""

    _instances: dict[type, Any] = {}

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        if cls not in cls._instances:
            cls._instances[cls] = super().__call__(*args, **kwargs)
        return cls._instances[cls]


@dataclass(frozen=True)
class AdapterRun:
    """Stand-in of miles.utils.adapter_config.AdapterRun (utils/adapter_config.py:54-66): the
    fields the slot rollout reads (name, slot, version)."""

    name: str
    slot: int
    version: int = 0


# miles.utils.multi_lora.RID_SEPARATOR (utils/multi_lora.py:27).
RID_SEPARATOR = "::"


class AdaptersCache(metaclass=SingletonMeta):
    """Stand-in of miles.ray.multi_lora.controller.AdaptersCache (ray/multi_lora/controller.py
    :24-48): the controller's snapshot, whose active and retiring adapters are sampleable. The
    real one refreshes it from the controller actor every ttl_s; here a test sets `snapshot`."""

    def __init__(self, ttl_s: float = 1.0) -> None:
        self.ttl_s = ttl_s
        self.snapshot: dict[str, Any] = {"pending": {}, "active": {}, "retiring": {}, "cleanup": []}

    async def get_snapshot(self) -> dict[str, Any]:
        return self.snapshot

    async def get_all(self) -> dict[str, AdapterRun]:
        snapshot = await self.get_snapshot()
        return {**snapshot["active"], **snapshot["retiring"]}

    async def get(self, adapter_name: str) -> AdapterRun | None:
        return (await self.get_all()).get(adapter_name)


def _sampling_params(args: Any) -> dict[str, Any]:
    # miles builds these without slime's top-p replay request.
    return {
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


class GenerateState:
    """Stand-in of the class-based rollout's GenerateState: one per rollout function object."""

    def __init__(self, args: Any) -> None:
        self.args = args
        self.tokenizer = standin_common.load_tokenizer(args.hf_checkpoint, trust_remote_code=True)
        self.sampling_params = _sampling_params(args)
        self.reset()

    def reset(self) -> None:
        self.aborted = False


class LegacyGenerateState(metaclass=SingletonMeta):
    """Stand-in of miles.rollout.sglang_rollout.GenerateState (the legacy rollout's singleton)."""

    def __init__(self, args: Any) -> None:
        self.args = args
        self.tokenizer = standin_common.load_tokenizer(args.hf_checkpoint, trust_remote_code=True)
        self.sampling_params = _sampling_params(args)
        self.reset()

    def reset(self) -> None:
        self.aborted = False


@dataclass(frozen=True)
class GenerateFnInput:
    state: Any
    sample: Any
    sampling_params: dict[str, Any]
    evaluation: bool

    @property
    def args(self) -> Any:
        return self.state.args


@dataclass(frozen=True)
class GenerateFnOutput:
    samples: Any


@dataclass
class DynamicFilterOutput:
    """Stand-in of miles.rollout.filter_hub.base_types.DynamicFilterOutput."""

    keep: bool
    reason: str | None = None


def call_dynamic_filter(fn: Any, *args: Any, **kwargs: Any) -> DynamicFilterOutput:
    if fn is None:
        return DynamicFilterOutput(keep=True)
    output = fn(*args, **kwargs)
    if not isinstance(output, DynamicFilterOutput):
        output = DynamicFilterOutput(keep=output)
    return output


_rollout_state: dict[str, Any] = {}


def install(monkeypatch: Any) -> None:
    """Puts the stand-in under miles' module names for the duration of a test."""
    names = (
        "miles",
        "miles.utils",
        "miles.utils.types",
        "miles.utils.misc",
        "miles.utils.processing_utils",
        "miles.utils.metric_utils",
        "miles.utils.tracking_utils",
        "miles.utils.tracking_utils.tracking",
        "miles.rollout",
        "miles.rollout.base_types",
        "miles.rollout.sglang_rollout",
        "miles.rollout.inference_rollout",
        "miles.rollout.inference_rollout.inference_rollout_common",
        "miles.rollout.filter_hub",
        "miles.rollout.filter_hub.base_types",
        "miles.utils.multi_lora",
        "miles.ray",
        "miles.ray.multi_lora",
        "miles.ray.multi_lora.controller",
    )
    modules = {name: types.ModuleType(name) for name in names}
    for name, module in modules.items():
        if "." in name:
            parent, _, child = name.rpartition(".")
            setattr(modules[parent], child, module)
        else:
            module.__path__ = []
    modules["miles.utils.types"].Sample = Sample
    modules["miles.utils.multi_lora"].RID_SEPARATOR = RID_SEPARATOR
    modules["miles.ray.multi_lora.controller"].AdaptersCache = AdaptersCache
    modules["miles.utils.misc"].SingletonMeta = SingletonMeta
    modules["miles.utils.misc"].load_function = load_function
    modules["miles.utils.processing_utils"].load_tokenizer = standin_common.load_tokenizer
    modules["miles.utils.metric_utils"].compute_rollout_step = standin_common.compute_rollout_step
    modules["miles.utils.tracking_utils.tracking"].log = standin_common.log
    base_types = modules["miles.rollout.base_types"]
    base_types.GenerateFnInput = GenerateFnInput
    base_types.GenerateFnOutput = GenerateFnOutput
    modules["miles.rollout.sglang_rollout"].GenerateState = LegacyGenerateState
    common = modules["miles.rollout.inference_rollout.inference_rollout_common"]
    common.GenerateState = GenerateState
    filters = modules["miles.rollout.filter_hub.base_types"]
    filters.DynamicFilterOutput = DynamicFilterOutput
    filters.call_dynamic_filter = call_dynamic_filter
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    standin_data_source.install(monkeypatch, sys.modules, NAME, Sample)
    monkeypatch.setattr(SingletonMeta, "_instances", {})
    _rollout_state.clear()
    LOGGED.clear()


def check_sample_invariants(sample: Any) -> None:
    standin_common.check_sample_invariants(Sample, sample)


def check_call_result(result: Any, *, per_turn: bool, chains: int = 1) -> list[Sample]:
    return standin_common.check_call_result(Sample, result, per_turn=per_turn, chains=chains)


# -- miles' rollout machinery around the hooks ----------------------------------------------


def legacy() -> bool:
    return os.environ.get(LEGACY_ENV, "") not in ("", "0")


def state(args: Any) -> Any:
    """The generation state of the running rollout: the class-based rollout function's own
    (created once with the rollout function), or the legacy singleton."""
    if legacy():
        return LegacyGenerateState(args)
    current = _rollout_state.get("state")
    if current is None or current.args is not args:
        current = _rollout_state["state"] = GenerateState(args)
    return current


def abort(args: Any) -> None:
    """What miles does at the end of a rollout: set the abort flag of its state."""
    state(args).aborted = True


async def generate(
    args: Any, sample: Any, sampling_params: dict[str, Any], evaluation: bool = False
) -> Any:
    """miles' call of the custom generate function. The class-based rollout deep-copies the
    sampling params into a GenerateFnInput for a function whose first parameter is `input`,
    and goes through its legacy adapter (args, no state) for any other."""
    current = state(args)
    default = LEGACY_GENERATE_HOOK if legacy() else GENERATE_HOOK
    fn = load_function(getattr(args, "custom_generate_function_path", None) or default)
    if legacy() or next(iter(inspect.signature(fn).parameters)) != "input":
        if declares_evaluation(fn):
            return await fn(args, sample, sampling_params, evaluation=evaluation)
        return await fn(args, sample, sampling_params)
    fn_input = GenerateFnInput(current, sample, copy.deepcopy(sampling_params), evaluation)
    output = await fn(fn_input)
    assert isinstance(output, GenerateFnOutput), type(output)
    return output.samples


def filter_group(args: Any, group: list[Any]) -> DynamicFilterOutput:
    return call_dynamic_filter(load_function(args.dynamic_sampling_filter_path), args, group)


def default_post_process(
    args: Any, samples: list[Any], prompt_group_sizes: list[int] | None = None
) -> tuple[list[float], list[float]]:
    """miles' own reward post-process (`_post_process_rewards` without a hook), as in
    radixark/miles 31f1ca96, miles/ray/rollout/train_data_conversion.py ~L172-270
    (`_reward_group_segments`, `_normalize_rewards_by_rollout`):

    - reward groups: the explicit `prompt_group_sizes` (multi-LoRA) when given; else by each
      sample's `group_index` (in first-seen order) when every sample has one; else rows of
      `n_samples_per_prompt` when the batch is complete; else the whole batch;
    - within a group, one value per rollout (keyed by `rollout_id`, else `index`, else the
      row): its samples must share one reward (ValueError otherwise);
    - each rollout's value minus the group mean; for grpo / gspo with `grpo_std_normalization`
      also divided by (unbiased std + 1e-6), but only where the group has more than one rollout
      and its std is above 0 (0 where torch would give NaN);
    - the result broadcast to the rollout's samples. Placeholders (`remove_sample`) are not
      treated specially. Computed in Python floats where miles uses float32 tensors.
    """
    raw = [s.get_reward_value(args) for s in samples]
    if args.advantage_estimator not in NORMALISED or not args.rewards_normalization:
        return raw, raw
    out = [0.0] * len(samples)
    for segment in _reward_groups(args, samples, prompt_group_sizes):
        rollouts: dict[Any, list[int]] = {}
        for i in segment:
            sample = samples[i]
            key = sample.rollout_id if sample.rollout_id is not None else sample.index
            rollouts.setdefault(key if key is not None else ("row", i), []).append(i)
        shared = []
        for key, rows in rollouts.items():
            values = [raw[i] for i in rows]
            if any(v != values[0] for v in values[1:]):
                raise ValueError(f"all samples in rollout {key!r} must share one reward")
            shared.append(values[0])
        mean = sum(shared) / len(shared)
        normalised = [v - mean for v in shared]
        if (
            args.advantage_estimator in STD_DIVIDED
            and args.grpo_std_normalization
            and len(shared) > 1
        ):
            std = math.sqrt(sum(c * c for c in normalised) / (len(shared) - 1))
            if std > 0:
                normalised = [c / (std + 1e-6) for c in normalised]
        for rows, value in zip(rollouts.values(), normalised, strict=True):
            for i in rows:
                out[i] = value
    return raw, out


def _reward_groups(
    args: Any, samples: list[Any], prompt_group_sizes: list[int] | None
) -> list[list[int]]:
    if prompt_group_sizes is not None:
        assert sum(prompt_group_sizes) == len(samples)
        starts = list(itertools.accumulate([0, *prompt_group_sizes]))
        return [list(range(a, b)) for a, b in itertools.pairwise(starts) if b > a]
    if all(s.group_index is not None for s in samples):
        groups: dict[int, list[int]] = {}
        for i, sample in enumerate(samples):
            groups.setdefault(int(sample.group_index), []).append(i)
        return list(groups.values())
    width = args.n_samples_per_prompt
    if len(samples) == width * args.rollout_batch_size:
        return [list(range(a, a + width)) for a in range(0, len(samples), width)]
    return [list(range(len(samples)))]


def train_data(args: Any, groups: list[Any]) -> dict[str, Any]:
    """miles' conversion of a rollout's groups into train data, as far as the plugin's fields
    go (miles has no top-p replay; routed experts are numpy arrays), with its compact-batch
    rule: any sample carrying a rollout_id makes the batch compact and then no dynamic global
    batch size is computed (ray/rollout/rollout_data_conversion.py:13, 30-41), which
    train_data_conversion.py:154-155 asserts on when `--use-dynamic-global-batch-size` is on
    (multi-LoRA forces it on, utils/multi_lora.py:179)."""
    standin_common.check_rollout_ids(groups, Sample)
    samples = list(groups)
    while samples and isinstance(samples[0], list):
        samples = list(itertools.chain.from_iterable(samples))
    compact = any(s.rollout_id is not None for s in samples)
    dynamic_gbs = None
    if not getattr(args, "disable_rollout_trim_samples", False) and not compact:
        if getattr(args, "use_dynamic_global_batch_size", False):
            dynamic_gbs = len(samples)
    assert getattr(args, "use_dynamic_global_batch_size", False) == (dynamic_gbs is not None), (
        "compact batch (a sample carries rollout_id) under --use-dynamic-global-batch-size"
    )
    hook = load_function(getattr(args, "custom_reward_post_process_path", None))
    assert hook is not None, "the plugin's tests always set the post-process hook"
    raw, rewards = hook(args, samples)
    assert len(raw) == len(samples) and len(rewards) == len(samples)
    data: dict[str, Any] = {
        "tokens": [s.tokens for s in samples],
        "rewards": rewards,
        "raw_reward": raw,
        "loss_masks": [
            [0] * s.response_length if s.remove_sample else s.loss_mask for s in samples
        ],
    }
    # miles fills a missing rollout_id from the sample's index (train_data_conversion.py:82).
    rollout_ids = [s.rollout_id if s.rollout_id is not None else s.index for s in samples]
    data["rollout_ids"] = rollout_ids
    data["rollout_mask_sums"] = standin_common.rollout_mask_sums(rollout_ids, data["loss_masks"])
    for s in samples:
        assert len(s.loss_mask) == s.response_length
    if samples[0].rollout_routed_experts is not None:
        import numpy as np

        for s in samples:
            array = np.asarray(s.rollout_routed_experts)
            assert array.shape == (len(s.tokens) - 1, args.num_layers, args.moe_router_topk)
        data["rollout_routed_experts"] = [s.rollout_routed_experts for s in samples]
    return data


def log_rollout(
    args: Any, rollout_id: int, samples: list[Any], metrics: dict[str, Any] | None
) -> dict[str, Any] | None:
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
    """miles' eval logger: the custom hook first; then the mean reward, a None reward counted
    as 0.0 and reported as `eval/<dataset>-none_reward_ratio`."""
    hook = load_function(getattr(args, "custom_eval_rollout_log_function_path", None))
    if hook is not None and hook(rollout_id, args, data, extra):
        return None
    log_dict = extra or {}
    for key, entry in data.items():
        rewards = entry["rewards"]
        nones = sum(r is None for r in rewards)
        log_dict[f"eval/{key}-none_reward_ratio"] = nones / len(rewards) if rewards else 0.0
        rewards = [0.0 if r is None else r for r in rewards]
        log_dict[f"eval/{key}"] = sum(rewards) / len(rewards) if rewards else 0.0
        if getattr(args, "log_passrate", False):  # miles `ray/rollout/metrics.py:44-50`
            passrate = standin_common.compute_pass_rate(rewards, args.n_samples_per_eval_prompt)
            log_dict.update({f"eval/{key}-{k}": v for k, v in passrate.items()})
    log_dict["eval/step"] = standin_common.compute_rollout_step(args, rollout_id)
    standin_common.log(args, log_dict, step_key="eval/step")
    return log_dict
