#!/usr/bin/env python3
"""Head-node services (pool, agent, optionally PRM) owned by a slime training job.

Two ways to run them, both used by deploy/slime/run-qwen3-8b-grpo.sh:

- **processes** (`--mode processes` in the script): the launch script starts `swerl pool serve`
  etc. in the background and stops them when it exits. Simple; the services outlive a training
  job that is stopped with `ray job stop` until the script's trap runs.
- **Ray actor** (`python head_services.py --services pool,agent -- python3 train.py ...` as the
  Ray job's entrypoint): this module starts a `HeadServices` actor pinned to the head node and
  owned by the job's driver, then runs the training command. When the command ends the actor
  stops the services (SIGTERM, drain, SIGKILL after the grace); when the job is stopped or the
  driver dies, Ray kills the owned actor, and the services die with it because every service
  process is started with PR_SET_PDEATHSIG. Nothing outlives the job.

`HeadServices` itself does not need Ray (the tests drive it directly); Ray is imported only by
`start_actor` and `main`.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import ctypes
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

DEFAULT_PORTS = {"pool": 18090, "agent": 18091, "prm": 18092}


@dataclass
class ServiceSpec:
    """One head-node service: the command that serves it and the port it answers health on."""

    name: str
    argv: list[str]
    port: int
    env: dict[str, str] = field(default_factory=dict)
    host: str = "127.0.0.1"  # where to reach it for the readiness check


def _die_with_parent() -> None:
    # Linux: the child gets SIGTERM when the thread that started it dies (see _popen: a thread
    # that lives as long as the actor process), even by SIGKILL, so services never outlive it.
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    pr_set_pdeathsig = 1
    libc.prctl(pr_set_pdeathsig, signal.SIGTERM)
    os.setsid()  # own process group, so a stop signal reaches the service's children too


# PR_SET_PDEATHSIG fires when the *thread* that forked the child ends, not its process, and Ray
# runs actor methods on threads that may come and go (seen: a service got SIGTERM 0.4 s after
# `start` returned). Every service is therefore forked from one thread that lives as long as the
# actor process: an idle ThreadPoolExecutor worker never exits on its own.
_SPAWNER: concurrent.futures.ThreadPoolExecutor | None = None


def _popen(argv: list[str], env: dict[str, str], log) -> subprocess.Popen[bytes]:
    global _SPAWNER
    if _SPAWNER is None:
        _SPAWNER = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="swerl-spawner")
    return _SPAWNER.submit(
        subprocess.Popen,
        argv,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        preexec_fn=_die_with_parent,
    ).result()


class HeadServices:
    """Starts services in order, waits until each is SERVING, and stops them in reverse."""

    def __init__(
        self, specs: Sequence[ServiceSpec], log_dir: str | os.PathLike[str] = "/tmp/swerl-head"
    ) -> None:
        self.specs = list(specs)
        self.log_dir = Path(log_dir)
        self._procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, ready_timeout_s: float = 60.0) -> dict[str, str]:
        """Starts every service; returns name → host:port. Raises when one is not ready."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        addresses = {}
        try:
            for spec in self.specs:
                with open(self.log_dir / f"{spec.name}.log", "ab") as log:
                    self._procs[spec.name] = _popen(spec.argv, {**os.environ, **spec.env}, log)
                address = f"{spec.host}:{spec.port}"
                self._wait_ready(spec, address, ready_timeout_s)
                addresses[spec.name] = address
        except BaseException:
            self.stop()
            raise
        return addresses

    def alive(self) -> dict[str, bool]:
        return {name: proc.poll() is None for name, proc in self._procs.items()}

    def pids(self) -> dict[str, int]:
        return {name: proc.pid for name, proc in self._procs.items()}

    def stop(self, grace_s: float = 15.0) -> dict[str, int | None]:
        """SIGTERM (the services drain), then SIGKILL after `grace_s`; returns exit codes."""
        codes: dict[str, int | None] = {}
        for name in reversed(list(self._procs)):
            proc = self._procs[name]
            if proc.poll() is None:
                _signal_group(proc, signal.SIGTERM)
                try:
                    proc.wait(grace_s)
                except subprocess.TimeoutExpired:
                    _signal_group(proc, signal.SIGKILL)
                    proc.wait()
            codes[name] = proc.returncode
        self._procs.clear()
        return codes

    def _wait_ready(self, spec: ServiceSpec, address: str, timeout_s: float) -> None:
        proc = self._procs[spec.name]
        log = self.log_dir / f"{spec.name}.log"
        if not wait_serving(address, timeout_s, still_running=lambda: proc.poll() is None):
            if proc.poll() is not None:
                raise RuntimeError(f"{spec.name} exited with {proc.returncode}; see {log}")
            raise RuntimeError(f"{spec.name} not SERVING on {address} after {timeout_s}s")


