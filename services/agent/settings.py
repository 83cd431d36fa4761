"""Settings of the agent service (`swerl agent serve`), from SWERL_AGENT_* env vars and flags."""

from __future__ import annotations

from pydantic import Field, SecretStr
from pydantic_settings import SettingsConfigDict

from swerl.agent.budget import DEFAULT_LEASE_WAIT_S
from swerl.agent.policy.clients import RETRY_ATTEMPTS, RETRY_MAX_DELAY_S
from swerl.chassis.settings import ServiceSettings

# The gateway's CPU pool, apart from the episodes': one thread. With more, a burst of calls'
# rendering and tokenizing ran on several threads that took the cores (and the GIL) from the
# event loop's thread; 200 sessions x 6 turns on 2 cores, five runs each: worst loop stall 13-22
# ms with 4 threads, 6-15 ms with one. One thread does ~1,000 calls/s of this work (~1 ms CPU
# per call).
GATEWAY_CPU_THREADS = 1
# The limit on one policy call when the request sets none (`policy_request_timeout_s`): the
# episodes' policy calls and the gateway sessions' that name none.
POLICY_REQUEST_TIMEOUT_S = 600.0


class AgentSettings(ServiceSettings):
    model_config = SettingsConfigDict(env_prefix="SWERL_AGENT_", extra="ignore")

    port: int = 18091
    pool_address: str = Field("127.0.0.1:18090", description="PoolService host:port")
    pool_auth_token: SecretStr | None = Field(
        None, description="bearer token for the pool and its nodes (default: this auth token)"
    )
    pool_tls_ca_file: str | None = Field(None, description="CA of the pool's TLS certificate")
    lease_wait_s: float = Field(
        DEFAULT_LEASE_WAIT_S, description="how long an episode waits for a sandbox"
    )
    cpu_threads: int = Field(8, description="threads for tokenization and template rendering")
    tokenizer_processes: int = Field(
        2,
        description="worker processes for tokenization (HF tokenizers hold the GIL, so threads"
        " would stall the event loop); 0 tokenizes in the CPU threads",
    )
    max_episodes: int = Field(1024, description="episodes this process runs at once")
    gc_full_threshold: int = Field(
        100,
        description="middle-generation collections between two full collections of the"
        " garbage collector (Python's default is 10); 0 keeps Python's setting",
    )
    policy_request_timeout_s: float = Field(
        POLICY_REQUEST_TIMEOUT_S, description="limit on one policy call when the request sets none"
    )
    policy_connect_attempts: int = Field(
        RETRY_ATTEMPTS,
        description="attempts of one policy call: a connection failure, an HTTP 500/502/503/504"
        " answer or no answer within the request's timeout is sent again (1 = never)",
    )
    policy_connect_max_delay_s: float = Field(
        RETRY_MAX_DELAY_S,
        description="total time one policy call is retried for, from its first attempt; a call"
        " still failing then ends the episode INFRA_ERROR with the last failure",
    )
    policy_max_connections: int = Field(
        1024, description="HTTP connections to policy servers, over all episodes"
    )
    routing_key_header: str = Field(
        "X-SMG-Routing-Key",
        description="HTTP header that carries the episode id on every policy call of the"
        " episode, so a consistent-hashing router keeps its turns on one engine (and its"
        " prefix cache warm); empty sends none",
    )
    openai_api_key: SecretStr | None = Field(
        None, description="API key for POLICY_API_OPENAI_CHAT servers"
    )
    prm_endpoint: str | None = Field(None, description="PrmService host:port for PRM judging")
    prm_auth_token: SecretStr | None = Field(
        None, description="bearer token for PrmService (default: this agent's auth token)"
    )
    artifact_root: str | None = Field(
        None, description="when set, artifact_dir of requests must lie below it"
    )
    # -- model gateway (issue 26) --
    gateway_port: int | None = Field(
        None,
        description="serve the model gateway (OpenAI/Anthropic-compatible HTTP per session) on"
        " this port; 0 picks a free port; unset serves none",
    )
    gateway_host: str | None = Field(
        None, description="interface of the gateway's HTTP port (default: --host)"
    )
    gateway_public_url: str | None = Field(
        None,
        description="base URL clients reach the gateway at, put in the sessions' base URLs"
        " (default: http://<host>:<gateway port>)",
    )
    gateway_max_sessions: int = Field(4096, description="open gateway sessions at most")
    gateway_cpu_threads: int = Field(
        GATEWAY_CPU_THREADS,
        ge=1,
        description="threads of the gateway's own CPU pool (rendering and tokenizing its calls);"
        " more took the cores from the event loop in a burst of calls",
    )
