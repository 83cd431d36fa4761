"""Real parts for tests of image pulls and caches: a loopback registry and a second dockerd.

- `start_registry` runs Debian's `docker-registry` (the Distribution registry v2) on 127.0.0.1
  with its own config and storage under a directory of the test's; dockerd treats 127.0.0.0/8
  registries as insecure by default, so no TLS is needed. `auth=True` makes it demand basic auth
  (htpasswd), which an anonymous pull cannot give: a real 401.
- `start_dockerd` runs a second dockerd with its own data root, exec root (and so its own
  managed containerd), pid file and socket, a bridge of its own and no iptables rules, so what a
  test does to its images (evictions) cannot touch the shared dockerd's. Not `--bridge none`:
  a dockerd started so deletes the interface `docker0` (it assumes the default bridge is its
  own), which takes the shared dockerd's bridge away and breaks every build and bridged
  container there. The base image is copied into it
  (`docker save | docker load`), because sandboxes and task images need it.
- `push_images` pushes images of the shared dockerd (e.g. the bundled task images `swerl tasks
  build` made) to a registry under `127.0.0.1:<port>/<name>` and removes the tags it added, so
  the registry is the one place those names live; `remove_names` drops such a name again from a
  dockerd after a node there pulled it (only the name: the image keeps its other names).
- `pull_events` reads dockerd's own record of the pulls it ran: the count a test of "one pull"
  asserts, independent of swerl's counters.

Everything started here is stopped by the returned object's `stop()`, leaving nothing behind.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import docker
from benchkit import create_bridge, delete_bridge

REGISTRY_BINARY = "docker-registry"
# A bcrypt hash of a password nobody is told: the registry accepts the file, no pull can log in.
_HTPASSWD = "swerl:$2y$05$Fq4b6dk4QH0yXkq8mN4OZe3kqPZlq8l3w1vQnR3oXb9u5S0vZ0xAa\n"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _ensure_registry_installed() -> str:
    found = shutil.which(REGISTRY_BINARY)
    if found:
        return found
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    subprocess.run(["apt-get", "install", "-y", "-qq", "docker-registry"], check=True, env=env)
    found = shutil.which(REGISTRY_BINARY)
    if not found:
        raise RuntimeError("apt-get installed docker-registry but its binary is not on PATH")
    return found


def _wait_until(check, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.1)
    raise RuntimeError(f"{what} did not come up within {timeout_s:g} s")


@dataclass
class Registry:
    """A running (or stopped) loopback registry; `start()` again serves the same storage."""

    root: Path
    port: int
    auth: bool = False
    process: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _answers(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://{self.address}/v2/", timeout=1):
                return True
        except urllib.error.HTTPError:
            return True  # 401 from an auth registry: it is up
        except OSError:
            return False

    def start(self) -> Registry:
        config = self.root / "config.yml"
        auth = ""
        if self.auth:
            (self.root / "htpasswd").write_text(_HTPASSWD)
            auth = (
                f"auth:\n  htpasswd:\n    realm: swerl-test\n    path: {self.root / 'htpasswd'}\n"
            )
        config.write_text(
            "version: 0.1\n"
            "log:\n  level: warn\n"
            f"storage:\n  filesystem:\n    rootdirectory: {self.root / 'data'}\n"
            "  delete:\n    enabled: true\n"
            f"http:\n  addr: {self.address}\n" + auth
        )
        log = open(self.root / "registry.log", "ab")  # the child holds it open
        self.process = subprocess.Popen(
            [_ensure_registry_installed(), "serve", str(config)], stdout=log, stderr=log
        )
        log.close()
        _wait_until(self._answers, 20, f"registry on {self.address}")
        return self

    def stop(self) -> None:
        if self.process is None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.process = None


def start_registry(tmpdir: Path, *, auth: bool = False) -> Registry:
    """A registry on a free loopback port, storing under `tmpdir`; call `.stop()` when done."""
    root = Path(tmpdir)
    root.mkdir(parents=True, exist_ok=True)
    return Registry(root=root, port=free_port(), auth=auth).start()


@dataclass
class Dockerd:
    """A second dockerd of the test's own; `host` is its DOCKER_HOST."""

    root: Path
    process: subprocess.Popen[bytes]
    bridge: str
    created_images: list[str] = field(default_factory=list)

    @property
    def socket(self) -> Path:
        return self.root / "docker.sock"

    @property
    def host(self) -> str:
        return f"unix://{self.socket}"

    def client(self) -> docker.DockerClient:
        return docker.DockerClient(base_url=self.host, timeout=120)

    def restart(self) -> None:
        """SIGTERM (dockerd stops its containers, as on a host's `systemctl restart docker`),
        then the same dockerd again on the same root, socket and bridge; returns once it
        answers."""
        self.process.send_signal(signal.SIGTERM)
        self.process.wait(timeout=60)
        self.process = _spawn_dockerd(self.root, self.bridge)
        _wait_until(self._answers, 60, f"dockerd at {self.host} after a restart")

    def _answers(self) -> bool:
        if self.process.poll() is not None:
            raise RuntimeError(f"dockerd exited; see {self.root / 'dockerd.log'}")
        try:
            client = self.client()
            client.ping()
            client.close()
            return True
        except Exception:
            return False

    def answer_again(self) -> str | None:
        """Makes sure it answers (a test's teardown after a restart): None when it does; else its
        state and log are kept (printed, and the log copied to /tmp/swerl-dockerd-gone-*.log,
        the evidence), it is started again if it exited, and that account is returned."""
        with contextlib.suppress(RuntimeError):
            if self._answers():
                return None
        account = self.describe()
        handle, name = tempfile.mkstemp(prefix="swerl-dockerd-gone-", suffix=".log", dir="/tmp")
        os.close(handle)
        kept = Path(name)
        with contextlib.suppress(OSError):
            shutil.copyfile(self.root / "dockerd.log", kept)
        print(f"{account}\n(its whole log: {kept})")
        if self.process.poll() is not None:
            self.process = _spawn_dockerd(self.root, self.bridge)
        _wait_until(self._answers, 60, f"dockerd at {self.host}, started again")
        return account

    def describe(self, lines: int = 40) -> str:
        """Its process's state and the tail of its log: the evidence when it went away."""
        code = self.process.poll()
        state = f"running (pid {self.process.pid})" if code is None else f"exited {code}"
        with contextlib.suppress(OSError):
            tail = (self.root / "dockerd.log").read_text(errors="replace").splitlines()[-lines:]
            return f"dockerd {state}; socket present: {self.socket.exists()}\n" + "\n".join(tail)
        return f"dockerd {state}; no log"

    def stop(self) -> None:
        """Removes its containers, stops it (and its containerd), deletes its directories."""
        with contextlib.suppress(Exception):
            client = self.client()
            for container in client.containers.list(all=True):
                container.remove(force=True)
            client.close()
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        # A clean stop unmounts everything; anything still mounted under the root is unmounted
        # here so that deleting the directories cannot reach into a live overlay.
        for mount in _mounts_under(self.root):
            subprocess.run(["umount", "-l", mount], check=False)
        shutil.rmtree(self.root, ignore_errors=True)
        delete_bridge(self.bridge)


