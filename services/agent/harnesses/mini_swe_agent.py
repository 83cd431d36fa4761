"""`mini-swe-agent`: the real mini-swe-agent (PyPI, 2.x) drives the episode.

It runs as its documentation runs it from Python (`DefaultAgent(model, env, **config["agent"])`
then `agent.run(task)`), with its SWE-bench config (`benchmarks/swebench.yaml`: tool calling,
one `bash` tool, submission by `echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT && cat patch.txt`).
Two things are swerl's, and only those: its model is its own tool-calling `LitellmModel` with
the OpenAI base URL and secret of the episode's gateway session (so every call is recorded
token-exact), and its environment runs each action as one Exec in the episode's leased sandbox
(`mini_env.SandboxEnvironmentBase`, as the evaluation's `SwerlEnvironment`). The step limit is
the episode's max_turns, its command timeout the episode's; the config's cost limit is off (the
policy costs nothing per token here).

Its submission is the episode's patch. Any other ending (its step limit, repeated format
errors, an exception of its own) is HARNESS_FAILED, graded on what the sandbox holds; an
unreachable model or sandbox is INFRA_ERROR (the episode usually sees it first in its session).

mini-swe-agent is synchronous: each episode runs its agent on a thread of its own, and its
environment hands each command to the episode's event loop. `cancel` stops it at once: the
running command is cancelled, and every later command or model call raises at its start (a
model call already in flight is answered by the closed session with an error, which
mini-swe-agent does not retry). The trajectory mini-swe-agent saves (its own format) is the
episode's `harness.log`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import os
import threading
from typing import Any, ClassVar

from pydantic import BaseModel

from swerl.agent.errors import EpisodeInfraError
from swerl.agent.harnesses.base import HarnessFailed, HarnessModel, HarnessRun
from swerl.agent.harnesses.mini_env import SandboxEnvironmentBase
from swerl.agent.loop.sandbox import SandboxHandle
from swerl.agent.settings import POLICY_REQUEST_TIMEOUT_S
from swerl.agent.status import EpisodeStatus
from swerl.chassis.extras import OptionalPackage
from swerl.exec.outcome import ExecResult

# mini-swe-agent's own config the harness runs with (its SWE-bench one: tool calling).
MINI_CONFIG = "swebench.yaml"
# The reason of an episode whose harness could not reach its model.
MODEL_UNREACHABLE = "MODEL_UNREACHABLE"

_import_lock = threading.Lock()


class HarnessStopped(Exception):
    """The episode stopped its harness: no more commands or model calls."""


def _mini() -> Any:
    """mini-swe-agent's modules, imported once (litellm's import takes seconds of CPU)."""
    with _import_lock:
        # No network for litellm's model cost map: its bundled copy (swerl tracks no cost).
        os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
        # mini-swe-agent prints a banner to stdout on import; the agent's stdout is swerl's.
        os.environ.setdefault("MSWEA_SILENT_STARTUP", "1")
        import minisweagent.agents.default as agents
        import minisweagent.config as config
        import minisweagent.models.litellm_model as models

        # litellm prints a banner to stdout on each failed model lookup (its cost map).
        models.litellm.suppress_debug_info = True

        return agents, config, models


def mini_config() -> dict[str, Any]:
    """mini-swe-agent's SWE-bench config, as its loader reads it."""
    import yaml

    _, config, _ = _mini()
    return dict(yaml.safe_load(config.get_config_path(MINI_CONFIG).read_text()))


class EpisodeEnvironmentConfig(BaseModel):
    cwd: str = "/testbed"
    """Working directory of commands."""
    env: dict[str, str] = {}
    """Environment variables of every command."""
    timeout: int = 60
    """Default command timeout in seconds, enforced inside the sandbox."""


class EpisodeEnvironment(SandboxEnvironmentBase):
    """mini-swe-agent's Environment on the episode's leased sandbox: each action one Exec, run
    on the episode's event loop. Sandbox failures are the episode's (INFRA_ERROR, not shown to
    the model), so `_exec` lets them through."""

    shown_errors: ClassVar[tuple[type[BaseException], ...]] = ()

    def __init__(
        self,
        sandbox: SandboxHandle,
        loop: asyncio.AbstractEventLoop,
        stop: threading.Event,
        running: set[concurrent.futures.Future[Any]],
        **kwargs: Any,
    ) -> None:
        self.config = EpisodeEnvironmentConfig(**kwargs)
        self._sandbox = sandbox
        self._loop = loop
        self._stop = stop
        self._running = running

    def _exec(self, command: str, cwd: str, timeout_s: float) -> ExecResult:
        if self._stop.is_set():
            raise HarnessStopped("the episode stopped its harness")
        coroutine = self._sandbox.run(
            command, timeout_s=timeout_s, env=self.config.env, cwd=cwd, stdin=None
        )
        future = asyncio.run_coroutine_threadsafe(coroutine, self._loop)
        self._running.add(future)
        try:
            return future.result()
        except concurrent.futures.CancelledError as err:
            raise HarnessStopped("the episode stopped its harness") from err
        finally:
            self._running.discard(future)

    def _serialized_extra(self) -> dict[str, Any]:
        return {"lease_id": self._sandbox.lease_id, "node_id": self._sandbox.node_id}


