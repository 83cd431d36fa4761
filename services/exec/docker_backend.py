"""The exec node's container runtime over the Docker Engine API (swerl.exec.runtime's
ContainerRuntime): dockerd, or Podman's Docker-compatible service. Blocking Docker SDK calls run
on a private thread pool.

Keeping every SDK call here means the event loop never blocks on the runtime, and the rest of
the node speaks in the seam's values and errors (RuntimeApiError, RuntimeNotFound) rather than
docker exceptions.

A blocking call cannot be interrupted, so a dockerd that hangs (SIGSTOP, a wedged daemon) would
hold each caller for the Docker client's own timeout (two minutes). Instead the node's health
watch (swerl.exec.health) pings on a thread of its own with a short bound and, when dockerd does
not answer, calls `mark_down`: every call waiting on dockerd fails at once with
DockerUnavailable (its thread is left to finish or time out unseen), and so does every new call
until a ping answers again (`mark_up`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import docker
import docker.errors

from swerl.chassis.bounded import within
from swerl.chassis.images import image_key
from swerl.exec.errors import DockerUnavailable, ImageNotPresent, InvalidImageReference
from swerl.exec.runtime import (
    ContainerInfo,
    ContainerNotRunning,
    ContainerSpec,
    ContainerState,
    ImageRecord,
    PullProgress,
    RuntimeApiError,
    RuntimeNotFound,
)

__all__ = [
    "ContainerInfo",
    "ContainerNotRunning",
    "ContainerSpec",
    "ContainerState",
    "DockerBackend",
]

T = TypeVar("T")

# How Docker words an exec refused because the container is not running: "Container ... is not
# running" (409, the daemon knows it stopped), or, while its init has ended and the daemon has
# not recorded the stop yet (it still reports the container running), the runtime's "cannot exec
# in a stopped state" or "error executing setns process" (the namespaces to enter are gone).
_NOT_RUNNING = ("is not running", "stopped state", "setns process", "container state improper")
# Podman (4.3) through its Docker-compatible service differs from dockerd in a few answers the
# node reads (measured: docs/runtimes-findings.md); each is handled in the method that reads it:
# an exec's inspect says Running until the container ends (`exec_running`), kill events carry
# no signal and take whole-second bounds (`kill_signal`), a commit drops `conf` labels
# (`commit`), and its own images are tagged `localhost/<name>` (`_podman_tags`).
PODMAN = "podman"
# kill_signal's answer when the runtime logged a kill without naming its signal (Podman).
UNNAMED_SIGNAL = -1


def daemon_name(runtime_name: str) -> str:
    """The daemon behind a runtime's socket, as its operator calls it (in errors)."""
    return "podman's API service" if runtime_name == PODMAN else "dockerd"


def _has_label(labels: dict[str, str], key: str, value: str) -> bool:
    """A label filter's match: the key with that value, or the key at all when `value` is ""."""
    return key in labels and (not value or labels[key] == value)


def _drop_result(future: asyncio.Future[Any]) -> None:
    if not future.cancelled():
        future.exception()  # Retrieved, so asyncio does not log it as never retrieved.


def _alive(pid: int) -> bool:
    """Whether host process `pid` runs (not gone, not a zombie)."""
    if pid <= 0:
        return True  # nothing to ask: taken at the runtime's word
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[:1] != ["Z"]


def _neutral(exc: docker.errors.DockerException) -> RuntimeApiError:
    """A Docker SDK error as the seam's: the message keeps the SDK's text (callers read the
    daemon's words in it)."""
    status = getattr(exc, "status_code", None)
    explanation = str(getattr(exc, "explanation", "") or "")
    kind = RuntimeNotFound if isinstance(exc, docker.errors.NotFound) else RuntimeApiError
    return kind(str(exc), status if isinstance(status, int) else None, explanation)