def _mounts_under(root: Path) -> list[str]:
    prefix = str(root) + "/"
    with open("/proc/mounts") as mounts:
        points = [line.split()[1] for line in mounts]
    return sorted((p for p in points if p.startswith(prefix)), key=len, reverse=True)


def start_dockerd(root: Path, *, base_image: str | None = None) -> Dockerd:
    """A dockerd with its own state under `root` (keep the path short: it holds a socket).

    With `base_image`, copies that image from the shared dockerd into the new one.
    """
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    bridge = create_bridge()
    dockerd = Dockerd(root=root, process=_spawn_dockerd(root, bridge), bridge=bridge)
    try:
        _wait_until(dockerd._answers, 60, f"dockerd at {dockerd.host}")
        if base_image:
            copy_image(base_image, dockerd.host)
    except BaseException:
        dockerd.stop()
        raise
    return dockerd


def _spawn_dockerd(root: Path, bridge: str) -> subprocess.Popen[bytes]:
    log = open(root / "dockerd.log", "ab")  # the child holds it open
    try:
        return subprocess.Popen(
            [
                "dockerd",
                f"--data-root={root / 'data'}",
                f"--exec-root={root / 'exec'}",
                f"--pidfile={root / 'dockerd.pid'}",
                f"--host=unix://{root / 'docker.sock'}",
                f"--bridge={bridge}",
                "--iptables=false",
                "--ip-masq=false",
                "--storage-driver=overlay2",
            ],
            stdout=log,
            stderr=log,
        )
    finally:
        log.close()


