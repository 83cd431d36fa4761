"""Everything the plugin takes from the training framework — slime or miles — found lazily.

slime (THUDM/slime) and miles (radixark/miles) share one lineage and keep the same modules under
their own package names (`slime.rollout...`, `miles.rollout...`). Neither is on PyPI; both live
in their own Docker images, and the hooks are loaded by dotted path inside the framework's
RolloutManager actor, where its modules are already imported. So nothing here imports a
framework at module import time, every framework name the plugin uses is in this module, and
each function has a behaviour for "no framework": never aborted, no tokenizer, field-compatible
stand-ins for the framework's small result classes.

Which framework: the plugin setting `framework` (`swerl_framework` in the custom config,
`SWERL_PLUGIN_FRAMEWORK`) when it names one; otherwise the one already imported in this process,
else the one importable, slime first.

Where the abort flag lives differs: slime (and miles' legacy rollout) keep one `GenerateState`
singleton in `<pkg>.rollout.sglang_rollout`; miles' class-based rollout passes its state in the
`GenerateFnInput` of each generate call (see `hooks.miles_generate`), so that state is handed to
`abort_requested` explicitly.

Samples are never constructed from the framework's class: new samples are clones of the one the
framework passed in, and statuses come from that sample's own class (`type(sample).Status`).
"""

from __future__ import annotations

import copy
import importlib
import importlib.util
import os
import sys
from dataclasses import dataclass
from types import ModuleType
from typing import Any

FRAMEWORKS = ("slime", "miles")

# Module paths below the package name (identical in slime and miles).
GENERATE_STATE_MODULE = "rollout.sglang_rollout"
FILTER_TYPES_MODULE = "rollout.filter_hub.base_types"
ROLLOUT_TYPES_MODULE = "rollout.base_types"
# The framework's default `--data-source-path` class (the same name in slime and miles).
DATA_SOURCE_MODULE = "rollout.data_source"
DEFAULT_DATA_SOURCE = "RolloutDataSourceWithBuffer"
# miles swaps its default for this one under multi-LoRA (`--multi-lora-n-adapters > 0`, which
# sets `args.multi_lora`) when `--data-source-path` is left at the default.
MILES_MULTI_LORA_DATA_SOURCE = ("rollout.multi_lora.data_source", "MultiLoRAAsyncDataSource")
# Where each framework keeps its metrics logger and the rollout-step rule of its logs.
_TRACKING = {
    "slime": ("observability.logging_utils", "observability.metric_utils"),
    "miles": ("utils.tracking_utils.tracking", "utils.metric_utils"),
}
# miles' switch back to the slime-style rollout (function-based, GenerateState singleton).
MILES_LEGACY_ROLLOUT_ENV = "MILES_USE_LEGACY_ROLLOUT_V1"


class FrameworkError(RuntimeError):
    """The framework the settings name cannot be imported, or the run mixes its APIs."""


def find(choice: str = "auto") -> str:
    """The framework's package name ("slime" or "miles"), or "" when neither is present.

    `choice` "slime" or "miles" wins (and must be importable); "auto" prefers a framework
    already imported in this process (the RolloutManager imported its own), then an importable
    one, slime first.
    """
    if choice in FRAMEWORKS:
        if choice not in sys.modules and importlib.util.find_spec(choice) is None:
            raise FrameworkError(
                f"the plugin setting framework={choice!r} names a framework that is not "
                "importable in this process"
            )
        return choice
    for name in FRAMEWORKS:
        if f"{name}.{GENERATE_STATE_MODULE}" in sys.modules or f"{name}.utils" in sys.modules:
            return name
    for name in FRAMEWORKS:
        if _importable(name):
            return name
    return ""


def _importable(name: str) -> bool:
    # PyPI's unrelated `slime` package is a plain module: a framework has `<name>.utils.types`.
    if name in sys.modules:
        return f"{name}.utils.types" in sys.modules or _has_submodule(name, "utils.types")
    try:
        return importlib.util.find_spec(name) is not None and _has_submodule(name, "utils.types")
    except (ImportError, ValueError):
        return False


def _has_submodule(name: str, sub: str) -> bool:
    try:
        return importlib.util.find_spec(f"{name}.{sub}") is not None
    except (ImportError, ValueError):
        return False


def module(framework: str, path: str) -> ModuleType | None:
    """`<framework>.<path>` imported, or None when there is no framework or no such module."""
    if not framework:
        return None
    name = f"{framework}.{path}"
    loaded = sys.modules.get(name)
    if loaded is not None:
        return loaded
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


