"""What one episode runs with, decoded from its start (`EpisodeSpec`), and the sampling
parameters as the policy server wants them. Pure domain: no gRPC."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from swerl.agent.config import AgentConfig
from swerl.agent.judging.steps import PrmSpec
from swerl.agent.v1 import agent_pb2 as pb
from swerl.exec.v1 import evaluate_pb2

# Who drives an episode whose EpisodeOptions.harness is empty: swerl's own loop (the `builtin`
# harness, swerl.agent.harnesses). Every other name is a harness with one budget (budget.py).
DEFAULT_HARNESS = "builtin"


def is_harnessed(harness: str) -> bool:
    """Whether an episode's `EpisodeOptions.harness` names a harness other than swerl's loop."""
    return harness not in ("", DEFAULT_HARNESS)


@dataclass(frozen=True)
class EpisodeSpec:
    episode_id: str
    instance: evaluate_pb2.SweInstance
    config: AgentConfig
    api: pb.PolicyApi
    endpoint: str
    model: str
    sampling_params: dict[str, Any]
    request_timeout_s: float
    max_turns: int
    max_context_tokens: int
    max_new_tokens: int
    wall_timeout_s: float
    command_timeout_s: float
    eval_timeout_s: float
    dynamic_history: bool = False
    return_routed_experts: bool = False
    # PolicyConfig.lora_path: the adapter every policy call names ("" = the base model).
    lora_path: str = ""
    # PolicyConfig.request_id_prefix / cache_key: SGLang's `rid` prefix and `extra_key`.
    request_id_prefix: str = ""
    cache_key: str = ""
    artifact_dir: str = ""
    skip_evaluation: bool = False
    env: dict[str, str] = field(default_factory=dict)
    owner: str = ""
    # EpisodeOptions.avoid_node_ids: nodes the pool places this episode's sandboxes elsewhere
    # than while another has room (a trainer's re-run of an episode the infrastructure failed).
    avoid_node_ids: tuple[str, ...] = ()
    prm: PrmSpec = field(default_factory=PrmSpec)
    # EpisodeOptions.branch: the trunk runs `branch_at` turns, then `branch_count` branches go on.
    branch_at: int = 0
    branch_count: int = 0
    # EpisodeOptions.harness: who drives the episode in its sandbox (swerl.agent.harnesses).
    harness: str = DEFAULT_HARNESS
    # PolicyConfig.tokenizer_path: a harness episode's gateway session renders with it.
    tokenizer_path: str = ""

    @property
    def branching(self) -> bool:
        return self.branch_count > 0

    @property
    def lease_owner(self) -> str:
        """The owner the episode's leases carry (the start's, else `agent/<episode id>`)."""
        return self.owner or f"agent/{self.episode_id}"


def sampling_params_of(struct: Mapping[str, Any]) -> dict[str, Any]:
    """Struct numbers are floats; SGLang wants ints for the integer keys."""
    params = dict(struct)
    for key in ("top_k", "max_new_tokens", "min_new_tokens", "sampling_seed", "n"):
        value = params.get(key)
        if isinstance(value, float) and value.is_integer():
            params[key] = int(value)
    if isinstance(params.get("stop_token_ids"), list):
        params["stop_token_ids"] = [int(x) for x in params["stop_token_ids"]]
    return params
