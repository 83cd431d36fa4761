"""`claude-code`: Anthropic's Claude Code CLI, run inside the episode's sandbox.

It runs from the node's read-only bundle (swerl.exec.bundles: a standalone Node and the
`@anthropic-ai/claude-code` package, never uploaded per episode, the task image unchanged) the
way its documentation runs it non-interactively: `claude -p` with the task on stdin,
`--output-format stream-json --verbose` (its own log, kept as harness.log), and permission
prompts off (`--dangerously-skip-permissions`, with `IS_SANDBOX=1` since sandboxes run as
root). Only where its model and its shell are is changed: `ANTHROPIC_BASE_URL` is the forwarder
from the bundle on `127.0.0.1:<port>`, which relays to the socket the exec node bridges to the
episode's gateway session (the session's secret is added by the node, the sandbox never holds
it), `ANTHROPIC_MODEL` the session's model, `SHELL` the image's bash; its non-essential traffic
(telemetry, updates, error reports) is switched off by its own variables, and the sandbox's
network stays `none` whatever it tries.

The CLI and the forwarder run detached from the node's command queue (their own process
groups) and carry a marker variable; `cancel` kills every process of the sandbox that carries
it (tool subprocesses included), at once. Its exit status ends the run: 0 grades the sandbox's
diff, anything else is HARNESS_FAILED with the end of its log.
"""

from __future__ import annotations

import shlex
import uuid

from swerl.agent.harnesses.base import HarnessFailed, HarnessRun
from swerl.agent.loop.sandbox import HarnessMount, SandboxHandle
from swerl.agent.status import EpisodeStatus

# The harness's files inside the sandbox: task prompt, its output and errors, exit status.
STATE_DIR = "/tmp/swerl-claude-code"
# Most of its log kept (the end of it, where a failure is told).
MAX_LOG_BYTES = 900_000  # under the node's default output cap
# How long the forwarder may take to listen.
FORWARDER_START_S = 30.0
# Commands about the harness (not the harness itself) get this long.
CONTROL_TIMEOUT_S = 30.0


def _kill_marked(marker: str) -> str:
    """Bash that SIGKILLs every process whose environment holds `SWERL_HARNESS=<marker>`."""
    return (
        "for p in /proc/[0-9]*; do"
        f' grep -qsxz \'SWERL_HARNESS={marker}\' "$p/environ" && kill -KILL "${{p#/proc/}}"'
        " 2>/dev/null; done; true"
    )


class ClaudeCodeHarness:
    name = "claude-code"
    timeout_status = EpisodeStatus.HARNESS_TIMEOUT

    def __init__(self) -> None:
        self._sandbox: SandboxHandle | None = None
        self._mount: HarnessMount | None = None
        self._marker = uuid.uuid4().hex
        self._port = 0
        self._log = b""
        self._cancelled = False

    async def prepare(self, run: HarnessRun) -> None:
        model = run.model
        if model is None:
            raise HarnessFailed("claude-code needs the episode's gateway session")
        sandbox = self._sandbox = run.sandbox
        mount = self._mount = await sandbox.open_harness(
            self.name, model.anthropic_base_url, model.api_key
        )
        ready = f"{STATE_DIR}/forwarder.port"
        started = await sandbox.run(
            f"mkdir -p {STATE_DIR}/home && rm -f {ready} && set -m &&"
            f" SWERL_HARNESS={self._marker} {shlex.quote(mount.node)}"
            f" {shlex.quote(mount.forwarder)} {shlex.quote(mount.gateway_socket)} 0 {ready}"
            f" </dev/null >{STATE_DIR}/forwarder.log 2>&1 & set +m;"
            f" for i in $(seq {int(FORWARDER_START_S * 10)}); do [ -s {ready} ] && break;"
            f" sleep 0.1; done; cat {ready} 2>/dev/null || cat {STATE_DIR}/forwarder.log",
            timeout_s=FORWARDER_START_S + 5,
            env={},
            cwd="/",
        )
        text = started.stdout.decode(errors="replace").strip()
        if started.exit_code != 0 or not text.isdigit():
            raise HarnessFailed(f"the gateway forwarder did not start: {text[-2000:]}")
        self._port = int(text)
        await sandbox.run(
            f"cat > {STATE_DIR}/task.md",
            timeout_s=CONTROL_TIMEOUT_S,
            env={},
            cwd="/",
            stdin=run.spec.instance.problem_statement.encode(),
        )

    def _environment(self, run: HarnessRun) -> dict[str, str]:
        assert run.model is not None
        return {
            "SWERL_HARNESS": self._marker,
            "HOME": f"{STATE_DIR}/home",
            "SHELL": "/bin/bash",
            "IS_SANDBOX": "1",
            "ANTHROPIC_BASE_URL": f"http://127.0.0.1:{self._port}",
            # The node sets the session's secret on the way out; the CLI wants a key to start.
            "ANTHROPIC_API_KEY": "swerl-bridged",
            "ANTHROPIC_MODEL": run.model.model,
            "ANTHROPIC_SMALL_FAST_MODEL": run.model.model,
            "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
            "DISABLE_AUTOUPDATER": "1",
            "DISABLE_TELEMETRY": "1",
            "DISABLE_ERROR_REPORTING": "1",
        }

    async def run(self, run: HarnessRun) -> str | None:
        sandbox, mount = self._sandbox, self._mount
        assert sandbox is not None and mount is not None
        exports = " ".join(f"{k}={shlex.quote(v)}" for k, v in self._environment(run).items())
        claude = (
            f"{shlex.quote(mount.harness_binary)} -p --dangerously-skip-permissions"
            " --output-format stream-json --verbose"
        )
        rc = f"{STATE_DIR}/exit_code"
        # Detached (its own process group) so no command of the node's queue holds it; then
        # one command waits for its exit status (the episode's budget bounds the wait).
        await sandbox.run(
            f"rm -f {rc}; set -m; ( env {exports} {claude} <{STATE_DIR}/task.md"
            f" >{STATE_DIR}/out.jsonl 2>{STATE_DIR}/err.log; echo $? >{rc} ) </dev/null"
            " >/dev/null 2>&1 & set +m; true",
            timeout_s=CONTROL_TIMEOUT_S,
            env={},
            cwd=run.spec.config.workdir or "",
        )
        waited = await sandbox.run(
            f"while [ ! -s {rc} ]; do sleep 0.2; done; cat {rc}",
            timeout_s=max(run.spec.wall_timeout_s, 1.0),
            env={},
            cwd="/",
        )
        await self._collect_log()
        status = waited.stdout.decode(errors="replace").strip()
        if status != "0":
            tail = self._log[-1500:].decode(errors="replace")
            raise HarnessFailed(f"claude exited with status {status or '?'}: {tail}")
        return None

    async def _collect_log(self) -> None:
        if self._sandbox is None:
            return
        result = await self._sandbox.run(
            f"cat {STATE_DIR}/out.jsonl {STATE_DIR}/err.log 2>/dev/null | tail -c {MAX_LOG_BYTES}",
            timeout_s=CONTROL_TIMEOUT_S,
            env={},
            cwd="/",
        )
        self._log = result.stdout

    async def cancel(self) -> None:
        if self._sandbox is None or self._cancelled:
            return
        self._cancelled = True
        await self._sandbox.run(
            _kill_marked(self._marker), timeout_s=CONTROL_TIMEOUT_S, env={}, cwd="/"
        )
        if not self._log:
            await self._collect_log()

    def log(self) -> bytes:
        return self._log