def _gateway_model(models: Any, stop: threading.Event) -> type:
    """mini-swe-agent's tool-calling LitellmModel, refusing to call once the episode stopped
    (and not retrying that refusal)."""

    class GatewayModel(models.LitellmModel):
        abort_exceptions: ClassVar[list[type[BaseException]]] = [
            *models.LitellmModel.abort_exceptions,
            HarnessStopped,
        ]

        def _query(self, messages: list[dict[str, str]], **kwargs: Any) -> Any:
            if stop.is_set():
                raise HarnessStopped("the episode stopped its harness")
            return super()._query(messages, **kwargs)

    return GatewayModel


# What the harness imports when it runs (swerl's `harness` extra); the agent refuses its episodes
# when either is missing (HARNESS_UNAVAILABLE).
REQUIRES = (
    OptionalPackage("minisweagent", "mini-swe-agent", "harness"),
    OptionalPackage("litellm", "litellm", "harness"),
)


class MiniSweAgentHarness:
    name = "mini-swe-agent"
    timeout_status = EpisodeStatus.HARNESS_TIMEOUT
    requires: ClassVar[tuple[OptionalPackage, ...]] = REQUIRES

    def __init__(self) -> None:
        self._stop = threading.Event()
        self._running: set[concurrent.futures.Future[Any]] = set()
        self._config: dict[str, Any] = {}
        self._agent: Any = None
        self._log = b""

    async def prepare(self, run: HarnessRun) -> None:
        if run.model is None:
            raise HarnessFailed("mini-swe-agent needs the episode's gateway session")
        # The first episode pays mini-swe-agent's (and litellm's) import, off the loop.
        self._config = await asyncio.get_running_loop().run_in_executor(None, mini_config)

    async def run(self, run: HarnessRun) -> str | None:
        assert run.model is not None
        loop = asyncio.get_running_loop()
        done: asyncio.Future[Any] = loop.create_future()

        def finish(outcome: Any) -> None:
            if not done.done():
                done.set_result(outcome)

        def main() -> None:
            try:
                outcome: Any = self._main(run, run.model, loop)  # type: ignore[arg-type]
            except BaseException as err:  # handed to the episode's loop, raised there
                outcome = err
            with contextlib.suppress(RuntimeError):  # the loop is gone: nobody waits
                loop.call_soon_threadsafe(finish, outcome)

        # A daemon: a thread still in mini-swe-agent's retry wait when the episode stopped it
        # ends at its next call, and never holds the agent's exit.
        name = f"mini-swe-agent-{run.spec.episode_id}"
        threading.Thread(target=main, name=name, daemon=True).start()
        outcome = await done
        if isinstance(outcome, BaseException):
            raise _episode_error(outcome) from outcome
        if outcome.get("exit_status") == "Submitted":
            return str(outcome.get("submission", ""))
        status = outcome.get("exit_status") or "no exit status"
        raise HarnessFailed(f"mini-swe-agent exited {status} without a submission")

    def _main(self, run: HarnessRun, model: HarnessModel, loop: asyncio.AbstractEventLoop) -> Any:
        """mini-swe-agent's run, on this episode's thread."""
        agents, _, models = _mini()
        spec, config = run.spec, self._config
        model_config = dict(config.get("model") or {})
        model_config["model_name"] = f"openai/{model.model}"
        model_config["model_kwargs"] = {
            **(model_config.get("model_kwargs") or {}),
            "api_base": model.openai_base_url,
            "api_key": model.api_key,
            "timeout": spec.request_timeout_s or POLICY_REQUEST_TIMEOUT_S,
        }
        model_config["cost_tracking"] = "ignore_errors"
        env_config = dict(config.get("environment") or {})
        env_vars = {**(env_config.get("env") or {}), **spec.config.env, **spec.env}
        environment = EpisodeEnvironment(
            run.sandbox,
            loop,
            self._stop,
            self._running,
            cwd=spec.config.workdir or env_config.get("cwd", "/testbed"),
            env=env_vars,
            timeout=int(spec.command_timeout_s or env_config.get("timeout", 60)),
        )
        agent_config = {
            **(config.get("agent") or {}),
            "step_limit": spec.max_turns,
            "cost_limit": 0.0,
        }
        lm = _gateway_model(models, self._stop)(**model_config)
        self._agent = agent = agents.DefaultAgent(lm, environment, **agent_config)
        try:
            return agent.run(spec.instance.problem_statement)
        finally:
            with contextlib.suppress(Exception):
                self._log = json.dumps(agent.serialize(), indent=1, default=str).encode()

    async def cancel(self) -> None:
        self._stop.set()
        for future in list(self._running):
            future.cancel()

    def log(self) -> bytes:
        if not self._log and self._agent is not None:  # stopped mid-run: the trajectory so far
            with contextlib.suppress(Exception):
                return json.dumps(self._agent.serialize(), indent=1, default=str).encode()
        return self._log


def _episode_error(err: BaseException) -> BaseException:
    """What an exception out of mini-swe-agent's run means for the episode."""
    if isinstance(err, EpisodeInfraError | HarnessFailed):
        return err
    if isinstance(err, HarnessStopped):
        return asyncio.CancelledError()
    try:
        import litellm

        unreachable: tuple[type[BaseException], ...] = (
            litellm.exceptions.APIConnectionError,
            litellm.exceptions.ServiceUnavailableError,
            litellm.exceptions.Timeout,
            litellm.exceptions.NotFoundError,
        )
    except ImportError:  # pragma: no cover - litellm comes with mini-swe-agent
        unreachable = ()
    if isinstance(err, unreachable):
        return EpisodeInfraError(MODEL_UNREACHABLE, f"mini-swe-agent's model call failed: {err}")
    return HarnessFailed(f"mini-swe-agent raised {type(err).__name__}: {err}")
