"""Runtime probe: does an engine (dockerd, podman's Docker-compatible service) with an OCI runtime
(runc, crun, runsc) serve every call swerl's exec node makes, and how fast?

    python benchmarks/runtime_probe.py [--docker-host URL] [--runtime runsc] [--runs 20]
    python benchmarks/runtime_probe.py --all [--pull-ref localhost:PORT/REPO:TAG]

A target is one socket and one runtime (none: the engine's default). `--all` probes docker,
docker+runsc, podman and podman+runsc in one run, the first being the baseline of the timings;
podman+runsc is a second podman service whose default runtime is runsc (podman 4.3's compatible
API ignores a create's runtime; deploy/gvisor-up.sh starts that service).
For each target it prints one line per operation, `ok`, `differs` (how) or `fails` (the error),
then a matrix of them all and the p50 of create+start, an exec round trip (`true`) and a remove,
with each target's ratio to the baseline. It reports; it does not assert (exit 0 whatever the
answers, 1 when the probe itself breaks).

The calls are the node's own where they can be (swerl.exec.docker_backend.DockerBackend, the
shell's supervisor over FIFOs, SandboxShell.run_capture), and raw docker-py calls where the probe
must look under them (host config, FIFOs opened from each side, events). Everything it makes is
labelled swerl.probe=1 and removed on the way out, errors included. `--pull-ref` names an image
already pushed to a local registry (the findings use Debian's docker-registry); without it the
pull is skipped.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
import traceback
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import docker
import docker.errors
import docker.types

from swerl.exec.docker_backend import ContainerSpec, DockerBackend
from swerl.exec.shell import CONTAINER_IO_DIR, SandboxShell, ensure_io_dir

DOCKER_SOCK = "unix:///var/run/docker.sock"
PODMAN_SOCK = "unix:///run/podman/podman.sock"
# Podman's compatible API ignores a create's runtime: gVisor comes from a second service whose
# default runtime is runsc (deploy/gvisor-up.sh).
PODMAN_RUNSC_SOCK = "unix:///run/podman/podman-runsc.sock"
PROBE_LABEL = "swerl.probe"
BASE_IMAGE = "swerl-base:bookworm"
# How long one FIFO open or one wait for a container to stop may take before it counts as failed.
WAIT_S = 20.0


@dataclass
class Target:
    name: str
    url: str
    runtime: str  # asked per container; "" = the engine's default
    gvisor: bool = False  # whether the sandbox should find gVisor's kernel


@dataclass
class Report:
    target: Target
    lines: list[tuple[str, str, str]] = field(default_factory=list)  # (operation, verdict, detail)
    timings: dict[str, list[float]] = field(default_factory=dict)

    def add(self, operation: str, verdict: str, detail: str = "") -> None:
        if operation.startswith("[") and verdict == "ok":
            return  # a whole phase that ran: its own checks have said how
        self.lines.append((operation, verdict, detail))
        text = f"{self.target.name:<14} {operation:<28} {verdict:<8} {detail}"
        print(text.rstrip(), flush=True)


class Differs(Exception):
    """The call answered, but not as dockerd/runc does: the message says how."""


async def blocking(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    return await asyncio.to_thread(lambda: fn(*args, **kwargs))


async def check(report: Report, operation: str, work: Callable[[], Awaitable[str | None]]) -> None:
    """Runs one check: `ok` with what it returns, `differs` on Differs, `fails` on any error."""
    try:
        detail = await work()
    except Differs as exc:
        report.add(operation, "differs", str(exc))
    except Exception as exc:
        text = " ".join(f"{type(exc).__name__}: {exc}".split())
        report.add(operation, "fails", text[:300])
    else:
        report.add(operation, "ok", detail or "")


def open_fifo_in_thread(path: Path, flags: int) -> tuple[threading.Thread, dict[str, Any]]:
    """Opens one end of a FIFO on a thread (the open blocks until the other end is opened)."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["fd"] = os.open(path, flags)
        except OSError as exc:
            box["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, box


def release_fifo(path: Path, box: dict[str, Any], thread: threading.Thread) -> None:
    """Ends a host open still waiting for a peer (the container never opened its end)."""
    if thread.is_alive():
        with contextlib.suppress(OSError):
            os.close(os.open(path, os.O_RDWR | os.O_NONBLOCK))
        thread.join(2)
    if "fd" in box:
        os.close(box["fd"])


class Probe:
    def __init__(self, target: Target, image: str, runs: int, pull_ref: str) -> None:
        self.target = target
        self.image = image
        self.runs = runs
        self.pull_ref = pull_ref
        self.report = Report(target)
        self.run_id = uuid.uuid4().hex[:8]
        self.labels = {PROBE_LABEL: "1", f"{PROBE_LABEL}.run": self.run_id}
        self.api = docker.APIClient(base_url=target.url, timeout=120)
        self.backend = DockerBackend(docker.DockerClient(base_url=target.url, timeout=120))
        if target.runtime:
            # ContainerSpec has no runtime (yet): the node's own create call, with one keyword
            # more on its host config.
            make = self.backend._api.create_host_config
            self.backend._api.create_host_config = lambda **kw: make(runtime=target.runtime, **kw)
        self.tmp = Path(tempfile.mkdtemp(prefix=f"swerl-probe-{self.run_id}-"))
        self.images: list[str] = []
        self._names = 0

    # -- helpers ------------------------------------------------------------------------------
    def spec(
        self, io_dir: Path | None = None, network: str = "none", image: str = ""
    ) -> ContainerSpec:
        self._names += 1
        bundle = self.tmp / "bundle"
        bundle.mkdir(exist_ok=True)
        (bundle / "marker").write_text("bundle\n")
        return ContainerSpec(
            name=f"swerl-probe-{self.run_id}-{self._names}",
            image=image or self.image,
            workdir="/root",
            env={"SWERL_PROBE": "1"},
            labels=self.labels,
            cpus=1.0,
            memory_bytes=512 << 20,
            pids=256,
            network=network,
            cap_add=(),
            binds=((str(io_dir), CONTAINER_IO_DIR),) if io_dir else (),
            ro_binds=((str(bundle), "/opt/swerl-bundles"),),
        )

    def io_dir(self) -> Path:
        path = ensure_io_dir(self.tmp / f"io-{self._names + 1}")
        return path

    async def sh(self, container_id: str, script: str) -> tuple[int, str]:
        code, out = await self.backend.exec_run(container_id, ["bash", "-c", script])
        return code, out.decode(errors="replace").strip()

    async def wait_stopped(self, container_id: str, within_s: float = WAIT_S) -> bool:
        deadline = time.monotonic() + within_s
        while time.monotonic() < deadline:
            state = await self.backend.container_state(container_id)
            if state is None or not state.running:
                return True
            await asyncio.sleep(0.1)
        return False

    # -- the probe ----------------------------------------------------------------------------
    async def run(self) -> Report:
        r = self.report
        try:
            for phase in (
                self.daemon,
                self.image_calls,
                self.containers,
                self.oom,
                self.commit_and_images,
                self.extras,
                self.timings,
            ):
                # A phase that breaks outside its checks (its set-up container would not start)
                # is one line, and the next phase runs.
                await check(r, f"[{phase.__name__}]", _quiet(phase))
        finally:
            await self.clean_up()
            self.backend.close()
            self.api.close()
        return r

    async def daemon(self) -> None:
        r = self.report

        async def ping() -> str:
            version = await self.backend.ping(timeout_s=10)
            if not await blocking(self.api.ping):
                raise Differs("ping answered False")
            api = (await blocking(self.api.version)).get("ApiVersion", "?")
            return f"Version {version}, ApiVersion {api}"

        async def info() -> str:
            ncpu, mem = await self.backend.host_resources()
            host_mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
            detail = f"NCPU {ncpu}, MemTotal {mem}"
            if ncpu != os.cpu_count() or abs(mem - host_mem) > host_mem * 0.05:
                raise Differs(f"{detail}; the host has {os.cpu_count()} CPUs, {host_mem} bytes")
            runtimes = (await blocking(self.api.info)).get("Runtimes") or {}
            if self.target.runtime and self.target.runtime not in runtimes:
                raise Differs(f"{detail}; runtime {self.target.runtime} not in {sorted(runtimes)}")
            return detail

        await check(r, "ping/version", ping)
        await check(r, "info NCPU MemTotal", info)

    async def image_calls(self) -> None:
        r = self.report
        b = self.backend

        async def inspect() -> str:
            record = await b.inspect_image(self.image)
            if record is None:
                raise Differs(f"{self.image} not found")
            tags = record.get("RepoTags") or []
            detail = f"Id {str(record['Id'])[:19]}, Size {record.get('Size')}, RepoTags {tags}"
            if self.image not in tags:
                raise Differs(detail + f" (not {self.image!r} as asked)")
            return detail

        async def absent() -> str:
            if await b.inspect_image("swerl-probe/absent:never") is not None:
                raise Differs("an absent image inspected as present")
            return "None (NotFound)"

        async def malformed() -> str:
            try:
                await b.inspect_image("Bad Reference!!")
            except Exception as exc:
                if type(exc).__name__ == "InvalidImageReference":
                    return 'InvalidImageReference ("invalid reference format")'
                raise Differs(f"{type(exc).__name__}: {exc}") from None
            raise Differs("a malformed reference inspected as absent (no error)")

        async def listing() -> str:
            rows = await b.list_images()
            tags = [t for row in rows for t in row.get("RepoTags") or []]
            if self.image not in tags:
                raise Differs(f"{len(rows)} images; {self.image} not among RepoTags {tags[:4]}")
            return f"{len(rows)} images, {self.image} among RepoTags"

        async def tag() -> str:
            repo = f"swerl-probe/tagged-{self.run_id}"
            await b.tag_image(self.image, repo, "t1")
            self.images.append(f"{repo}:t1")
            record = await b.inspect_image(f"{repo}:t1")
            base = await b.inspect_image(self.image)
            if record is None or base is None or record["Id"] != base["Id"]:
                raise Differs("the new tag does not inspect as the base image")
            await b.remove_image(f"{repo}:t1")
            if await b.inspect_image(self.image) is None:
                raise Differs("removing the tag removed the base image")
            return "tag, inspect by tag, remove the tag (base image kept)"

        async def pull() -> str:
            if not self.pull_ref:
                return "skipped (no --pull-ref)"
            repo, _, tag_ = self.pull_ref.rpartition(":")
            with contextlib.suppress(docker.errors.APIError):
                await b.remove_image(self.pull_ref)
            events = await b.run_blocking(lambda: list(b.pull_stream(repo, tag_)))
            errors = [e for e in events if "error" in e or "errorDetail" in e]
            if errors:
                raise Differs(f"stream error: {errors[-1]}")
            self.images.append(self.pull_ref)
            record = await b.inspect_image(self.pull_ref)
            if record is None:
                raise Differs(f"pulled, but {self.pull_ref} does not inspect")
            last = events[-1].get("status", "") if events else ""
            return f"{len(events)} progress events, last {last!r}"

        await check(r, "image inspect", inspect)
        await check(r, "image inspect absent", absent)
        await check(r, "image inspect malformed", malformed)
        await check(r, "image list", listing)
        await check(r, "image tag + remove tag", tag)
        await check(r, "image pull (registry)", pull)

    async def containers(self) -> None:
        r = self.report
        b = self.backend
        io_dir = self.io_dir()
        cid = ""

        async def create() -> str:
            nonlocal cid
            cid = await b.create_and_start(self.spec(io_dir))
            data = await blocking(self.api.inspect_container, cid)
            host = data["HostConfig"]
            want = {
                "NanoCpus": 1_000_000_000,
                "Memory": 512 << 20,
                "PidsLimit": 256,
                "NetworkMode": "none",
                "CapDrop": ["ALL"],
                "SecurityOpt": ["no-new-privileges"],
                "Init": True,
            }
            if self.target.runtime:
                want["Runtime"] = self.target.runtime
            wrong = {k: host.get(k) for k, v in want.items() if _norm(host.get(k)) != _norm(v)}
            state = data["State"]
            detail = f"Pid {state.get('Pid')}, StartedAt {state.get('StartedAt')}"
            if wrong:
                raise Differs(f"{detail}; HostConfig differs: {wrong}")
            if not state.get("Running") or not state.get("Pid"):
                raise Differs(f"not running after start: {state}")
            return detail

        await check(r, "create+start (node's call)", create)
        if not cid:
            return

        async def inside() -> str:
            code, out = await self.sh(
                cid,
                "tr '\\0' ' ' </proc/1/cmdline; echo;"
                " grep -E '^(CapEff|NoNewPrivs)' /proc/self/status | tr -s '\\t' ' ';"
                " ulimit -Hn; ulimit -Hu; cat /opt/swerl-bundles/marker;"
                " touch /opt/swerl-bundles/x 2>&1 | grep -o 'Read-only file system';"
                " echo $SWERL_PROBE $PWD",
            )
            lines = out.splitlines()
            init = lines[0] if lines else ""
            problems = []
            if "init" not in init and "catatonit" not in init and "tini" not in init:
                problems.append(f"pid 1 is {init!r}, not an init")
            if "CapEff: 0000000000000000" not in out:
                problems.append("capabilities not dropped")
            if "NoNewPrivs: 1" not in out:
                problems.append("no-new-privileges not set")
            if "Read-only file system" not in out:
                problems.append("ro bind writable")
            if "1 /root" not in out:
                problems.append("env/workdir missing")
            detail = " | ".join(lines)
            if code != 0 or problems:
                raise Differs(f"{'; '.join(problems)} (exit {code}: {detail})")
            return detail

        async def listed() -> str:
            rows = await b.list_labelled({PROBE_LABEL: "1", f"{PROBE_LABEL}.run": self.run_id})
            mine = [row for row in rows if row.container_id == cid]
            if not mine:
                raise Differs(f"label filter found {len(rows)} rows, not ours")
            row = mine[0]
            if not row.running or row.labels.get(f"{PROBE_LABEL}.run") != self.run_id:
                raise Differs(f"row {row}")
            return f"name {row.name}, status {row.status!r}"

        async def exec_run() -> str:
            code, out = await b.exec_run(cid, ["bash", "-c", "echo out; echo err >&2; exit 3"])
            if code != 3 or b"out" not in out or b"err" not in out:
                raise Differs(f"exit {code}, output {out!r}")
            return f"exit 3, output {out!r}"

        async def exec_detached() -> str:
            exec_id = await b.exec_detached(cid, ["sleep", "1"])
            first = await b.exec_running(exec_id)
            await asyncio.sleep(1.8)
            later = await b.exec_running(exec_id)
            if not first or later:
                for _ in range(20):
                    await asyncio.sleep(0.5)
                    if not await b.exec_running(exec_id):
                        break
                raise Differs(
                    f"Running {first} at once, {later} after 1.8 s,"
                    f" {await b.exec_running(exec_id)} after 11.8 s (`sleep 1`)"
                )
            return "Running True, then False once it ended"

        async def kernel() -> str:
            _, out = await self.sh(cid, "dmesg 2>&1 | head -n 1; uname -r")
            on_gvisor = "Starting gVisor" in out
            detail = f"{'gVisor' if on_gvisor else 'host kernel'} ({out.splitlines()[-1]})"
            if on_gvisor != self.target.gvisor:
                raise Differs(f"{detail}, expected {'gVisor' if self.target.gvisor else 'runc'}")
            return detail

        await check(r, "kernel (gVisor or host)", kernel)
        await check(r, "inside: init caps env ro", inside)
        await check(r, "list by label", listed)
        await check(r, "exec_run (exit, output)", exec_run)
        await check(r, "exec detached + inspect", exec_detached)
        await self.fifos(cid, io_dir)
        await self.shell(cid, io_dir)
        await self.kill_calls(cid)

    async def fifos(self, cid: str, io_dir: Path) -> None:
        """The shell's transport: FIFOs made on the host in the bind-mounted I/O dir."""
        r = self.report

        async def host_writes() -> str:
            path = io_dir / "probe-h2c"
            os.mkfifo(path, 0o600)
            thread, box = open_fifo_in_thread(path, os.O_WRONLY)
            try:
                exec_task = asyncio.ensure_future(
                    self.sh(cid, f"timeout 10 cat {CONTAINER_IO_DIR}/probe-h2c")
                )
                await blocking(thread.join, WAIT_S)
                if "fd" not in box:
                    code, out = await exec_task
                    raise Differs(f"the host's open never met the container's: exit {code} {out}")
                os.write(box["fd"], b"host-to-container\n")
                os.close(box.pop("fd"))
                code, out = await exec_task
            finally:
                release_fifo(path, box, thread)
            if code != 0 or out != "host-to-container":
                raise Differs(f"exit {code}, read {out!r}")
            return "container read what the host wrote"

        async def container_writes() -> str:
            path = io_dir / "probe-c2h"
            os.mkfifo(path, 0o600)
            thread, box = open_fifo_in_thread(path, os.O_RDONLY)
            try:
                code, out = await self.sh(
                    cid, f"echo container-to-host > {CONTAINER_IO_DIR}/probe-c2h"
                )
                await blocking(thread.join, 5)
                if "fd" not in box:
                    raise Differs(f"the container's open failed: exit {code} {out}")
                data = os.read(box["fd"], 100)
            finally:
                release_fifo(path, box, thread)
            if data != b"container-to-host\n":
                raise Differs(f"read {data!r}")
            return "host read what the container wrote"

        async def both_inside() -> str:
            # The watchdog's and the workers' batons: both ends opened in the container.
            os.mkfifo(io_dir / "probe-baton", 0o600)
            code, out = await self.sh(
                cid,
                f"f={CONTAINER_IO_DIR}/probe-baton; (timeout 10 cat $f) & sleep 0.2;"
                " echo baton > $f; wait",
            )
            if code != 0 or out != "baton":
                raise Differs(f"exit {code}, {out!r}")
            return "read and write ends both in the container"

        async def made_inside() -> str:
            code, out = await self.sh(cid, f"mkfifo {CONTAINER_IO_DIR}/probe-inside && echo made")
            on_host = (io_dir / "probe-inside").exists()
            if code != 0 or not on_host:
                raise Differs(f"mkfifo exit {code} {out!r}; seen on the host: {on_host}")
            return "a FIFO made in the container is the host's too"

        await check(r, "FIFO host writes, ctr reads", host_writes)
        await check(r, "FIFO ctr writes, host reads", container_writes)
        await check(r, "FIFO both ends in ctr", both_inside)
        await check(r, "FIFO made in ctr (info)", made_inside)

    async def shell(self, cid: str, io_dir: Path) -> None:
        """swerl's own shell: the supervisor over FIFOs, a timeout, a group kill, a self-kill."""
        r = self.report
        shell = SandboxShell(self.backend, cid, io_dir, {"SWERL_PROBE": "1"})

        async def command() -> str:
            code, out, err, _ = await shell.run_capture(
                "echo out; echo err >&2; exit 7", timeout_s=30, max_output_bytes=1 << 20
            )
            if (code, out, err) != (7, b"out\n", b"err\n"):
                raise Differs(f"exit {code}, stdout {out!r}, stderr {err!r}")
            return "exit 7, stdout and stderr apart"

        async def timeout() -> str:
            started = time.monotonic()
            code, out, _, _ = await shell.run_capture(
                "sleep 300 & sleep 300; echo never", timeout_s=2, max_output_bytes=1 << 20
            )
            took = time.monotonic() - started
            _, left = await self.sh(cid, "ps -eo args | grep -c '^sleep 300$' || true")
            if took > 8 or left.strip() != "0" or b"never" in out:
                raise Differs(f"exit {code} after {took:.1f} s, {left.strip()} sleeps left")
            return f"exit {code} after {took:.1f} s, its group gone"

        async def group_kill() -> str:
            code, out = await self.sh(
                cid,
                "set -m; (sleep 301 & sleep 301 & wait) & leader=$!; sleep 0.3;"
                " kill -9 -- -$leader; sleep 0.3; ps -eo args | grep -c '^sleep 301$' || true",
            )
            left = out.splitlines()[-1] if out else ""
            if left != "0":
                raise Differs(f"{left} of the group's processes left (exit {code}: {out!r})")
            return "kill -9 -PGID ended the whole group"

        async def self_kill() -> str:
            before = (await blocking(self.api.inspect_container, cid))["State"]["StartedAt"]
            code, _, _, _ = await shell.run_capture(
                "kill -9 -1", timeout_s=30, max_output_bytes=1 << 20
            )
            state = await self.backend.container_state(cid)
            _, out2, _, _ = await shell.run_capture(
                "echo back", timeout_s=30, max_output_bytes=1 << 20
            )
            after = (await blocking(self.api.inspect_container, cid))["State"]["StartedAt"]
            detail = (
                f"kill -9 -1: exit {code}; container running {state and state.running}"
                f" (exit code {state and state.exit_code}); next command {out2!r},"
                f" container started again: {before != after}"
            )
            if out2 != b"back\n":
                raise Differs(detail)
            return detail

        try:
            await check(r, "swerl shell: command", command)
            await check(r, "swerl shell: timeout kill", timeout)
            await check(r, "kill -9 -PGID inside", group_kill)
            await check(r, "swerl shell: kill -9 -1", self_kill)
        finally:
            await shell.close()

    async def kill_calls(self, cid: str) -> None:
        r = self.report
        b = self.backend

        async def kill() -> str:
            since = time.time()
            await blocking(self.api.kill, cid, signal="SIGKILL")
            if not await self.wait_stopped(cid):
                raise Differs("still running after kill")
            signal = None
            for _ in range(10):  # Docker logs its kill just after delivering it.
                signal = await b.kill_signal(cid, since)
                if signal is not None:
                    break
                await asyncio.sleep(0.2)
            state = await b.container_state(cid)
            detail = f"events say signal {signal}; ExitCode {state and state.exit_code}"
            if signal != 9 or state is None or state.exit_code != 137:
                # What the engine logged, asked the way the node asks but in whole seconds.
                rows = await blocking(
                    lambda: list(
                        self.api.events(
                            since=int(since) - 1,
                            until=int(time.time()) + 1,
                            filters={"container": cid, "event": "kill"},
                            decode=True,
                        )
                    )
                )
                attributes = [(row.get("Actor") or {}).get("Attributes") for row in rows]
                raise Differs(f"{detail}; in whole seconds: {len(rows)} kill events {attributes}")
            return detail

        async def exec_stopped() -> str:
            try:
                await b.exec_detached(cid, ["true"])
            except Exception as exc:
                if type(exc).__name__ == "ContainerNotRunning":
                    return f"ContainerNotRunning: {str(exc)[:120]}"
                raise Differs(f"{type(exc).__name__}: {exc}"[:300]) from None
            raise Differs("an exec in a stopped container was accepted")

        async def start_again() -> str:
            why = await b.start(cid)
            if why:
                raise Differs(why)
            code, out = await self.sh(cid, "echo up")
            if out != "up":
                raise Differs(f"exit {code} {out!r}")
            return "started again, exec works"

        async def remove() -> str:
            first = await b.remove(cid)
            second = await b.remove(cid)
            if (first, second) != (True, False):
                raise Differs(f"remove gave {first}, then {second}")
            return "True, then False (NotFound)"

        await check(r, "kill + events(kill) + state", kill)
        await check(r, "exec when stopped", exec_stopped)
        await check(r, "start a stopped container", start_again)
        await check(r, "remove(force) twice", remove)

    async def oom(self) -> None:
        async def oom_killed() -> str:
            host = self.api.create_host_config(
                mem_limit=64 << 20,
                memswap_limit=64 << 20,
                network_mode="none",
                **({"runtime": self.target.runtime} if self.target.runtime else {}),
            )
            created = await blocking(
                self.api.create_container,
                self.image,
                command=["python3", "-c", "x = bytearray(400 << 20); import time; time.sleep(30)"],
                labels=self.labels,
                host_config=host,
            )
            cid = created["Id"]
            try:
                await blocking(self.api.start, cid)
                await self.wait_stopped(cid, 40)
                state = await self.backend.container_state(cid)
            finally:
                await self.backend.remove(cid)
            detail = f"OOMKilled {state and state.oom_killed}, ExitCode {state and state.exit_code}"
            if state is None or state.running or not state.oom_killed:
                raise Differs(detail)
            return detail

        await check(self.report, "OOMKilled (64 MiB)", oom_killed)

    async def commit_and_images(self) -> None:
        r = self.report
        b = self.backend
        cid = await b.create_and_start(self.spec())
        repo = f"swerl-probe/commit-{self.run_id}"
        image_id = ""

        async def commit() -> str:
            nonlocal image_id
            await self.sh(cid, "head -c 1048576 /dev/urandom > /root/probe-commit.bin")
            image_id = await b.commit(cid, repo, "t", {"swerl.probe.fork": "1"})
            self.images.append(f"{repo}:t")
            record = await b.inspect_image(f"{repo}:t") or {}
            labels = (record.get("Config") or {}).get("Labels") or {}
            size = await b.top_layer_size(f"{repo}:t")
            detail = f"top layer {size} bytes, labels {sorted(labels)}"
            if labels.get("swerl.probe.fork") != "1" or labels.get(PROBE_LABEL) != "1":
                raise Differs(detail + " (the container's or the commit's labels missing)")
            if size < 1 << 20:
                raise Differs(detail + " (the 1 MiB written in the container is not in it)")
            return detail

        async def fork_runs() -> str:
            fork = await b.create_and_start(self.spec(image=f"{repo}:t"))
            try:
                _, out = await self.sh(
                    fork,
                    "stat -c %s /root/probe-commit.bin 2>&1 ||"
                    " python3 -c \"import os;print(os.stat('/root/probe-commit.bin').st_size)\"",
                )
                in_use = await b.remove_unused_image(f"{repo}:t")
            finally:
                await b.remove(fork)
            if not out.endswith("1048576"):
                raise Differs(f"the fork has no file: {out!r}")
            if in_use:
                raise Differs("removed an image a container uses (no 409)")
            return "the fork sees the file; removing its image while used: 409"

        async def labelled() -> str:
            rows = await b.list_labelled_images({"swerl.probe.fork": ""})
            ids = [row.get("Id") for row in rows]
            if image_id not in ids:
                raise Differs(f"label filter found {ids}, not {image_id}")
            gone = await b.remove_unused_image(f"{repo}:t")
            if not gone or await b.inspect_image(f"{repo}:t") is not None:
                raise Differs("the unused fork image was not removed")
            return "found by label; removed once unused"

        try:
            await check(r, "commit (pause, labels)", commit)
            await check(r, "run the commit; 409 in use", fork_runs)
            await check(r, "images by label; remove", labelled)
        finally:
            await b.remove(cid)

    async def extras(self) -> None:
        """tmpfs and Mount objects: not the node's calls today, asked of a runtime all the same."""

        async def mounts() -> str:
            source = self.tmp / "mount-src"
            source.mkdir()
            (source / "f").write_text("mounted\n")
            host = self.api.create_host_config(
                network_mode="none",
                tmpfs={"/scratch": "size=16m"},
                mounts=[docker.types.Mount("/mnt/src", str(source), type="bind", read_only=True)],
                **({"runtime": self.target.runtime} if self.target.runtime else {}),
            )
            created = await blocking(
                self.api.create_container,
                self.image,
                command=["sleep", "infinity"],
                labels=self.labels,
                host_config=host,
            )
            cid = created["Id"]
            try:
                await blocking(self.api.start, cid)
                code, out = await self.sh(
                    cid,
                    "grep -E ' /scratch ' /proc/mounts | cut -d' ' -f3; cat /mnt/src/f;"
                    " touch /mnt/src/g 2>&1 | grep -o 'Read-only file system'",
                )
            finally:
                await self.backend.remove(cid)
            if out.split() != ["tmpfs", "mounted", "Read-only", "file", "system"]:
                raise Differs(f"exit {code}: {out!r}")
            return "tmpfs at /scratch; read-only bind Mount"

        await check(self.report, "tmpfs + mounts (extra)", mounts)

    async def timings(self) -> None:
        b = self.backend
        create, exec_rt, remove = [], [], []
        ids = []
        try:
            for _ in range(self.runs):
                started = time.perf_counter()
                ids.append(await b.create_and_start(self.spec()))
                create.append(time.perf_counter() - started)
            for _ in range(self.runs):
                started = time.perf_counter()
                await b.exec_run(ids[0], ["true"])
                exec_rt.append(time.perf_counter() - started)
            while ids:
                started = time.perf_counter()
                await b.remove(ids.pop())
                remove.append(time.perf_counter() - started)
        finally:
            for cid in ids:
                await b.remove(cid)
        self.report.timings = {"create+start": create, "exec true": exec_rt, "remove": remove}
        summary = ", ".join(
            f"{k} {statistics.median(v) * 1e3:.0f} ms" for k, v in self.report.timings.items()
        )
        self.report.add(f"timings p50 (n={self.runs})", "ok", summary)

    async def clean_up(self) -> None:
        with contextlib.suppress(Exception):
            for cid in await self.backend.list_labelled({f"{PROBE_LABEL}.run": self.run_id}):
                await self.backend.remove(cid.container_id)
        for image in self.images:
            with contextlib.suppress(Exception):
                await blocking(self.api.remove_image, image, force=True)
        shutil.rmtree(self.tmp, ignore_errors=True)


def _quiet(phase: Callable[[], Awaitable[None]]) -> Callable[[], Awaitable[str | None]]:
    async def run() -> str | None:
        await phase()
        return None

    return run


def _norm(value: Any) -> Any:
    return sorted(value) if isinstance(value, list) else value


def targets_from(args: argparse.Namespace) -> list[Target]:
    if args.all:
        return [
            Target("docker", args.docker_sock, ""),
            Target("docker+runsc", args.docker_sock, "runsc", gvisor=True),
            Target("podman", args.podman_sock, ""),
            Target("podman+runsc", args.podman_runsc_sock, "", gvisor=True),
        ]
    url = args.docker_host or os.environ.get("DOCKER_HOST", DOCKER_SOCK)
    name = "podman" if "podman" in url else "docker"
    gvisor = args.runtime == "runsc" or url == args.podman_runsc_sock
    name = args.name or name + ("+runsc" if gvisor else "")
    return [Target(name, url, args.runtime, gvisor=gvisor)]


def print_matrix(reports: list[Report]) -> None:
    print("\n## operations")
    names = [r.target.name for r in reports]
    print(f"{'operation':<30}" + "".join(f"{n:<15}" for n in names))
    operations = [op for op, _, _ in reports[0].lines]
    for op in operations:
        cells = []
        for report in reports:
            verdict = next((v for o, v, _ in report.lines if o == op), "-")
            cells.append(f"{verdict:<15}")
        print(f"{op:<30}" + "".join(cells))
    print("\n## timings: p50 in ms (ratio to the first target, measured in this run)")
    print(f"{'':<14}" + "".join(f"{k:<22}" for k in ("create+start", "exec true", "remove")))
    base = reports[0].timings
    for report in reports:
        cells = []
        for key in ("create+start", "exec true", "remove"):
            values = report.timings.get(key)
            if not values:
                cells.append(f"{'-':<22}")
                continue
            p50 = statistics.median(values)
            ratio = p50 / statistics.median(base[key]) if base.get(key) else float("nan")
            cells.append(f"{p50 * 1e3:7.1f} ({ratio:4.2f}x)".ljust(22))
        print(f"{report.target.name:<14}" + "".join(cells))


async def main(args: argparse.Namespace) -> int:
    reports = []
    for target in targets_from(args):
        print(
            f"\n# {target.name}: {target.url} runtime {target.runtime or '(default)'}", flush=True
        )
        reports.append(await Probe(target, args.image, args.runs, args.pull_ref).run())
    print_matrix(reports)
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--docker-host", default="", help="engine socket, e.g. " + PODMAN_SOCK)
    parser.add_argument("--runtime", default="", help="OCI runtime name, e.g. runsc")
    parser.add_argument(
        "--all", action="store_true", help="docker, docker+runsc, podman, podman+runsc"
    )
    parser.add_argument("--docker-sock", default=DOCKER_SOCK)
    parser.add_argument("--podman-sock", default=PODMAN_SOCK)
    parser.add_argument("--podman-runsc-sock", default=PODMAN_RUNSC_SOCK)
    parser.add_argument("--name", default="", help="the target's name in the report")
    parser.add_argument("--image", default=BASE_IMAGE)
    parser.add_argument("--runs", type=int, default=20, help="samples per timing")
    parser.add_argument("--pull-ref", default="", help="an image in a local registry to pull")
    try:
        sys.exit(asyncio.run(main(parser.parse_args())))
    except KeyboardInterrupt:
        sys.exit(130)
    except Exception:
        traceback.print_exc()
        sys.exit(1)