def wait_serving(
    address: str, timeout_s: float, still_running: Callable[[], bool] = lambda: True
) -> bool:
    """Polls grpc.health.v1 Check on `address` until SERVING (True) or the timeout (False)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline and still_running():
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(), timeout=1.0)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return True
            except grpc.RpcError:
                pass
            time.sleep(0.2)
    return False


def _signal_group(proc: subprocess.Popen[bytes], sig: signal.Signals) -> None:
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass


def default_specs(
    services: Sequence[str],
    *,
    host: str,
    exec_nodes: Sequence[str],
    state_dir: str,
    ports: dict[str, int] | None = None,
) -> list[ServiceSpec]:
    """`swerl <svc> serve` for each requested service, wired to each other on this host.

    Tokens and every other setting come from the environment (`SWERL_POOL_*`, `SWERL_AGENT_*`,
    `SWERL_PRM_*`), which the launch script fills.
    """
    ports = {**DEFAULT_PORTS, **(ports or {})}
    specs = []
    for name in ("pool", "prm", "agent"):  # the agent needs the other two up first
        if name not in services:
            continue
        port = ports[name]
        argv = ["swerl", name, "serve", "--host", "0.0.0.0", "--port", str(port)]
        env: dict[str, str] = {}
        if name == "pool":
            argv += ["--state-dir", str(Path(state_dir) / "pool")]
            if exec_nodes:
                argv += ["--nodes", *exec_nodes]
        if name == "agent":
            env["SWERL_AGENT_POOL_ADDRESS"] = f"127.0.0.1:{ports['pool']}"
            if "prm" in services:
                env["SWERL_AGENT_PRM_ENDPOINT"] = f"127.0.0.1:{ports['prm']}"
        specs.append(ServiceSpec(name=name, argv=argv, port=port, env=env, host="127.0.0.1"))
    return specs


def start_actor(specs: Sequence[ServiceSpec], log_dir: str, ready_timeout_s: float = 120.0):
    """Starts a `HeadServices` Ray actor on this (the head) node, owned by the calling driver."""
    import ray
    from ray import cloudpickle
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    if __name__ != "__main__":
        # Imported from a file path that Ray's workers cannot import: ship the code itself.
        cloudpickle.register_pickle_by_value(sys.modules[__name__])
    actor_cls = ray.remote(num_cpus=0, max_restarts=0)(HeadServices)
    here = ray.get_runtime_context().get_node_id()
    actor = actor_cls.options(
        name="swerl-head-services",
        # Not detached: the actor belongs to this driver and dies with it.
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=here, soft=False),
    ).remote(list(specs), log_dir)
    addresses = ray.get(actor.start.remote(ready_timeout_s))
    return actor, addresses


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--services", default="pool,agent", help="pool,agent[,prm]")
    parser.add_argument("--exec-nodes", nargs="*", default=[], help="node_id=host:port ...")
    parser.add_argument("--state-dir", default="/var/lib/swerl", help="services' state dirs")
    parser.add_argument("--log-dir", default="/tmp/swerl-head", help="services' logs")
    parser.add_argument("--stop-grace-s", type=float, default=15.0)
    for name, port in DEFAULT_PORTS.items():
        parser.add_argument(f"--{name}-port", type=int, default=port)
    parser.add_argument(
        "--wait-serving",
        metavar="HOST:PORT",
        help="only wait until the server there is SERVING (exit 0) or --timeout-s passes (1)",
    )
    parser.add_argument("--timeout-s", type=float, default=120.0)
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- training command")
    args = parser.parse_args(argv)
    if args.wait_serving:
        return 0 if wait_serving(args.wait_serving, args.timeout_s) else 1
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the training command after --")

    import ray

    ray.init(address=os.environ.get("RAY_ADDRESS", "auto"))
    specs = default_specs(
        args.services.split(","),
        host="127.0.0.1",
        exec_nodes=args.exec_nodes,
        state_dir=args.state_dir,
        ports={name: getattr(args, f"{name}_port") for name in DEFAULT_PORTS},
    )
    actor, addresses = start_actor(specs, args.log_dir)
    print(f"swerl head services up: {addresses}", flush=True)
    try:
        return subprocess.call(command)
    finally:
        ray.get(actor.stop.remote(args.stop_grace_s))
        ray.kill(actor)


if __name__ == "__main__":
    sys.exit(main())