def miles_class_rollout(framework: str) -> bool:
    """True under miles' class-based rollout (its default), which hands generate functions
    their state in a `GenerateFnInput` instead of keeping a GenerateState singleton."""
    return framework == "miles" and os.environ.get(MILES_LEGACY_ROLLOUT_ENV, "") in ("", "0")


# -- the generation state: abort flag and tokenizer -------------------------------------------


def generate_state(framework: str) -> Any | None:
    """The framework's `GenerateState` singleton when it exists; None otherwise.

    `GenerateState(args)` would create the singleton (loading a tokenizer) if it did not exist
    yet, so the instance is looked up in the singleton metaclass's registry instead. Only
    modules already imported are looked at: the rollout imported them before any generate call.
    """
    if not framework:
        return None
    loaded = sys.modules.get(f"{framework}.{GENERATE_STATE_MODULE}")
    state_cls = getattr(loaded, "GenerateState", None) if loaded is not None else None
    if state_cls is None:
        return None
    for owner in (type(state_cls), state_cls):
        instances = getattr(owner, "_instances", None)
        if isinstance(instances, dict) and state_cls in instances:
            return instances[state_cls]
    return None


def abort_requested(framework: str, state: Any | None = None) -> bool:
    """True while the framework is aborting the rollout (`GenerateState.aborted`).

    `state` is the generation state the framework passed in (miles' class-based rollout);
    without it, the framework's singleton is looked up.
    """
    if state is None:
        state = generate_state(framework)
    return bool(getattr(state, "aborted", False)) if state is not None else False


def tokenizer(framework: str, state: Any | None = None) -> Any | None:
    """The tokenizer the framework loaded from `args.hf_checkpoint`, when it is running."""
    if state is None:
        state = generate_state(framework)
    return getattr(state, "tokenizer", None) if state is not None else None


# -- small result classes the framework checks by type -----------------------------------------


@dataclass
class FallbackDynamicFilterOutput:
    """Field-compatible with the framework's `DynamicFilterOutput`; used only without one."""

    keep: bool
    reason: str | None = None


def dynamic_filter_output(framework: str, keep: bool, reason: str | None) -> Any:
    """The framework's own `DynamicFilterOutput(keep, reason)`.

    It must be the framework's class: both wrap any other return value as
    `DynamicFilterOutput(keep=value)`, and a dataclass instance is always truthy.
    """
    loaded = module(framework, FILTER_TYPES_MODULE)
    cls = getattr(loaded, "DynamicFilterOutput", None) if loaded is not None else None
    if cls is None:
        return FallbackDynamicFilterOutput(keep=keep, reason=reason)
    return cls(keep=keep, reason=reason)


@dataclass(frozen=True)
class FallbackGenerateFnOutput:
    """Field-compatible with miles' `GenerateFnOutput`; used only without miles."""

    samples: Any


def generate_fn_output(framework: str, samples: Any) -> Any:
    """miles' `GenerateFnOutput(samples=...)`, what its class-based rollout reads `.samples` of."""
    loaded = module(framework, ROLLOUT_TYPES_MODULE)
    cls = getattr(loaded, "GenerateFnOutput", None) if loaded is not None else None
    if cls is None:
        return FallbackGenerateFnOutput(samples=samples)
    return cls(samples=samples)


# -- the data source -------------------------------------------------------------------------


def default_data_source_class(framework: str, args: Any = None) -> type:
    """The data source the framework uses when `--data-source-path` is not set:
    `<pkg>.rollout.data_source.RolloutDataSourceWithBuffer`, or under miles' multi-LoRA its
    `MultiLoRAAsyncDataSource`. Raises FrameworkError without a framework."""
    path, name = DATA_SOURCE_MODULE, DEFAULT_DATA_SOURCE
    if framework == "miles" and getattr(args, "multi_lora", False):
        path, name = MILES_MULTI_LORA_DATA_SOURCE
    loaded = module(framework, path)
    cls = getattr(loaded, name, None) if loaded is not None else None
    if not isinstance(cls, type):
        raise FrameworkError(
            f"no {framework or 'slime/miles'}.{path}.{name} to wrap "
            "(is the framework importable in the RolloutManager?)"
        )
    return cls


# -- metrics -------------------------------------------------------------------------------------