class DockerBackend:
    """A ContainerRuntime over the Docker Engine API at one socket. `runtime_name` says whose
    daemon it is ("docker", or "podman" for Podman's compatible service); `oci_runtime` the
    OCI runtime each container is created with ("" for the daemon's default; "runsc" for the
    gVisor isolation class)."""

    def __init__(
        self,
        client: docker.DockerClient,
        *,
        threads: int = 32,
        runtime_name: str = "docker",
        isolation: str = "runc",
        oci_runtime: str = "",
    ) -> None:
        self.runtime_name = runtime_name
        self.isolation = isolation
        self._oci_runtime = oci_runtime
        self._client = client
        self._api = client.api
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="docker")
        # Pings have a thread of their own: a pool full of calls stuck on a hung dockerd must
        # not hold up the ping that finds out (nor the one that sees it answer again).
        self._ping_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="docker-ping")
        self._ping: concurrent.futures.Future[Any] | None = None
        # The daemon's /version and /info documents and when each was read (wall clock): read
        # again only once the daemon was seen down since (`last_down_wall`).
        self._version_document: dict[str, Any] = {}
        self._version_at = 0.0
        self._info_document: dict[str, Any] = {}
        self._info_at = 0.0
        # Done while dockerd is down (mark_down): what every waiting call races against.
        self._down: asyncio.Future[None] | None = None
        self.down_message = ""
        # When dockerd was last seen down (wall clock; 0: never): a container that stopped
        # since then may have been stopped by that dockerd (its kill events die with it).
        self.last_down_wall = 0.0

    @classmethod
    def from_env(
        cls, *, threads: int = 32, docker_host: str | None = None, **options: Any
    ) -> DockerBackend:
        """The daemon at `docker_host` (e.g. unix:///run/other.sock), else DOCKER_HOST's."""
        try:
            if docker_host:
                client = docker.DockerClient(
                    base_url=docker_host, timeout=120, max_pool_size=threads
                )
            else:
                client = docker.from_env(timeout=120, max_pool_size=threads)
        except docker.errors.DockerException as exc:
            raise DockerUnavailable(
                f"cannot reach {daemon_name(options.get('runtime_name', 'docker'))}: {exc}"
            ) from exc
        return cls(client, threads=threads, **options)

    async def _call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        loop = asyncio.get_running_loop()
        down = self._down_future(loop)
        if down.done():
            raise DockerUnavailable(self.down_message)
        work = loop.run_in_executor(self._pool, lambda: fn(*args, **kwargs))
        try:
            await asyncio.wait((work, down), return_when=asyncio.FIRST_COMPLETED)
        except BaseException:
            # The caller was cancelled (a destroy under a starting shell, a loop shutting
            # down): the call runs on in its thread, and its failure is nobody's to report.
            work.add_done_callback(_drop_result)
            raise
        if not work.done():
            work.add_done_callback(_drop_result)  # Its thread ends unseen, however it ends.
            raise DockerUnavailable(self.down_message)
        try:
            return work.result()
        except docker.errors.DockerException as exc:
            # The daemon refused (APIError, NotFound): the seam's error, for callers to handle.
            raise _neutral(exc) from exc
        except RuntimeApiError:
            raise  # raised by the call itself (a pull's error row)
        except OSError as exc:
            raise DockerUnavailable(f"{self.daemon} unreachable: {exc}") from exc

    @property
    def daemon(self) -> str:
        """The daemon behind the socket, as its operator calls it (in errors)."""
        return daemon_name(self.runtime_name)

    def _down_future(self, loop: asyncio.AbstractEventLoop) -> asyncio.Future[None]:
        if self._down is None or self._down.get_loop() is not loop:
            self._down = loop.create_future()
        return self._down

    def mark_down(self, message: str) -> None:
        """dockerd does not answer: calls waiting on it, and new ones until `mark_up`, fail now
        with DockerUnavailable(message)."""
        self.down_message = message
        self.last_down_wall = time.time()
        down = self._down_future(asyncio.get_running_loop())
        if not down.done():
            down.set_result(None)

    def mark_up(self) -> None:
        """dockerd answers again: calls go to it again."""
        if self._down is not None and self._down.done():
            self._down = None

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._ping_pool.shutdown(wait=False, cancel_futures=True)
        self._client.close()

    # -- daemon ---------------------------------------------------------------------------
    async def ping(self, timeout_s: float | None = None) -> str:
        """Docker's server version; raises DockerUnavailable when dockerd does not answer
        (within `timeout_s`, when given). Not gated by `mark_down`: it is how dockerd's return is
        seen. A ping still waiting on a hung dockerd is waited on again, not doubled."""
        if self._ping is None or self._ping.done():
            self._ping = self._ping_pool.submit(self._ping_once)
        try:
            answer = asyncio.shield(asyncio.wrap_future(self._ping))
            version = await within(answer, timeout_s)
        except asyncio.TimeoutError:
            raise DockerUnavailable(
                f"{self.daemon} did not answer a ping within {timeout_s:g} s (hung or overloaded)"
            ) from None
        except docker.errors.DockerException as exc:
            raise DockerUnavailable(f"{self.daemon} unhealthy: {exc}") from exc
        except OSError as exc:
            raise DockerUnavailable(f"{self.daemon} unreachable: {exc}") from exc
        return str(version)

    def _ping_once(self) -> str:
        """The daemon's `/_ping`, and its version when not known since it was last seen down.
        `/_ping` answers in 2 ms on dockerd and Podman alike; Podman 4.3.1's `/version` took
        0.4 s on an idle 2-core machine (it gathers its host's details), and the node pings every
        2 s. Runs on the ping thread."""
        self._api.ping()
        document = self._version_document
        if not document or self._version_at < self.last_down_wall:
            document = self._read_version()
        return str(document.get("Version", "unknown"))

    def _read_version(self) -> dict[str, Any]:
        """`/version`, kept for the pings (its "Version") and `product` (its "Components")."""
        at = time.time()
        self._version_document, self._version_at = dict(self._api.version()), at
        return self._version_document

    async def product(self) -> str:
        """Whose API this socket serves: "podman" when the version names Podman's engine (its
        Docker-compatible service), else "docker"."""
        version = self._version_document or await self._call(self._read_version)
        names = [str(c.get("Name", "")) for c in version.get("Components") or []]
        return "podman" if any("podman" in name.lower() for name in names) else "docker"

    async def _info(self) -> dict[str, Any]:
        """`/info`, read once per daemon seen (again after it was down): the node's start checks
        and every GetNodeInfo read it, and Podman 4.3.1's took 0.2 s on an idle machine."""
        if not self._info_document or self._info_at < self.last_down_wall:
            at = time.time()
            self._info_document = dict(await self._call(self._api.info))
            self._info_at = at
        return self._info_document

    async def oci_runtimes(self) -> list[str]:
        """The OCI runtimes the daemon can create containers with (`Runtimes` of its info)."""
        info = await self._info()
        return sorted(str(name) for name in (info.get("Runtimes") or {}))

    async def default_oci_runtime(self) -> str:
        """The OCI runtime a create that names none gets (`DefaultRuntime` of its info)."""
        info = await self._info()
        return str(info.get("DefaultRuntime") or "")

    async def host_resources(self) -> tuple[int, int]:
        info = await self._info()
        return int(info.get("NCPU", 0)), int(info.get("MemTotal", 0))

    # -- images ---------------------------------------------------------------------------
    async def image_present(self, image: str) -> bool:
        return await self.inspect_image(image) is not None

    def _podman_tags(self, record: ImageRecord) -> ImageRecord:
        """Podman's listing names its local images `localhost/<name>` (and commits
        `docker.io/<name>`); the node compares tags as dockerd lists them (swerl.chassis.images
        .image_key), so they are listed in that form."""
        if self.runtime_name != PODMAN or not record.get("RepoTags"):
            return record
        tags = []
        for tag in record["RepoTags"]:
            if tag.startswith("localhost/"):
                tag = tag[len("localhost/") :]
            tags.append(image_key(tag))
        return {**record, "RepoTags": tags}

    async def inspect_image(self, image: str) -> ImageRecord | None:
        """Docker's record of an image (Id, Size, RepoTags, ...); None when it is absent."""
        try:
            record: ImageRecord = await self._call(self._api.inspect_image, image)
        except RuntimeApiError as exc:
            # The daemon's own grammar is the last word: a reference it refuses is the caller's.
            if "invalid reference format" in str(exc):
                raise InvalidImageReference(
                    f"malformed image reference {image!r}", image=image
                ) from None
            if isinstance(exc, RuntimeNotFound):
                return None
            raise
        return self._podman_tags(record)

    async def list_images(self) -> list[ImageRecord]:
        return [self._podman_tags(row) for row in await self._call(self._api.images)]

    async def remove_image(self, reference: str) -> None:
        """Removes an image (or one of its tags) without force: Docker refuses (409) to remove
        an image a container still uses, which is the last guard against evicting one."""
        await self._call(self._api.remove_image, reference, force=False, noprune=False)

    async def pull(
        self, repository: str, tag: str | None, on_progress: Callable[[PullProgress], None]
    ) -> None:
        """Pulls through the daemon, calling `on_progress` from the worker thread for each of
        its progress rows; a row that reports an error fails the pull with its words."""

        def pull() -> None:
            for row in self._api.pull(repository, tag=tag, stream=True, decode=True):
                if "error" in row:
                    raise RuntimeApiError(str(row.get("error")))
                detail = row.get("progressDetail") or {}
                on_progress(
                    PullProgress(
                        str(row.get("status", "")),
                        int(detail.get("current", 0) or 0),
                        int(detail.get("total", 0) or 0),
                    )
                )

        await self._call(pull)

    async def run_blocking(self, fn: Callable[..., T], *args: Any) -> T:
        """Any blocking call on the backend's pool, under its down-gate."""
        return await self._call(fn, *args)

    async def tag_image(self, source: str, repository: str, tag: str | None) -> None:
        await self._call(self._api.tag, source, repository, tag)

    # -- containers -----------------------------------------------------------------------
    async def create_and_start(self, spec: ContainerSpec) -> str:
        host_config = self._api.create_host_config(
            runtime=self._oci_runtime or None,
            init=True,
            network_mode=spec.network,
            security_opt=["no-new-privileges"],
            cap_drop=["ALL"],
            cap_add=list(spec.cap_add),
            pids_limit=spec.pids,
            mem_limit=spec.memory_bytes,
            memswap_limit=spec.memory_bytes,
            nano_cpus=int(spec.cpus * 1e9),
            binds=[f"{host}:{inside}:rw" for host, inside in spec.binds]
            + [f"{host}:{inside}:ro" for host, inside in spec.ro_binds],
        )
        try:
            created = await self._call(
                self._api.create_container,
                spec.image,
                command=["sleep", "infinity"],
                name=spec.name,
                labels=spec.labels,
                working_dir=spec.workdir or None,
                environment=spec.env,
                host_config=host_config,
                volumes=[inside for _, inside in (*spec.binds, *spec.ro_binds)],
                detach=True,
            )
        except RuntimeNotFound as exc:
            raise ImageNotPresent(
                f"image {spec.image!r} is not present on this node (swerl never pulls implicitly;"
                " use EnsureImages)",
                image=spec.image,
            ) from exc
        container_id = str(created["Id"])
        try:
            await self._call(self._api.start, container_id)
        except BaseException:
            await self.remove(container_id)
            raise
        return container_id

    async def remove(self, container_id: str) -> bool:
        """Force-removes a container; False if it did not exist."""
        try:
            await self._call(self._api.remove_container, container_id, force=True, v=True)
        except RuntimeNotFound:
            return False
        except RuntimeApiError as exc:
            # Removal already in progress counts as gone-soon; anything else is real.
            if "removal of container" in str(exc) and "already in progress" in str(exc):
                return True
            raise
        return True

    async def list_labelled(self, label_filters: dict[str, str]) -> list[ContainerInfo]:
        filters = {"label": [f"{k}={v}" for k, v in label_filters.items()]}
        rows = await self._call(self._api.containers, all=True, filters=filters)
        return [
            ContainerInfo(
                container_id=row["Id"],
                name=(row.get("Names") or ["/"])[0].lstrip("/"),
                labels=row.get("Labels") or {},
                running=row.get("State") == "running",
                status=str(row.get("Status", "")),
            )
            for row in rows
        ]

    async def is_running(self, container_id: str) -> bool:
        state = await self.container_state(container_id)
        return state is not None and state.running

    async def container_state(self, container_id: str) -> ContainerState | None:
        """What Docker says of the container now; None when it does not exist."""
        try:
            data = await self._call(self._api.inspect_container, container_id)
        except RuntimeNotFound:
            return None
        state = data.get("State") or {}
        return ContainerState(
            running=bool(state.get("Running")),
            exit_code=int(state.get("ExitCode") or 0),
            oom_killed=bool(state.get("OOMKilled")),
            error=str(state.get("Error") or ""),
        )

    async def kill_signal(self, container_id: str, since: float) -> int | None:
        """The last signal Docker itself sent the container since `since` (a wall-clock time):
        `docker kill`, `docker stop` or `restart`, or a dockerd stopping its containers as it
        stops or restarts. None when Docker sent none (whatever ended the container came from
        inside it). Docker logs each such kill as an event just after it delivered the signal:
        a caller that saw the container's processes die may need to ask again
        (SandboxShell.stopped_by_docker does)."""

        podman = self.runtime_name == PODMAN

        def last_kill() -> int | None:
            # Podman answers nothing for fractional bounds: whole seconds around the window.
            now = time.time()
            bounds = (
                (str(int(since)), str(int(now) + 1)) if podman else (f"{since:.6f}", f"{now:.6f}")
            )
            events = self._api.events(
                since=bounds[0],
                until=bounds[1],
                filters={"container": container_id, "event": "kill"},
                decode=True,
            )
            signal = None
            for event in events:
                attributes = (event.get("Actor") or {}).get("Attributes") or {}
                try:
                    signal = int(attributes.get("signal", ""))
                except (TypeError, ValueError):
                    # Podman's kill event names no signal: a kill it sent, of a signal unknown.
                    signal = UNNAMED_SIGNAL if podman else signal
            return signal

        return await self._call(last_kill)

    async def start(self, container_id: str) -> str:
        """`docker start` of a stopped container (its filesystem is as it was): "" when it
        started, else why Docker refused."""
        try:
            await self._call(self._api.start, container_id)
        except RuntimeApiError as exc:
            return exc.explanation
        return ""

    # -- exec -----------------------------------------------------------------------------
    async def exec_detached(self, container_id: str, argv: list[str]) -> str:
        """Starts a process in the container without attaching to it; returns the exec id.
        Raises ContainerNotRunning when Docker refuses because the container is stopped or
        stopping."""

        def start() -> str:
            created = self._api.exec_create(
                container_id, argv, stdin=False, stdout=False, stderr=False
            )
            self._api.exec_start(created["Id"], detach=True)
            return str(created["Id"])

        try:
            return await self._call(start)
        except RuntimeApiError as exc:
            if any(sign in str(exc) for sign in _NOT_RUNNING):
                raise ContainerNotRunning(exc.explanation) from exc
            raise

    async def exec_running(self, exec_id: str) -> bool:
        """Whether a process started by `exec_detached` still runs (False once it has ended,
        with its container or on its own)."""
        try:
            state = await self._call(self._api.exec_inspect, exec_id)
        except RuntimeNotFound:
            return False  # its container was removed
        if self.runtime_name == PODMAN:
            # Podman's inspect says Running until the container ends: the process itself is
            # asked (a rootful node shares the host's pid namespace with the exec's process).
            return _alive(int(state.get("Pid") or 0)) if state.get("Running") else False
        return bool(state.get("Running"))

    async def exec_run(self, container_id: str, argv: list[str]) -> tuple[int, bytes]:
        """A one-off `docker exec` (about 60 ms); for rare control actions like signalling."""

        def run() -> tuple[int, bytes]:
            created = self._api.exec_create(container_id, argv, stdout=True, stderr=True)
            output = self._api.exec_start(created["Id"])
            code = self._api.exec_inspect(created["Id"]).get("ExitCode")
            return int(code if code is not None else -1), bytes(output or b"")

        return await self._call(run)

    # -- fork images (swerl.exec.forks) ---------------------------------------------------
    async def commit(
        self, container_id: str, repository: str, tag: str, labels: dict[str, str]
    ) -> str:
        """Commits a container's writable layer to a local image; returns the image id.

        Docker pauses the container for the commit, so the layer is a consistent snapshot; its
        labels are the container's with `labels` on top (Docker merges them, it cannot drop any).
        """
        if self.runtime_name == PODMAN:  # Podman drops `conf` labels; LABEL changes it keeps
            options: dict[str, Any] = {"changes": [f"LABEL {k}={v}" for k, v in labels.items()]}
        else:
            options = {"conf": {"Labels": labels}}
        created = await self._call(
            self._api.commit, container_id, repository=repository, tag=tag, pause=True, **options
        )
        # Podman answers the bare hex digest, which its own image calls then refuse ("cannot
        # specify 64-byte hexadecimal strings"); Docker's ids, and both lists', are sha256:hex.
        image_id = str(created["Id"])
        return image_id if ":" in image_id else "sha256:" + image_id

    async def top_layer_size(self, image: str) -> int:
        """Bytes of the image's newest layer (for a fork image: the sandbox's changes)."""
        history = await self._call(self._api.history, image)
        return int(history[0].get("Size", 0) or 0) if history else 0

    async def list_labelled_images(self, label_filters: dict[str, str]) -> list[ImageRecord]:
        wanted = [f"{k}={v}" if v else k for k, v in label_filters.items()]
        # Podman 4.3's image list matches nothing when given two label filters or more
        # (containers it filters right): it is asked for the first, and every row is checked here.
        asked = wanted[:1] if self.runtime_name == PODMAN else wanted
        rows = await self._call(self._api.images, filters={"label": asked})
        return [
            self._podman_tags(row)
            for row in rows
            if all(_has_label(row.get("Labels") or {}, k, v) for k, v in label_filters.items())
        ]

    async def remove_unused_image(self, image: str) -> bool:
        """Removes an unused image: True once it is gone, False while a container uses it."""
        try:
            await self._call(self._api.remove_image, image, force=False, noprune=False)
        except RuntimeNotFound:
            return True
        except RuntimeApiError as exc:
            if exc.status_code == 409:  # a container (perhaps being removed) still uses it
                return False
            raise
        return True
