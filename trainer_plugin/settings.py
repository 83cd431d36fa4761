"""The plugin's settings, in one place: `SWERL_PLUGIN_*` env vars, then slime's custom config.

slime loads the hooks inside its RolloutManager Ray actor, so the plugin cannot take CLI flags.
Its settings come from two sources:

- env vars `SWERL_PLUGIN_<NAME>` (set them in the Ray job's runtime env, see deploy/slime), and
- keys of slime's `--custom-config-path` YAML, which slime turns into attributes of `args`.
  The plugin reads the attributes named `swerl_<name>` (e.g. `swerl_dynamic_history: true`), so
  its keys never collide with slime's own arguments.

A key in the custom config wins over the env var, which wins over the default.
"""

from __future__ import annotations

import weakref
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from swerl.agent import budget

CONFIG_KEY_PREFIX = "swerl_"


class PluginSettings(BaseSettings):
    """Everything the slime hooks need to know that slime itself does not tell them."""

    model_config = SettingsConfigDict(env_prefix="SWERL_PLUGIN_", extra="ignore")

    # `| str`: the env var is a plain comma-separated list, which pydantic-settings (every
    # version since 2.2) then hands to the validator as is instead of failing to parse JSON.
    framework: Literal["auto", "slime", "miles"] = Field(
        "auto",
        description="The training framework whose classes and abort flag the hooks use: auto = "
        "the one already imported in the RolloutManager, else the importable one (slime first).",
    )
    agent_addresses: list[str] | str = Field(
        default_factory=lambda: ["127.0.0.1:18091"],
        description="AgentService addresses (host:port), comma-separated; episodes are spread "
        "over them, each to the one with the fewest episodes in flight from this process.",
    )
    agent_token: SecretStr | None = Field(None, description="Bearer token of the agent service.")
    agent_tls_ca_file: Path | None = Field(
        None, description="PEM CA of the agent service's certificate (enables TLS)."
    )
    dynamic_history: bool = Field(
        False,
        description="One Sample per turn (each the exact prompt the model saw that turn), all "
        "sharing rollout_id; generate then always returns a list.",
    )
    branch_at_turn: int = Field(
        0,
        ge=0,
        description="Branching rollouts: > 0 makes the n samples of one prompt group one "
        "episode that runs a shared trunk for this many turns, then forks the sandbox and the "
        "exact token state into n branches (one per sample); 0 = off (independent episodes).",
    )
    branch_in_eval: bool = Field(
        False,
        description="Branch evaluation episodes too (groups of n_samples_per_eval_prompt); off = "
        "evaluation runs independent episodes whatever branch_at_turn says.",
    )
    branch_rendezvous_timeout_s: float = Field(
        30.0,
        gt=0,
        description="How long the first member of a prompt group waits for the others before "
        "its branching episode starts with the members present (one alone runs unbranched); a "
        "member arriving after its group started runs its own unbranched episode.",
    )
    prm_enabled: bool = Field(False, description="Judge every step with the PRM service.")
    prm_endpoint: str = Field("", description="PrmService host:port; empty = the agent's own.")
    prm_m: int = Field(0, ge=0, description="PRM votes per step; 0 = the PRM service default.")
    prm_coef: float = Field(0.0, description="Weight of the PRM step scores in the reward.")
    prm_seed: int = Field(0, description="Base seed of the PRM votes.")
    max_turns: int = Field(0, ge=0, description="Turn limit; 0 = the agent config's default.")
    max_context_tokens: int = Field(
        0,
        ge=0,
        description="Context budget in tokens; 0 = slime's --rollout-max-context-len when set, "
        "else the agent's default.",
    )
    max_new_tokens: int = Field(
        0, ge=0, description="Tokens per turn; 0 = the sampling params' max_new_tokens."
    )
    wall_timeout_s: float = Field(0.0, ge=0, description="Agent loop wall time; 0 = default.")
    command_timeout_s: float = Field(0.0, ge=0, description="Per-command limit; 0 = default.")
    eval_timeout_s: float = Field(0.0, ge=0, description="Evaluation limit; 0 = default.")
    episode_deadline_s: float = Field(
        0.0,
        ge=0,
        description="Overall limit on one generate call: past it the episode is cancelled and "
        "the call returns a placeholder for removal. 0 = the client deadline of the episode "
        "(swerl.agent.budget.client_deadline): the agent's wait for a sandbox + the episode's "
        "limits + the grading's overhead + 60 s; a value not above the agent's bound is refused.",
    )
    agent_lease_wait_s: float = Field(
        budget.DEFAULT_LEASE_WAIT_S,
        ge=0,
        description="The agents' wait for a sandbox (their SWERL_AGENT_LEASE_WAIT_S), which the "
        "episode deadline counts: set it where the agents wait longer than their default.",
    )
    abort_poll_interval_s: float = Field(
        0.05, gt=0, description="How often slime's abort flag is looked at."
    )
    cancel_grace_s: float = Field(
        1.5,
        gt=0,
        description="After sending cancel, how long the agent gets to return the partial result "
        "before the call itself is cancelled (which still stops the episode and frees its "
        "sandbox).",
    )
    connect_attempts: int = Field(
        3,
        ge=1,
        description="Attempts to start an episode while agents are UNAVAILABLE before any "
        "message arrived (each on the next address).",
    )
    episode_attempts: int = Field(
        3,
        ge=1,
        description="Attempts an episode gets in one generate call while it ends in an infra "
        "failure (INFRA_ERROR, or its stream broke): a failed attempt is run again, same "
        "sampling params and seed, before any of its tokens reaches the trainer, so one infra "
        "failure no longer costs its prompt group (reruns.py). 1 = no re-run.",
    )
    unavailable_cooldown_s: float = Field(
        10.0,
        ge=0,
        description="How long an agent address that refused a connection gets no new episodes "
        "(unless every address did).",
    )
    artifact_dir: str = Field(
        "", description="Directory on the agent's host for per-episode artifacts; empty = none."
    )
    config_name: str = Field("", description="Agent config (templates, defaults); empty = default.")
    harness: str = Field(
        "",
        description="Who drives each episode in its sandbox (EpisodeOptions.harness): builtin "
        "(swerl's own loop) or another harness the agent has; empty = builtin.",
    )
    tokenizer_path: str = Field(
        "", description="Tokenizer directory as the agent sees it; empty = slime's hf_checkpoint."
    )
    policy_endpoint: str = Field(
        "", description="Policy URL as the agent sees it; empty = slime's router ip:port."
    )
    policy_model: str = Field("", description="Model name recorded in the artifacts.")
    owner_prefix: str = Field(
        "", description="Prefix of the lease owner string; empty = the framework's name."
    )
    decode_response_text: bool = Field(
        True,
        description="Fill Sample.response with the decoded response tokens (for slime's logs) "
        "using the tokenizer slime already loaded; off = empty text.",
    )
    pool_address: str = Field(
        "",
        description="PoolService host:port for image prefetch: each generate call sends its "
        "sample's image to PrefetchImages (batched per prefetch_delay_s), so the batch's pulls "
        "start early; empty = no prefetch.",
    )
    pool_token: SecretStr | None = Field(None, description="Bearer token of the pool.")
    prefetch_delay_s: float = Field(
        0.2, gt=0, description="How long images are collected before one PrefetchImages call."
    )
    prefetch_next_batches: int = Field(
        1,
        ge=0,
        description="With the data source swerl.trainer_plugin.data_source.PrefetchingDataSource "
        "(--data-source-path): how many batches beyond the one fetched have their images "
        "prefetched when a batch is fetched (each at least a rollout batch of prompts); 0 = the "
        "fetched batch only.",
    )
    data_source_base: str = Field(
        "",
        description="The data source class PrefetchingDataSource extends (dotted path); empty = "
        "the framework's default, <framework>.rollout.data_source.RolloutDataSourceWithBuffer.",
    )
    max_receive_message_bytes: int = Field(
        256 << 20, gt=0, description="Largest RunEpisode message accepted (whole trajectories)."
    )

    @field_validator("agent_addresses", mode="before")
    @classmethod
    def _split_addresses(cls, value: Any) -> Any:
        if isinstance(value, str):
            value = value.split(",")
        if isinstance(value, (list, tuple)):
            addresses = [str(a).strip() for a in value if str(a).strip()]
            if not addresses:
                raise ValueError("agent_addresses needs at least one host:port")
            return addresses
        return value

    @model_validator(mode="after")
    def _deadline_past_the_agents_bound(self) -> PluginSettings:
        # The agent's budgets (its wait for a sandbox, its loop, then the grading) end the
        # episode and free its sandbox; the call's own deadline must come after all of them,
        # else a long episode is cut from this side while the agent still works for it.
        deadline = budget.client_deadline(
            wall_timeout_s=self.wall_timeout_s,
            eval_timeout_s=self.eval_timeout_s,
            harness=self.harness,
            config_name=self.config_name,
            lease_wait_s=self.agent_lease_wait_s,
        )
        if not self.episode_deadline_s:
            self.episode_deadline_s = deadline.deadline_s
        deadline.refuse_shorter("episode_deadline_s", self.episode_deadline_s)
        return self

    @field_validator("agent_token", "pool_token", mode="before")
    @classmethod
    def _empty_token_is_no_token(cls, value: object) -> object:
        return None if value == "" else value


# Keyed by id(args) (slime's argparse.Namespace is unhashable), guarded by a weak reference so a
# recycled id never returns another object's settings.
_cache: dict[int, tuple[weakref.ref[Any], PluginSettings]] = {}


def settings_from_args(args: Any) -> PluginSettings:
    """The plugin settings for slime's `args`: custom-config keys over env vars over defaults."""
    overrides = {
        name: getattr(args, CONFIG_KEY_PREFIX + name)
        for name in PluginSettings.model_fields
        if getattr(args, CONFIG_KEY_PREFIX + name, None) is not None
    }
    return PluginSettings(**overrides)


def plugin_settings(args: Any) -> PluginSettings:
    """`settings_from_args`, computed once per `args` object (slime passes the same one)."""
    key = id(args)
    cached = _cache.get(key)
    if cached is not None and cached[0]() is args:
        return cached[1]
    settings = settings_from_args(args)
    try:
        ref = weakref.ref(args, lambda _: _cache.pop(key, None))
    except TypeError:  # not weak-referenceable: read the settings every time
        return settings
    _cache[key] = (ref, settings)
    return settings