def log_metrics(
    framework: str, args: Any, rollout_id: int, metrics: dict[str, Any], step_key: str
) -> bool:
    """Logs `metrics` with the framework's own logger (wandb / tensorboard) at the step it
    would use for `rollout_id`, with `step_key` (e.g. "rollout/step") set to that step.

    For the rollout modes that hand the log hook no metrics dict to extend. False when there is
    no framework logger to log with.
    """
    names = _TRACKING.get(framework)
    if names is None:
        return False
    tracking, metric_utils = (module(framework, name) for name in names)
    log = getattr(tracking, "log", None)
    step_of = getattr(metric_utils, "compute_rollout_step", None)
    if log is None or step_of is None:
        return False
    log(args, {**metrics, step_key: step_of(args, rollout_id)}, step_key=step_key)
    return True


# -- samples -------------------------------------------------------------------------------------


def status(sample: Any, name: str) -> Any:
    """The member `name` of the sample's own `Status` enum (PENDING, COMPLETED, ...)."""
    return getattr(type(sample).Status, name)


def clone_sample(sample: Any) -> Any:
    """An independent copy of `sample` whose metadata is a shallow copy of the original's.

    The dataset row under `metadata["instance"]` can be large and is never modified, so the
    per-turn samples of an episode share it instead of deep-copying it once per turn.
    """
    metadata = getattr(sample, "metadata", None)
    sample.metadata = {}
    try:
        clone = copy.deepcopy(sample)
    finally:
        sample.metadata = metadata
    clone.metadata = dict(metadata or {})
    return clone


# miles' adapter names (radixark/miles 31f1ca96): utils/lora.py:3 and utils/multi_lora.py:191-194.
MILES_LORA_ADAPTER_NAME = "miles_lora"
MILES_SLOT_LORA_PREFIX = "__miles_slot_"


# miles multi-LoRA (radixark/miles 31f1ca96): the slot rollout's `/generate` payload names the
# adapter's rid and prefix-cache key, and is not sent at all once the adapter has left the
# controller's sampleable set (rollout/sglang_rollout.py:184-198; make_rid and RID_SEPARATOR
# in utils/multi_lora.py:27,183-184; AdaptersCache in ray/multi_lora/controller.py:24-48).
ADAPTER_GONE = "ADAPTER_NOT_SAMPLEABLE"


@dataclass(frozen=True)
class AdapterBinding:
    """PolicyConfig.request_id_prefix and cache_key of a multi-LoRA sample's episode."""

    request_id_prefix: str = ""
    cache_key: str = ""


async def adapter_binding(framework: str, sample: Any) -> AdapterBinding | None:
    """What every policy call of the sample's episode must carry so miles' multi-LoRA can reach
    and separate it: the rid prefix its retire and free-slot aborts match (`<adapter>::`), and
    the prefix-cache key of the adapter's current weights (`<adapter>:v<version>`). An empty
    binding without multi-LoRA; None when the adapter is no longer sampleable (miles drops the
    generation: the episode must not start)."""
    adapter = getattr(sample, "adapter", None)
    if framework != "miles" or adapter is None:
        return AdapterBinding()
    from miles.ray.multi_lora.controller import AdaptersCache
    from miles.utils.multi_lora import RID_SEPARATOR

    run = await AdaptersCache().get(adapter.name)
    if run is None:
        return None
    return AdapterBinding(
        request_id_prefix=f"{adapter.name}{RID_SEPARATOR}",
        cache_key=f"{adapter.name}:v{run.version}",
    )


def lora_path(framework: str, args: Any, sample: Any) -> str:
    """The LoRA adapter miles would name on every `/generate` of this sample ("" = the base
    model), as its own rollout does (rollout/sglang_rollout.py:184-200): the multi-LoRA slot's
    adapter when the sample carries one, else "miles_lora" whenever LoRA is on for the
    rollout (`--lora-rank` > 0 or `--lora-adapter-path`, not `--lora-train-only`;
    utils/lora.py:6-17). slime has no LoRA flags, so "" there."""
    if framework != "miles":
        return ""
    adapter = getattr(sample, "adapter", None)
    if adapter is not None and getattr(adapter, "slot", None) is not None:
        return f"{MILES_SLOT_LORA_PREFIX}{adapter.slot}"
    lora_on = (getattr(args, "lora_rank", 0) or 0) > 0 or getattr(
        args, "lora_adapter_path", None
    ) is not None
    if lora_on and not getattr(args, "lora_train_only", False):
        return MILES_LORA_ADAPTER_NAME
    return ""
