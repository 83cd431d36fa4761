"""A field-compatible STAND-IN of the slime pieces the plugin touches — not slime itself.

slime cannot be installed here (it is not on PyPI; it ships in its own CUDA Docker image), so the
contract tests install these classes under slime's real module names in `sys.modules`:

- `slime.utils.types.Sample`: the dataclass fields slime's trainer reads (names, defaults and
  the `Status` enum values as in THUDM/slime v0.2.1-v0.3.x), `get_reward_value`, and the v0.3
  `rollout_id` / `session_id` fields;
- `slime.utils.misc.SingletonMeta` and `slime.rollout.sglang_rollout.GenerateState`: the
  singleton registry (`SingletonMeta._instances[GenerateState]`) and the `aborted` flag slime
  sets at the end of every rollout, plus the `tokenizer` slime loads from `hf_checkpoint`;
- `slime.rollout.filter_hub.base_types.DynamicFilterOutput` and `call_dynamic_filter` (which
  wraps any non-DynamicFilterOutput return value as `keep=value`, as slime does).

`check_sample_invariants` states, as assertions, what slime's trainer asserts or silently
depends on (SLIME_CONTRACT.md).
"""

from __future__ import annotations

import sys
import types
from dataclasses import dataclass, field
from enum import Enum
from typing import Any


@dataclass
class Sample:
    """Stand-in of slime.utils.types.Sample (training-relevant fields only)."""

    group_index: int | None = None
    index: int | None = None
    prompt: str | list[dict[str, str]] = ""
    tokens: list[int] = field(default_factory=list)
    response: str = ""
    response_length: int = 0
    label: str | None = None
    reward: float | dict[str, Any] | None = None
    loss_mask: list[int] | None = None
    weight_versions: list[str] = field(default_factory=list)
    rollout_log_probs: list[float] | None = None
    remove_sample: bool = False

    class Status(Enum):
        PENDING = "pending"
        COMPLETED = "completed"
        TRUNCATED = "truncated"
        ABORTED = "aborted"
        FAILED = "failed"

    status: Status = Status.PENDING
    metadata: dict = field(default_factory=dict)
    train_metadata: dict | None = None
    session_id: str | None = None
    rollout_id: int | None = None
    non_generation_time: float = 0.0

    def get_reward_value(self, args: Any) -> float:
        key = getattr(args, "reward_key", None)
        return self.reward if not key else self.reward[key]


class SingletonMeta(type):
    """Stand-in of slime.utils.misc.SingletonMeta."""

    _instances: dict[type, Any] = {}

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        if cls not in cls._instances:
            cls._instances[cls] = super().__call__(*args, **kwargs)
        return cls._instances[cls]


class GenerateState(metaclass=SingletonMeta):
    """Stand-in of slime.rollout.sglang_rollout.GenerateState (abort flag and tokenizer)."""

    def __init__(self, args: Any, tokenizer: Any = None) -> None:
        self.args = args
        self.tokenizer = tokenizer
        self.reset()

    def reset(self) -> None:
        self.aborted = False


@dataclass
class DynamicFilterOutput:
    """Stand-in of slime.rollout.filter_hub.base_types.DynamicFilterOutput."""

    keep: bool
    reason: str | None = None


def call_dynamic_filter(fn: Any, *args: Any, **kwargs: Any) -> DynamicFilterOutput:
    if fn is None:
        return DynamicFilterOutput(keep=True)
    output = fn(*args, **kwargs)
    if not isinstance(output, DynamicFilterOutput):
        output = DynamicFilterOutput(keep=output)
    return output


def install(monkeypatch: Any) -> None:
    """Puts the stand-in under slime's module names for the duration of a test."""
    modules = {
        name: types.ModuleType(name)
        for name in (
            "slime",
            "slime.utils",
            "slime.utils.types",
            "slime.utils.misc",
            "slime.rollout",
            "slime.rollout.sglang_rollout",
            "slime.rollout.filter_hub",
            "slime.rollout.filter_hub.base_types",
        )
    }
    modules["slime.utils.types"].Sample = Sample
    modules["slime.utils.misc"].SingletonMeta = SingletonMeta
    modules["slime.rollout.sglang_rollout"].GenerateState = GenerateState
    modules["slime.rollout.filter_hub.base_types"].DynamicFilterOutput = DynamicFilterOutput
    modules["slime.rollout.filter_hub.base_types"].call_dynamic_filter = call_dynamic_filter
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    SingletonMeta._instances.pop(GenerateState, None)
    monkeypatch.setattr(SingletonMeta, "_instances", {})


def check_sample_invariants(sample: Any) -> None:
    """What slime's trainer asserts or relies on, for one returned sample."""
    assert isinstance(sample, Sample), type(sample)
    prompt_len = len(sample.tokens) - sample.response_length
    assert prompt_len >= 1, "prompt must have at least one token"
    assert sample.response_length >= 1, "response must have at least one token"
    assert sample.loss_mask is not None and len(sample.loss_mask) == sample.response_length
    assert sample.rollout_log_probs is not None
    assert len(sample.rollout_log_probs) == sample.response_length
    assert set(sample.loss_mask) <= {0, 1}
    for mask, logprob in zip(sample.loss_mask, sample.rollout_log_probs, strict=True):
        if mask == 0:
            assert logprob == 0.0, "masked tokens carry logprob 0.0"
        assert isinstance(logprob, float)
    assert sample.reward is not None, "every returned sample needs a reward"
    assert sample.status in (
        Sample.Status.COMPLETED,
        Sample.Status.TRUNCATED,
        Sample.Status.ABORTED,
        Sample.Status.FAILED,
    )
    if sample.remove_sample:
        assert sample.reward == 0.0 and set(sample.loss_mask) == {0}
    assert isinstance(sample.rollout_id, int), "an int rollout_id on every sample"
    assert sample.metadata.get("rollout_id") == sample.rollout_id
    for key in ("agent_metrics", "eval_report", "episode_status", "patch", "artifact_dir"):
        assert key in sample.metadata, key


def check_call_result(result: Any, *, per_turn: bool) -> list[Sample]:
    """A generate return value: always a list in dynamic mode, one Sample otherwise; siblings
    share rollout_id. Returns the samples."""
    if per_turn:
        assert isinstance(result, list) and result, result
        samples = result
        assert len({s.rollout_id for s in samples}) == 1, "siblings share rollout_id"
    else:
        assert isinstance(result, Sample), type(result)
        samples = [result]
    for sample in samples:
        check_sample_invariants(sample)
    return samples
