"""Top-p replay and routing replay: what the trainer asks for and the Sample fields answering it.

- Top-p replay (`--rollout-top-p < 1`): slime's train-data step asserts that every sample
  carries `rollout_top_p_token_ids` and `rollout_top_p_token_offsets` (the kept token set of
  each response token, flattened, and `response_length + 1` offsets). slime's own generate asks
  SGLang for them through the sampling params (`custom_params.return_top_p_token_ids`), which
  the plugin passes to the agent unchanged; the agent returns them per token record
  (`TokenRecord.top_p_token_ids/offsets`, observation tokens as empty spans), and they are set
  on the sample as they are.
- Routing replay (`--use-rollout-routing-replay`, MoE policies): the trainer replays the experts
  SGLang routed every token to (`rollout_routed_experts`, shape `[len(tokens) - 1, num_layers,
  moe_router_topk]`). The plugin asks the agent for them (`PolicyConfig.return_routed_experts`)
  and refuses, at the first generate call that comes back without them, with an error naming
  the flag: training on such samples would fail only after a whole rollout.

Nothing here imports a framework; numpy is used when present (both frameworks' images have it),
else nested lists, which `torch.as_tensor` takes as well.
"""

from __future__ import annotations

import itertools
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from swerl.agent.v1 import agent_pb2

ROUTING_REPLAY_FLAG = "--use-rollout-routing-replay"


class RoutingReplayError(RuntimeError):
    """Routing replay is on but the episodes cannot give the trainer routed experts."""


class TopPReplayError(RuntimeError):
    """`--rollout-top-p < 1` but the policy engine returns no top-p sets: stock SGLang has
    none (only slime's patched build, docker/patch/v0.5.15.post1/sglang-top_p.patch, returns
    them), so every episode would be dropped and the rollout would resample forever."""


class InvalidReplayRecord(ValueError):
    """A token record's replay data contradicts its own tokens."""


@dataclass(frozen=True)
class ReplaySpec:
    """What the trainer's arguments ask each sample to carry."""

    top_p: bool = False
    routed_experts: bool = False
    num_layers: int = 0
    moe_router_topk: int = 0

    @classmethod
    def for_call(
        cls, args: Any, sampling_params: Mapping[str, Any], evaluation: bool
    ) -> ReplaySpec:
        """What one generate call must return. Top-p sets when the sampling params ask SGLang
        for them (slime adds the request exactly when --rollout-top-p < 1, and then asserts the
        fields on every training sample); routed experts with --use-rollout-routing-replay.
        Evaluation samples never reach the trainer, so they carry neither."""
        if evaluation:
            return cls()
        custom = sampling_params.get("custom_params")
        top_p = isinstance(custom, Mapping) and bool(custom.get("return_top_p_token_ids"))
        experts = bool(getattr(args, "use_rollout_routing_replay", False))
        layers = int(getattr(args, "num_layers", 0) or 0)
        topk = int(getattr(args, "moe_router_topk", 0) or 0)
        if experts and (layers <= 0 or topk <= 0):
            raise RoutingReplayError(
                f"{ROUTING_REPLAY_FLAG} is on but the trainer's arguments give no num_layers /"
                f" moe_router_topk (got {layers} / {topk}) to shape the routed experts by"
            )
        return cls(
            top_p=top_p,
            routed_experts=experts,
            num_layers=layers,
            moe_router_topk=topk,
        )

    @property
    def experts_per_token(self) -> int:
        return self.num_layers * self.moe_router_topk


def top_p_sets(record: agent_pb2.TokenRecord) -> tuple[list[int], list[int]] | None:
    """(token ids, offsets) of a record's top-p replay data; None when it carries none."""
    ids, offsets = record.top_p_token_ids, record.top_p_token_offsets
    if not ids and not offsets:
        return None
    n = len(record.response_ids)
    if len(offsets) != n + 1 or offsets[0] != 0 or offsets[-1] != len(ids):
        raise InvalidReplayRecord(
            f"top-p offsets: {len(offsets)} for {n} response tokens (want {n + 1}), first"
            f" {offsets[0] if offsets else None}, last {offsets[-1] if offsets else None} for"
            f" {len(ids)} ids"
        )
    if any(b < a for a, b in itertools.pairwise(offsets)):
        raise InvalidReplayRecord("top-p offsets decrease")
    return list(ids), list(offsets)


def empty_top_p_sets(response_length: int) -> tuple[list[int], list[int]]:
    """Top-p data of a sample that is never trained on: an empty span for every token (what
    slime itself gives tokens the policy did not sample)."""
    return [], [0] * (response_length + 1)


def routed_experts(record: agent_pb2.TokenRecord, spec: ReplaySpec) -> Any:
    """The record's routed experts shaped `[len(tokens) - 1, num_layers, moe_router_topk]`.

    Raises RoutingReplayError when the policy's expert width disagrees with the trainer's model
    arguments (a setup mistake no episode can fix), InvalidReplayRecord when the data does not
    cover the record's tokens.
    """
    rows = len(record.prompt_ids) + len(record.response_ids) - 1
    width = record.routed_experts_per_token
    if width != spec.experts_per_token:
        raise RoutingReplayError(
            f"{ROUTING_REPLAY_FLAG}: the policy routed each token to {width} experts over all"
            f" layers, but the trainer's num_layers x moe_router_topk is {spec.num_layers} x"
            f" {spec.moe_router_topk} = {spec.experts_per_token}: do the model arguments"
            " match the served model?"
        )
    data = record.routed_experts
    if len(data) != 4 * rows * width:
        raise InvalidReplayRecord(
            f"routed experts: {len(data)} bytes for {rows} tokens x {width} values"
        )
    return _int32_array(data, rows, spec.num_layers, spec.moe_router_topk)


def placeholder_routed_experts(rows: int, spec: ReplaySpec) -> Any:
    """Routed experts of a sample that is never trained on: experts 0..topk-1 in every layer.

    Distinct experts per token, so the trainer's check that no MoE layer is all zeros holds.
    """
    row = list(range(spec.moe_router_topk)) * spec.num_layers
    flat = row * rows
    values = _pack(flat)
    return _int32_array(values, rows, spec.num_layers, spec.moe_router_topk)


def _pack(values: list[int]) -> bytes:
    from array import array

    packed = array("i", values)
    if sys.byteorder != "little":
        packed.byteswap()
    return packed.tobytes()


def _int32_array(data: bytes, rows: int, layers: int, topk: int) -> Any:
    try:
        import numpy as np
    except ImportError:  # nested lists, as slime's Sample also accepts
        from array import array

        flat = array("i")
        flat.frombytes(data)
        if sys.byteorder != "little":
            flat.byteswap()
        per_row = layers * topk
        return [
            [
                list(flat[r * per_row + layer * topk : r * per_row + (layer + 1) * topk])
                for layer in range(layers)
            ]
            for r in range(rows)
        ]
    # A writable copy: the trainer may turn it into a tensor in place.
    return np.frombuffer(data, dtype="<i4").reshape(rows, layers, topk).astype(np.int32)