def copy_image(image: str, docker_host: str) -> None:
    """`docker save image | docker -H docker_host load`."""
    save = subprocess.Popen(["docker", "save", image], stdout=subprocess.PIPE)
    assert save.stdout is not None
    load = subprocess.run(
        ["docker", "-H", docker_host, "load", "-q"], stdin=save.stdout, capture_output=True
    )
    save.stdout.close()
    if save.wait() != 0 or load.returncode != 0:
        raise RuntimeError(f"copying {image} to {docker_host} failed: {load.stderr.decode()}")


def registry_name(image: str, registry_address: str) -> str:
    """`127.0.0.1:<port>/<image's path and tag>`: the image's name in the test registry."""
    first, _, rest = image.partition("/")
    if rest and ("." in first or ":" in first or first == "localhost"):
        image = rest  # drop the image's own registry
    return f"{registry_address}/{image}"


def push_images(images: list[str], registry_address: str) -> dict[str, str]:
    """Pushes images of the shared dockerd to the registry; maps each image to its new name."""
    client = docker.from_env(timeout=300)
    pushed: dict[str, str] = {}
    try:
        for image in images:
            target = registry_name(image, registry_address)
            repository, _, tag = target.rpartition(":")
            client.api.tag(image, repository, tag)
            try:
                for row in client.api.push(repository, tag=tag, stream=True, decode=True):
                    if "error" in row:
                        raise RuntimeError(f"pushing {target}: {row['error']}")
            finally:
                # The tag was only the push's handle; the shared dockerd keeps its own names.
                client.api.remove_image(target, noprune=True)
            pushed[image] = target
    finally:
        client.close()
    return pushed


def pull_events(docker_host: str, since: float, until: float) -> list[dict]:
    """Image `pull` events dockerd recorded between two times (one per actual pull)."""
    client = docker.DockerClient(base_url=docker_host, timeout=30)
    try:
        events = client.api.events(
            since=int(since), until=int(until) + 1, filters={"type": "image"}, decode=True
        )
        # dockerd's `since`/`until` are whole seconds: a pull of the second before `since` (the
        # previous test's, say) comes back too, so the window is applied to timeNano as well.
        low, high = int(since * 1e9), int(until * 1e9)
        return [
            e
            for e in events
            if e.get("Action") == "pull" and low <= int(e.get("timeNano", 0)) <= high
        ]
    finally:
        client.close()


def remove_names(names: list[str], docker_host: str | None = None) -> None:
    """Removes these image names (tags) from a dockerd, the shared one by default; absent names
    are skipped and nothing else is touched (`noprune`: an image with other names keeps them)."""
    client = (
        docker.DockerClient(base_url=docker_host, timeout=120)
        if docker_host
        else docker.from_env(timeout=120)
    )
    try:
        for name in names:
            with contextlib.suppress(docker.errors.ImageNotFound):
                client.api.remove_image(name, noprune=True)
    finally:
        client.close()
