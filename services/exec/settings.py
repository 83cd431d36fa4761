"""Settings of the exec node (`swerl exec serve`), from SWERL_EXEC_* env vars and CLI flags."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr
from pydantic_settings import SettingsConfigDict

from swerl.chassis.settings import ServiceSettings

# The node's own bounds on its work. Its client (swerl.exec.client) derives each call's deadline
# from them, so they live here, in a module a client imports without the node's dependencies.
# A command's timeout when its request has none (timeout 0): ExecSettings.default_timeout_s, and
# the client's deadline for such a command (it cannot ask the node) is this plus a margin.
DEFAULT_COMMAND_TIMEOUT_S = 180.0
# How long GetDiff's script may run in the sandbox (swerl.exec.diff).
DIFF_TIMEOUT_S = 120.0
# An Evaluate's tests' limit when its request has none (swerl.exec.evaluate).
DEFAULT_EVALUATION_TIMEOUT_S = 600.0
# A harness bundle's build (OpenHarness on a node that lacks it, swerl.exec.bundles) runs its
# subprocesses (the Node runtime's `pip download`, the harness's `npm install`) one after the
# other, each bounded by this.
HARNESS_BUILD_STEP_TIMEOUT_S = 900.0
# A sandbox's lifetime when its request has none: ExecSettings.default_ttl_s.
DEFAULT_SANDBOX_TTL_S = 3600.0


class ExecSettings(ServiceSettings):
    model_config = SettingsConfigDict(env_prefix="SWERL_EXEC_", extra="ignore")

    port: int = 5000
    node_id: str = Field(default_factory=socket.gethostname, description="stable id of this node")
    max_sandboxes: int = Field(64, description="sandboxes this node hosts at once")
    state_dir: Path = Field(Path("/var/lib/swerl/exec"), description="durable store directory")
    default_ttl_s: float = Field(
        DEFAULT_SANDBOX_TTL_S, description="sandbox lifetime when a request has none"
    )
    max_ttl_s: float = Field(24 * 3600.0, description="longest lifetime a request may ask for")
    reap_interval_s: float = Field(5.0, description="how often expired sandboxes are reaped")
    orphan_grace_s: float = Field(
        60.0,
        gt=0,
        description="age past which a container of this node that no sandbox accounts for (a"
        " create whose start and cleanup both failed) is removed; longer than any create",
    )
    default_cpus: float = 2.0
    default_memory_bytes: int = 4 << 30
    default_pids: int = 1024
    default_timeout_s: float = Field(
        DEFAULT_COMMAND_TIMEOUT_S, description="command timeout when a request has none"
    )
    default_max_output_bytes: int = 1 << 20
    max_output_bytes_limit: int = Field(64 << 20, description="largest output cap a request gets")
    max_diff_bytes: int = 64 << 20
    allow_bridge_network: bool = False
    evaluation_network: bool = Field(
        False,
        description="give Evaluate's own sandboxes the bridge network (never agent sandboxes), "
        "for tasks whose install step or tests need egress",
    )
    evaluation_package_index: str = Field(
        "",
        description="a package index URL (a mirror this node serves or names) that Evaluate's "
        "install steps use instead of PyPI, e.g. for offline evaluation",
    )
    cap_add: list[str] = Field(
        default_factory=lambda: [
            "CHOWN",
            "DAC_OVERRIDE",
            "FOWNER",
            "FSETID",
            "KILL",
            "SETGID",
            "SETUID",
        ],
        description="capabilities kept after dropping all (what root in a test suite needs)",
    )
    docker_health_interval_s: float = 2.0
    docker_ping_timeout_s: float = Field(
        4.0,
        gt=0,
        description="a health ping dockerd does not answer within this is a hung dockerd: the"
        " node turns NOT_SERVING and its Docker calls in flight fail with DOCKER_UNAVAILABLE",
    )
    docker_host: str | None = Field(
        None,
        description="the runtime's API socket this node drives, e.g. unix:///run/docker-b.sock"
        " (default: for docker DOCKER_HOST, else the local socket; for podman"
        " unix:///run/podman/podman.sock)",
    )
    runtime: Literal["docker", "podman"] = Field(
        "docker",
        description="the container runtime: dockerd, or Podman through its Docker-compatible"
        " service (`podman system service`; deploy/podman-up.sh starts one)",
    )
    isolation: Literal["runc", "gvisor"] = Field(
        "runc",
        description="the isolation class of every sandbox: the runtime's default OCI runtime,"
        " or gVisor (runsc, registered with the runtime as `runsc`; deploy/gvisor-up.sh)",
    )
    image_disk_budget: int = Field(
        0,
        ge=0,
        description="bytes of cached task images this node keeps (Docker's unpacked image size;"
        " pinned images do not count); a pull that would exceed it evicts least-recently-used"
        " unused images first; 0 = unlimited",
    )
    pinned_images: list[str] = Field(
        default_factory=list,
        description="images never evicted, in addition to base_image",
    )
    base_image: str = Field(
        "swerl-base:bookworm", description="the image task images are built FROM; always pinned"
    )
    image_pull_attempts: int = Field(
        3, ge=1, description="attempts of one pull when the failure is transient"
    )
    image_pull_retry_wait_s: float = Field(
        1.0, ge=0, description="first wait between pull attempts (doubles, with jitter)"
    )
    image_pull_failure_memory_s: float = Field(
        5.0,
        ge=0,
        description="how long a failed pull's outcome answers new requests for the image"
        " without asking the registry again",
    )
    docker_threads: int = 32
    capability_secret: SecretStr | None = Field(
        None,
        description="secret shared with the pool; when set, Exec/GetDiff/Evaluate on a sandbox"
        " need the lease's capability token",
    )
    pool_address: str | None = Field(None, description="pool to register with at start-up")
    pool_auth_token: SecretStr | None = Field(
        None, description="bearer token for the pool (default: this node's auth token)"
    )
    advertise_address: str | None = Field(
        None, description="host:port the pool and agents dial (default: the bound address)"
    )
    node_labels: dict[str, str] = Field(
        default_factory=dict, description="labels for the pool's node_selector (JSON object)"
    )
    harness_bundle_dir: Path | None = Field(
        None,
        description="where this node keeps its read-only harness bundles (Node runtime + CLI"
        " harness, one directory per harness and version, built on demand or by `swerl exec"
        " bundle`); mounted read-only into every sandbox at /opt/swerl/bundles (default:"
        " <state_dir>/bundles)",
    )
    harness_package_index: str = Field(
        "",
        description="PyPI index the bundle builder downloads the Node runtime wheel from (empty:"
        " pip's default)",
    )
    evaluation_host_network_test_only: bool = Field(
        False,
        description="TEST ONLY, never on a real node: Evaluate's own sandboxes join this node's "
        "network namespace (its 127.0.0.1 and its gRPC port included), so a test can serve a "
        "task's data on loopback; overrides evaluation_network",
    )

    @property
    def bundle_dir(self) -> Path:
        """The directory of the node's harness bundles."""
        return self.harness_bundle_dir or self.state_dir / "bundles"
