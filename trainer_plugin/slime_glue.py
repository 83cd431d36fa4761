"""Everything the plugin reads from slime itself, found lazily so nothing imports slime early.

slime is not installable from PyPI (it lives in its own Docker image), and the hooks are loaded
by dotted path inside slime's RolloutManager actor, where slime's modules are already imported.
So this module only looks at `sys.modules` (for the generation state) or imports inside a
function (for `DynamicFilterOutput`), and has a behaviour for "no slime": never aborted, no
tokenizer, a field-compatible filter output.

Sample objects are never constructed from slime's class: new samples are clones of the one
slime passed in, and statuses come from that sample's own class (`type(sample).Status`).
"""

from __future__ import annotations

import copy
import importlib
import sys
from dataclasses import dataclass
from typing import Any

GENERATE_STATE_MODULE = "slime.rollout.sglang_rollout"
FILTER_TYPES_MODULE = "slime.rollout.filter_hub.base_types"


def generate_state() -> Any | None:
    """slime's `GenerateState` singleton when it exists; None otherwise.

    `GenerateState(args)` would create the singleton (loading a tokenizer) if it did not exist
    yet, so the instance is looked up in the singleton metaclass's registry instead.
    """
    module = sys.modules.get(GENERATE_STATE_MODULE)
    state_cls = getattr(module, "GenerateState", None) if module is not None else None
    if state_cls is None:
        return None
    for owner in (type(state_cls), state_cls):
        instances = getattr(owner, "_instances", None)
        if isinstance(instances, dict) and state_cls in instances:
            return instances[state_cls]
    return None


def abort_requested() -> bool:
    """True while slime is aborting the rollout (`GenerateState(args).aborted`)."""
    state = generate_state()
    return bool(getattr(state, "aborted", False)) if state is not None else False


def slime_tokenizer() -> Any | None:
    """The tokenizer slime loaded from `args.hf_checkpoint`, when slime is running."""
    state = generate_state()
    return getattr(state, "tokenizer", None) if state is not None else None


@dataclass
class FallbackDynamicFilterOutput:
    """Field-compatible with slime's `DynamicFilterOutput`; used only when slime is absent."""

    keep: bool
    reason: str | None = None


def dynamic_filter_output(keep: bool, reason: str | None) -> Any:
    """slime's own `DynamicFilterOutput` when importable.

    It must be slime's class: slime wraps any other return value as `DynamicFilterOutput(keep=
    value)`, and a dataclass instance is always truthy.
    """
    try:
        module = importlib.import_module(FILTER_TYPES_MODULE)
    except ImportError:
        return FallbackDynamicFilterOutput(keep=keep, reason=reason)
    return module.DynamicFilterOutput(keep=keep, reason=reason)


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
