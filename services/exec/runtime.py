"""The exec node's seam to its container runtime: the calls the node makes, in runtime-neutral
values and errors. `swerl.exec.docker_backend.DockerBackend` is the implementation over the
Docker Engine API (dockerd, or Podman's Docker-compatible service); `swerl.exec.runtimes` picks
one from the node's settings. Nothing else in the node imports a runtime's SDK.

A runtime that stops answering is the node's to detect (swerl.exec.health pings it with a short
bound): `mark_down` makes every waiting and every new call fail at once with DockerUnavailable
(the node's UNAVAILABLE, whatever the runtime) until `mark_up`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

# An image as the runtime describes it: the Docker Engine API's image object (`Id`, `Size`,
# `RepoTags`, `RepoDigests`, `Config.Labels`, and in a listing `Labels`), which Podman's
# compatible service gives in the same shape.
ImageRecord = dict[str, Any]


class ContainerNotRunning(OSError):
    """The runtime refused an exec because the container is stopped or is stopping right now."""


class RuntimeApiError(OSError):
    """The runtime answered a call with an error (`status_code` its HTTP status where it has
    one, `explanation` its own words): a refusal the caller may handle, not the runtime being
    unreachable."""

    def __init__(self, message: str, status_code: int | None = None, explanation: str = "") -> None:
        super().__init__(message)
        self.status_code = status_code
        self.explanation = explanation or message


class RuntimeNotFound(RuntimeApiError):
    """The container, image or exec named does not exist (the runtime's 404)."""


@dataclass(frozen=True)
class ContainerSpec:
    name: str
    image: str
    workdir: str
    env: dict[str, str]
    labels: dict[str, str]
    cpus: float
    memory_bytes: int
    pids: int
    network: str  # "none" | "bridge"
    cap_add: tuple[str, ...]
    # host path -> container path, read-write (the sandbox's I/O directory).
    binds: tuple[tuple[str, str], ...] = ()
    # host path -> container path, read-only (the node's harness bundles).
    ro_binds: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class ContainerInfo:
    container_id: str
    name: str
    labels: dict[str, str]
    running: bool
    status: str


@dataclass(frozen=True)
class ContainerState:
    running: bool
    # Of the last run, when the container is not running.
    exit_code: int
    oom_killed: bool
    error: str


@dataclass(frozen=True)
class PullProgress:
    status: str  # the runtime's status line, e.g. "Downloading"
    current_bytes: int = 0
    total_bytes: int = 0


class ContainerRuntime(Protocol):
    """What the exec node asks of a container runtime. Every call may raise DockerUnavailable
    (the runtime unreachable, or marked down) or RuntimeApiError (it refused)."""

    # Which runtime and isolation class this is (`--runtime`, `--isolation`), for logs, node
    # info and errors.
    runtime_name: str
    isolation: str
    # Why the runtime was last marked down, and when (wall clock; 0: never).
    down_message: str
    last_down_wall: float

    def mark_down(self, message: str) -> None: ...
    def mark_up(self) -> None: ...
    def close(self) -> None: ...

    # -- daemon
    async def ping(self, timeout_s: float | None = None) -> str:
        """The runtime's version; DockerUnavailable when it does not answer within timeout_s.
        Not gated by `mark_down`."""
        ...

    async def product(self) -> str:
        """Which runtime answers ("docker", "podman")."""
        ...

    async def oci_runtimes(self) -> list[str]:
        """The OCI runtimes it can create containers with (an isolation class needs its own)."""
        ...

    async def default_oci_runtime(self) -> str:
        """The OCI runtime of a create that names none."""
        ...

    async def host_resources(self) -> tuple[int, int]:
        """CPUs and memory bytes of the host the runtime runs containers on."""
        ...

    # -- images
    async def image_present(self, image: str) -> bool: ...

    async def inspect_image(self, image: str) -> ImageRecord | None:
        """None when absent; InvalidImageReference when the runtime refuses the reference."""
        ...

    async def list_images(self) -> list[ImageRecord]: ...

    async def list_labelled_images(self, label_filters: dict[str, str]) -> list[ImageRecord]:
        """Images carrying each label (with the value, when one is given)."""
        ...

    async def remove_image(self, reference: str) -> None:
        """Without force: RuntimeApiError (409) while a container uses it."""
        ...

    async def remove_unused_image(self, image: str) -> bool:
        """True once it is gone, False while a container uses it."""
        ...

    async def pull(
        self, repository: str, tag: str | None, on_progress: Callable[[PullProgress], None]
    ) -> None:
        """Pulls an image, reporting progress from a worker thread; RuntimeApiError with the
        registry's or the runtime's words when it fails."""
        ...

    async def tag_image(self, source: str, repository: str, tag: str | None) -> None: ...

    async def commit(
        self, container_id: str, repository: str, tag: str, labels: dict[str, str]
    ) -> str:
        """The container's writable layer (paused for a consistent snapshot) as a local image
        with `labels` on top of the container's; its image id."""
        ...

    async def top_layer_size(self, image: str) -> int: ...

    # -- containers
    async def create_and_start(self, spec: ContainerSpec) -> str:
        """A started container (`sleep infinity` under an init, all capabilities dropped but
        `spec.cap_add`, no new privileges, the spec's limits and binds); its id. ImageNotPresent
        when the image is absent (never pulled implicitly). Nothing is left behind on failure."""
        ...

    async def remove(self, container_id: str) -> bool:
        """Force-removes; False if it did not exist."""
        ...

    async def list_labelled(self, label_filters: dict[str, str]) -> list[ContainerInfo]: ...
    async def is_running(self, container_id: str) -> bool: ...
    async def container_state(self, container_id: str) -> ContainerState | None: ...

    async def kill_signal(self, container_id: str, since: float) -> int | None:
        """The last signal the runtime itself sent the container since `since` (wall clock):
        a kill, stop or restart through the runtime, or the runtime stopping its containers.
        None when it sent none."""
        ...

    async def start(self, container_id: str) -> str:
        """Starts a stopped container: "" when it started, else why the runtime refused."""
        ...

    # -- exec
    async def exec_detached(self, container_id: str, argv: list[str]) -> str:
        """Starts a process without attaching; its exec id. ContainerNotRunning when the
        container is stopped or stopping."""
        ...

    async def exec_running(self, exec_id: str) -> bool: ...

    async def exec_run(self, container_id: str, argv: list[str]) -> tuple[int, bytes]:
        """A one-off exec (tens of ms), for rare control actions; exit code and output."""
        ...
