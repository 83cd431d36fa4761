"""A loopback image registry for the pool's pull tests (to be folded into the shared test kit).

Debian's `docker-registry` (Distribution v2) serves a storage directory of the test's on
127.0.0.1:<free port>; dockerd treats 127.0.0.0/8 registries as insecure by default, so the
shared dockerd pushes to and pulls from it over plain HTTP. `push` retags a bundled task image
as <registry>/<name> in the shared dockerd, pushes it, and removes only that retagged name, so
the registry is the one place the name lives; `remove_local` drops the name again after a node
pulled it. Nothing else in the shared dockerd is touched.
"""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import docker


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class LoopbackRegistry:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.port = _free_port()
        self.process: subprocess.Popen[bytes] | None = None
        self.pushed: list[str] = []

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _answers(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://{self.address}/v2/", timeout=1) as reply:
                return reply.status == 200
        except OSError:
            return False

    def start(self) -> None:
        binary = shutil.which("docker-registry")
        if binary is None:
            raise RuntimeError("Debian's docker-registry is not installed (apt-get install it)")
        self.root.mkdir(parents=True, exist_ok=True)
        config = self.root / "config.yml"
        config.write_text(
            "version: 0.1\n"
            "log:\n  level: error\n"
            f"storage:\n  filesystem:\n    rootdirectory: {self.root / 'data'}\n"
            f"http:\n  addr: {self.address}\n"
        )
        log = (self.root / "registry.log").open("ab")
        self.process = subprocess.Popen([binary, "serve", str(config)], stdout=log, stderr=log)
        deadline = time.monotonic() + 20
        while not self._answers():
            if time.monotonic() > deadline or self.process.poll() is not None:
                raise RuntimeError(f"registry on {self.address} did not start")
            time.sleep(0.1)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)
        self.process = None

    def push(self, source: str, name: str) -> str:
        """Pushes the shared dockerd's `source` image as <registry>/<name>; returns that name."""
        target = f"{self.address}/{name}"
        repository, _, tag = target.rpartition(":")
        client = docker.from_env(timeout=600)
        try:
            client.images.get(source).tag(repository, tag)
            for line in client.images.push(repository, tag, stream=True, decode=True):
                if "error" in line:
                    raise RuntimeError(f"push of {target} failed: {line['error']}")
            self.pushed.append(target)
        finally:
            with contextlib.suppress(docker.errors.ImageNotFound):
                client.images.remove(target, noprune=True)
            client.close()
        return target

    def remove_local(self) -> None:
        """Drops the names this registry served from the shared dockerd (only those)."""
        client = docker.from_env()
        try:
            for target in self.pushed:
                with contextlib.suppress(docker.errors.ImageNotFound):
                    client.images.remove(target, noprune=True)
        finally:
            client.close()
