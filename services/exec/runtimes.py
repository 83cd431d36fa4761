"""The node's container runtime, from its settings (`--runtime docker|podman`, `--isolation
runc|gvisor`, `--docker-host`): the one place that knows which implementation serves which name.

Both runtimes are driven through the Docker Engine API (swerl.exec.docker_backend): dockerd's
own, and Podman's Docker-compatible service, which carries every call the node makes (labels,
limits, exec, events, commit, pulls), so one implementation serves both and a difference between
them is handled where it is, in one method. gVisor is an OCI runtime (`runsc`) the daemon runs
each sandbox's container with; it must be registered with that daemon.
"""

from __future__ import annotations

from pathlib import Path
from urllib.parse import urlparse

from swerl.chassis.errors import StartupRefused
from swerl.exec.docker_backend import DockerBackend
from swerl.exec.errors import DockerUnavailable
from swerl.exec.runtime import ContainerRuntime
from swerl.exec.settings import ExecSettings

# Where each runtime's API listens when the node is given no socket (None: the Docker SDK's own
# default, DOCKER_HOST or /var/run/docker.sock). Rootful Podman; a rootless node names its own
# ($XDG_RUNTIME_DIR/podman/podman.sock).
DEFAULT_SOCKETS: dict[str, str | None] = {
    "docker": None,
    "podman": "unix:///run/podman/podman.sock",
}
# The OCI runtime each isolation class needs registered with the daemon ("": its default).
OCI_RUNTIMES = {"runc": "", "gvisor": "runsc"}
# Podman 4.3's Docker-compatible API ignores the runtime a create names and uses its service's
# default (docs/runtimes-findings.md): gVisor on Podman is a service whose default is runsc.
PODMAN_RUNSC_SOCKET = "unix:///run/podman/podman-runsc.sock"
# How each daemon is told to register runsc (for the error that says it is missing).
_REGISTER_RUNSC = {
    "docker": 'dockerd\'s daemon.json "runtimes": {"runsc": {"path": "/usr/bin/runsc"}} and a'
    " SIGHUP (deploy/gvisor-up.sh)",
    "podman": 'containers.conf [engine.runtimes] runsc = ["/usr/bin/runsc"] (deploy/gvisor-up.sh)',
}


def open_runtime(settings: ExecSettings) -> DockerBackend:
    """The runtime the settings name, not yet checked against the daemon (`check_runtime`).
    StartupRefused when a Unix socket it needs is not there."""
    # Unknown names never get here: the settings' Literal types refuse them (exit 2).
    socket = settings.docker_host or DEFAULT_SOCKETS[settings.runtime]
    if socket and socket.startswith("unix://"):
        path = urlparse(socket).path
        if not Path(path).exists():
            hint = (
                "start `podman system service` (deploy/podman-up.sh) or give --docker-host"
                if settings.runtime == "podman"
                else "start dockerd (deploy/docker-up.sh) or give --docker-host"
            )
            raise StartupRefused(f"runtime {settings.runtime}: no API socket at {path}: {hint}")
    return DockerBackend.from_env(
        threads=settings.docker_threads,
        docker_host=socket,
        runtime_name=settings.runtime,
        isolation=settings.isolation,
        # Podman's service runs its default whatever a create names (check_runtime checks it).
        oci_runtime="" if settings.runtime == "podman" else OCI_RUNTIMES[settings.isolation],
    )


async def check_runtime(runtime: ContainerRuntime, settings: ExecSettings) -> None:
    """At the node's start: the daemon answers and is the runtime the settings name, and offers
    the isolation class's OCI runtime. StartupRefused otherwise, naming what to do."""
    try:
        product = await runtime.product()
        offered = await runtime.oci_runtimes()
        default = await runtime.default_oci_runtime()
    except DockerUnavailable:
        # A daemon that does not answer yet is the health watch's (the node starts NOT_SERVING
        # and serves once it answers); what it is gets checked only when it can be asked.
        return
    if product != settings.runtime:
        raise StartupRefused(
            f"runtime {settings.runtime} was asked for, but the API at"
            f" {settings.docker_host or DEFAULT_SOCKETS[settings.runtime] or 'DOCKER_HOST'}"
            f" is {product}'s: give --runtime {product} or the other socket"
        )
    need = OCI_RUNTIMES[settings.isolation]
    if settings.runtime == "podman" and (default == "runsc") != (need == "runsc"):
        where = settings.docker_host or DEFAULT_SOCKETS["podman"]
        if need:
            fix = f"point --docker-host at a service whose default is runsc ({PODMAN_RUNSC_SOCKET})"
        else:
            plain = DEFAULT_SOCKETS["podman"]
            fix = f"use --isolation gvisor, or a podman service that runs runc ({plain})"
        raise StartupRefused(
            f"isolation {settings.isolation} on podman: the service at {where} runs"
            f" {default or 'its default'} for every container (Podman's Docker-compatible API"
            f" ignores the runtime a create names); {fix}"
        )
    if need and need not in offered:
        raise StartupRefused(
            f"isolation {settings.isolation} needs the OCI runtime {need!r}, which"
            f" {settings.runtime} does not offer (it has: {', '.join(sorted(offered)) or 'none'}):"
            f" install runsc and register it, {_REGISTER_RUNSC[settings.runtime]}"
        )
