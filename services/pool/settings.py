"""Settings of the pool (`swerl pool serve`), from SWERL_POOL_* env vars and CLI flags."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, SecretStr
from pydantic_settings import SettingsConfigDict

from swerl.chassis.settings import ServiceSettings


class PoolSettings(ServiceSettings):
    model_config = SettingsConfigDict(env_prefix="SWERL_POOL_", extra="ignore")

    port: int = 18090
    nodes: list[str] = Field(
        default_factory=list,
        description="static exec nodes as node_id=host:port (nodes may also register themselves)",
    )
    node_auth_token: SecretStr | None = Field(
        None, description="bearer token for the exec nodes (default: the pool's auth token)"
    )
    capability_secret: SecretStr | None = Field(
        None, description="secret shared with the nodes that signs lease capability tokens"
    )
    state_dir: Path = Field(Path("/var/lib/swerl/pool"), description="durable store directory")
    max_leases: int = Field(0, ge=0, description="global cap on sandboxes (0: nodes' sum)")
    default_ttl_s: float = Field(60.0, gt=0, description="lease lifetime when a request has none")
    max_ttl_s: float = Field(24 * 3600.0, gt=0, description="longest lease lifetime")
    default_wait_s: float = Field(60.0, ge=0, description="queue wait when a request has none")
    max_wait_s: float = Field(3600.0, ge=0, description="longest queue wait")
    node_expiry_slack_s: float = Field(
        10.0,
        ge=0,
        description="nodes reap a sandbox this long after its lease's expiry (the pool renews"
        " nodes lazily, and a restarted pool adopts leases within it)",
    )
    health_failure_threshold: int = Field(
        3, ge=1, description="health checks failed in a row before a node's leases are lost"
    )
    health_retry_interval_s: float = Field(0.5, gt=0, description="pause between health checks")
    expiry_interval_s: float = Field(0.25, gt=0, description="how often expiries are checked")
    maintenance_interval_s: float = Field(
        1.0, gt=0, description="how often spares, failed destroys and images are looked after"
    )
    image_refresh_interval_s: float = Field(30.0, gt=0, description="node image list refresh")
    spare_ttl_s: float = Field(600.0, gt=0, description="node-side lifetime of a warm spare")
    node_call_timeout_s: float = Field(60.0, gt=0, description="deadline of calls to nodes")
    adopt_grace_s: float = Field(
        10.0,
        ge=0,
        description="a lease a restarted pool adopts expires no sooner than this after the"
        " adoption (or its TTL, if longer): its holder reconnects with backoff, on a machine"
        " that may be slow",
    )
    initial_sync_timeout_s: float = Field(
        10.0, ge=0, description="how long a starting pool waits to re-read its known nodes"
    )
    token_grace_s: float = Field(
        60.0,
        ge=0,
        description="capability tokens stay valid this long past their lease's expiry, so a"
        " command stream opened with one outlives the renewal that replaced it (the exec"
        " client reopens its calls every 60 s and reads the current token then)",
    )
    token_reissue_fraction: float = Field(
        0.25,
        ge=0,
        le=1,
        description="a renewal keeps the lease's token while it stays valid token_grace_s past"
        " the new expiry; a new token runs this fraction of the lease's ttl longer, so a holder"
        " renewing every second costs one HMAC per ttl x fraction seconds instead of one per"
        " renewal (tokens are valid token_grace_s to token_grace_s + ttl x fraction past the"
        " lease's expiry; 0 mints on every renewal)",
    )
    gc_middle_threshold: int = Field(
        100,
        ge=0,
        description="young collections between two collections of the garbage collector's"
        " middle generation in `swerl pool serve` (Python's default is 10; 0 keeps it). Objects"
        " still alive at a middle collection, such as every KeepAlive stream's pending read, move"
        " to the oldest generation, and each full collection of it walks the whole lease table"
        " (~100-200 ms at 20,000 leases) while every call waits",
    )
    release_wait_s: float = Field(
        5.0, ge=0, description="how long ReleaseLease waits for the node's destroy confirmation"
    )
    unclaimed_grace_s: float = Field(
        10.0,
        ge=0,
        description="a lease whose AcquireLease callers all left while its sandbox was being"
        " made is released this long after it is ready unless a retry with the same request_id"
        " or a KeepAlive claims it",
    )
    ended_retention_s: float = Field(300.0, ge=0, description="ENDED leases kept for ListLeases")
    pull: bool = Field(
        True,
        description="pull an image no node has onto a node when a lease needs it (--no-pull:"
        " never pull; such an image is refused at once, FAILED_PRECONDITION/IMAGE_NOT_PRESENT,"
        " for operators who pre-pull every image)",
    )
    image_replicas: int = Field(
        2,
        ge=1,
        description="home nodes per image (rendezvous hashing of image x node over the healthy"
        " nodes): where a missing image is pulled first and where PrefetchImages pulls; each node"
        " holds about image_replicas/N of a dataset",
    )
    pulls_per_node: int = Field(
        2, ge=1, description="image pulls a node runs at once (pulls a lease waits on go first)"
    )
    pull_attempts: int = Field(
        2, ge=1, description="attempts of a pull that fails with PULL_FAILED (a cut connection)"
    )
    pull_backoff_s: float = Field(
        2.0,
        gt=0,
        description="after a pull fails with REGISTRY_UNREACHABLE or PULL_FAILED, no new pull"
        " from that registry (or of that image) for this long, doubling per failure in a row;"
        " requests meanwhile get the failure at once",
    )
    pull_backoff_max_s: float = Field(60.0, gt=0, description="longest pull backoff")
    pull_failure_ttl_s: float = Field(
        30.0,
        ge=0,
        description="an image that failed for a reason no retry cures (IMAGE_NOT_FOUND,"
        " REGISTRY_AUTH, IMAGE_TOO_LARGE) is refused at once this long without a new pull",
    )
