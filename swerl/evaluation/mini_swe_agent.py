"""A mini-swe-agent Environment on swerl: a sandbox leased from the pool, commands through the
exec node's Exec stream. With it, mini-swe-agent's own SWE-bench batch runner runs on swerl
nodes instead of a local Docker:

    SWERL_POOL_ADDRESS=head:18090 SWERL_TOKEN=... \
    python -m swerl.evaluation.mini_swe_agent swebench --subset verified --split test \
        -c swebench.yaml -c environment.environment_class=swerl -o runs/x   # mini's own flags

mini-swe-agent's runner hands the instance's image only to the environments it knows, so this
module's `swebench` entry point runs that runner with one change: for `environment_class: swerl`
(or this class's dotted path) the image and instance id go into the environment's config. The
rest of the environment section is this class's config (cwd, timeout, env, pool_address, ...).

The environment leases a sandbox of the image (waiting in the pool's queue), keeps the lease
alive, runs each action as one ISOLATED Exec (a fresh login shell per command, like
`docker exec ... bash -lc`), and releases the lease in `cleanup()`.
Output is stdout and stderr merged in order, as mini-swe-agent's Docker environment returns it;
a submission is detected by mini-swe-agent's rule (first output line
`COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT`, exit code 0) and raised as its `Submitted`.

The protocol is synchronous and mini-swe-agent runs instances on threads, so each environment
drives its async pool client on a private event loop thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
from collections.abc import Coroutine
from typing import Any, ClassVar, TypeVar

from pydantic import BaseModel, Field

from swerl.agent.budget import DEFAULT_LEASE_WAIT_S
from swerl.agent.harnesses.mini_env import SandboxEnvironmentBase

ENVIRONMENT_CLASS = "swerl.evaluation.mini_swe_agent.SwerlEnvironment"
_NAMES = {"swerl", ENVIRONMENT_CLASS}
T = TypeVar("T")


class SwerlEnvironmentConfig(BaseModel):
    image: str
    """Image of the sandbox (the runner sets it from the instance)."""
    cwd: str = "/"
    """Working directory of commands."""
    env: dict[str, str] = {}
    """Environment variables of every command."""
    forward_env: list[str] = []
    """Variables of this process passed to commands when set (`env` wins on conflict)."""
    timeout: int = 30
    """Default command timeout in seconds, enforced inside the sandbox."""
    pool_address: str = Field(
        default_factory=lambda: os.environ.get("SWERL_POOL_ADDRESS", "127.0.0.1:18090")
    )
    """PoolService host:port."""
    token: str | None = Field(default_factory=lambda: os.environ.get("SWERL_TOKEN"))
    """Bearer token of the pool and nodes."""
    instance_id: str = ""
    """Recorded on the lease, for operators."""
    owner: str = "mini-swe-agent"
    """Recorded on the lease, for operators."""
    lease_wait_s: float = DEFAULT_LEASE_WAIT_S
    """How long to wait in the pool's queue for a sandbox (the agent's default)."""
    max_output_bytes: int = 0
    """Output cap per command (0: the node's default), head and tail kept."""


class SwerlEnvironment(SandboxEnvironmentBase):
    """mini-swe-agent's Environment protocol over a swerl lease; see the module docstring."""

    secret_fields: ClassVar[set[str]] = {"token"}

    def __init__(self, *, config_class: type = SwerlEnvironmentConfig, **kwargs: Any) -> None:
        self.config = config_class(**kwargs)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="swerl-mini-env", daemon=True
        )
        self._thread.start()
        self._lease: Any = None
        self._node: Any = None  # the exec node's client on the lease's node
        self._lease_context: Any = None
        self._pool: Any = None
        try:
            self._call(self._open())
        except BaseException:
            self.cleanup()
            raise

    # -- the sandbox (swerl.agent.harnesses.mini_env shapes results and submissions) ------
    def _exec(self, command: str, cwd: str, timeout_s: float) -> Any:
        return self._call(self._run(command, cwd, timeout_s))

    def _serialized_extra(self) -> dict[str, Any]:
        return {
            "lease_id": getattr(self._lease, "lease_id", ""),
            "node_id": getattr(self._lease, "node_id", ""),
        }

    def cleanup(self) -> None:
        """Releases the lease (its sandbox is destroyed) and stops the loop thread."""
        if self._loop.is_closed():
            return
        if self._thread.is_alive():
            with contextlib.suppress(Exception):
                self._call(self._close(), timeout=120)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)
        if not self._thread.is_alive():
            self._loop.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.cleanup()

    # -- internals -------------------------------------------------------------------------
    def _call(self, coroutine: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(timeout)

    async def _open(self) -> None:
        from swerl.exec.client import SandboxClient
        from swerl.pool.client import PoolClient

        self._pool = PoolClient(self.config.pool_address, token=self.config.token)
        self._lease_context = self._pool.lease(
            self.config.image,
            owner=self.config.owner,
            instance_id=self.config.instance_id,
            wait_s=self.config.lease_wait_s,
            workdir=self.config.cwd,
        )
        self._lease = await self._lease_context.__aenter__()
        self._node = SandboxClient.for_lease(self._lease)

    async def _close(self) -> None:
        try:
            if self._lease_context is not None:
                context, self._lease_context = self._lease_context, None
                await context.__aexit__(None, None, None)
        finally:
            if self._pool is not None:
                pool, self._pool = self._pool, None
                await pool.close()
            # Nothing may be left pending on a loop that is about to close.
            others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in others:
                task.cancel()
            await asyncio.gather(*others, return_exceptions=True)

    async def _run(self, command: str, cwd: str, timeout_s: float) -> Any:
        self._lease.raise_if_lost()
        env = {k: v for k in self.config.forward_env if (v := os.environ.get(k)) is not None}
        env.update(self.config.env)
        return await self._node.run(
            self._lease.sandbox_id,
            command,
            cwd=cwd,
            env=env,
            timeout_s=float(timeout_s),
            max_output_bytes=self.config.max_output_bytes,
        )


def sb_environment(config: dict, instance: dict) -> Any:
    """mini-swe-agent's `get_sb_environment`, giving a swerl environment its image."""
    from minisweagent.run.benchmarks import swebench

    environment = dict(config.get("environment", {}))
    if environment.get("environment_class") in _NAMES:
        environment.update(
            environment_class=ENVIRONMENT_CLASS,
            image=swebench.get_swebench_docker_image_name(instance),
            instance_id=str(instance.get("instance_id", "")),
        )
        config = {**config, "environment": environment}
    return _original_sb_environment(config, instance)


def _original_sb_environment(config: dict, instance: dict) -> Any:
    from minisweagent.run.benchmarks import swebench

    original = getattr(swebench, "_swerl_original_get_sb_environment", swebench.get_sb_environment)
    return original(config, instance)


def main(argv: list[str] | None = None) -> None:
    """`python -m swerl.evaluation.mini_swe_agent swebench ...`: mini-swe-agent's SWE-bench
    batch runner, unchanged except that it can hand its instances' images to swerl."""
    import sys

    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] != "swebench":
        raise SystemExit("usage: python -m swerl.evaluation.mini_swe_agent swebench [mini's flags]")
    from minisweagent.run.benchmarks import swebench

    if not hasattr(swebench, "_swerl_original_get_sb_environment"):
        swebench._swerl_original_get_sb_environment = swebench.get_sb_environment  # type: ignore[attr-defined]
        swebench.get_sb_environment = sb_environment
    swebench.app(args[1:])


if __name__ == "__main__":
    main()
