"""The SWE tool set of the `tool_calls` action protocol: `bash`, the file editor
`str_replace_editor` and `submit`, as JSON schemas for the chat template (`tools=`) and as code
that runs a parsed call in the episode's sandbox.

The editor works through the exec node with exact bytes: a file is read from a command's stdout
and written from a command's stdin, the path passed in the environment, so no file content or
path is ever quoted into a shell line. What it does to a file follows the editor shape SWE-agent,
OpenHands and Anthropic's text editor share (view with a line range, create, str_replace, insert),
and every refusal is a clear tool error the model reads (`Error: ...`).
"""

from __future__ import annotations

import signal
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from swerl.agent.actions.toolcalls import ToolCall

if TYPE_CHECKING:  # the Protocol only: this module runs calls, it imports no grpc
    from swerl.agent.loop.sandbox import SandboxHandle

BASH_TOOL = {
    "type": "function",
    "function": {
        "name": "bash",
        "description": (
            "Run one bash command in a fresh shell in the repository and return its exit code"
            " and output. `cd` and variables do not carry over between calls; interactive"
            " programs (editors, pagers) do not work."
        ),
        "parameters": {
            "type": "object",
            "properties": {
                "command": {"type": "string", "description": "The bash command to run."},
                "timeout": {
                    "type": "integer",
                    "description": "Seconds before the command is killed (optional; capped).",
                },
            },
            "required": ["command"],
        },
    },
}

EDITOR_TOOL = {
    "type": "function",
    "function": {
        "name": "str_replace_editor",
        "description": (
            "View, create and edit text files. `view` shows a file with line numbers (or a"
            " directory's files two levels deep); `create` writes a new file; `str_replace`"
            " replaces old_str, which must occur exactly once, with new_str; `insert` puts"
            " new_str after line insert_line (0: at the top). Paths are absolute."
        ),
        "parameters": {
            "type": "object",
            "properties": {
                "command": {
                    "type": "string",
                    "enum": ["view", "create", "str_replace", "insert"],
                    "description": "What to do.",
                },
                "path": {"type": "string", "description": "Absolute path of the file."},
                "file_text": {"type": "string", "description": "create: the file's content."},
                "old_str": {
                    "type": "string",
                    "description": "str_replace: the exact text to replace (unique in the file).",
                },
                "new_str": {
                    "type": "string",
                    "description": "str_replace: the replacement; insert: the text to insert.",
                },
                "insert_line": {
                    "type": "integer",
                    "description": "insert: the line after which new_str goes (0: the top).",
                },
                "view_range": {
                    "type": "array",
                    "items": {"type": "integer"},
                    "description": "view: [first, last] line, 1-based; last -1 means the end.",
                },
            },
            "required": ["command", "path"],
        },
    },
}

SUBMIT_TOOL = {
    "type": "function",
    "function": {
        "name": "submit",
        "description": (
            "Submit your changes to the repository as the final answer (the diff of every"
            " file you changed). After this you cannot continue."
        ),
        "parameters": {"type": "object", "properties": {}, "required": []},
    },
}

TOOLS: dict[str, dict[str, Any]] = {
    "bash": BASH_TOOL,
    "str_replace_editor": EDITOR_TOOL,
    "submit": SUBMIT_TOOL,
}

SUBMIT_COMMAND = "git add -A && git diff --cached --binary"
# Files larger than this are not edited (their content would have to fit an observation).
MAX_EDIT_BYTES = 4 << 20
_SNIPPET_LINES = 4
_MAX_LIST = 400
_PATH_ENV = "SWERL_EDIT_PATH"
# Exit codes of the read command: no such path, a directory, not readable.
_MISSING, _DIRECTORY, _UNREADABLE = 3, 4, 5
_READ = (
    f'[ -e "${_PATH_ENV}" ] || exit {_MISSING}; [ -d "${_PATH_ENV}" ] && exit {_DIRECTORY};'
    f' [ -r "${_PATH_ENV}" ] || exit {_UNREADABLE}; cat -- "${_PATH_ENV}"'
)
_WRITE = f'mkdir -p -- "$(dirname -- "${_PATH_ENV}")" && cat > "${_PATH_ENV}"'
_LIST = (
    f"find \"${_PATH_ENV}\" -maxdepth 2 -not -path '*/.*' 2>/dev/null | sort | head -n {_MAX_LIST}"
)


_RESTARTED_NOTE = (
    "[The sandbox's processes had all died (a command killed them), so it was started again"
    " before this command: files are kept; background processes, the shell's variables and"
    " its working directory are gone.]\n"
)


def killed_by(exit_code: int, timed_out: bool) -> int | None:
    """The signal that ended a command (exit code 128+N by the shell's convention); None for
    an ordinary exit or a timeout (the node's own kill)."""
    if timed_out or not 128 < exit_code < 128 + 65:
        return None
    return exit_code - 128


def command_notes(exit_code: int, timed_out: bool, restarted: bool) -> str:
    """What an observation says before a command's output: that the sandbox had been started
    again before it, and that the command was killed by a signal."""
    notes = _RESTARTED_NOTE if restarted else ""
    signum = killed_by(exit_code, timed_out)
    if signum is not None:
        try:
            name = f" ({signal.Signals(signum).name})"
        except ValueError:
            name = ""
        notes += f"[The command, or the shell running it, was killed by signal {signum}{name}.]\n"
    return notes


class ToolError(Exception):
    """A call the tool refuses: `message` is what the model reads."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


@dataclass
class ToolOutcome:
    """What one call did: the tool message's text and what the episode records about it."""

    text: str
    error: bool = False
    submission: str | None = None  # the patch, for a successful submit
    exit_code: int | None = None  # bash only
    timed_out: bool = False
    killed_signal: int | None = None
    sandbox_restarted: bool = False
    exec_s: float = 0.0
    output_bytes: int = 0
    command: str = ""  # what ran, for the turn record and the PRM
    output: str = ""
    details: dict[str, Any] = field(default_factory=dict)


# Renders a bash result as the config's observation: (exit code, output, timed out, the
# sandbox was restarted before it) -> the tool message's text.
RenderBash = Callable[[int, str, bool, bool], Awaitable[str]]


class ToolBox:
    """Runs parsed calls of one episode in its sandbox."""

    def __init__(
        self,
        sandbox: SandboxHandle,
        *,
        workdir: str,
        env: Mapping[str, str],
        command_timeout_s: float,
        render_bash: RenderBash,
    ) -> None:
        self._sandbox = sandbox
        self._workdir = workdir
        self._env = dict(env)
        self._timeout_s = command_timeout_s
        self._render_bash = render_bash
        # The last bash command ended killed by a signal (a sandbox found dead after it is
        # the policy's doing).
        self.last_killed = False

    async def run(self, call: ToolCall) -> ToolOutcome:
        """Runs one runnable call; a refused call is an error outcome (never an exception,
        except the sandbox's own failures, EpisodeInfraError)."""
        arguments = call.arguments or {}
        started = time.monotonic()
        try:
            if call.name == "bash":
                outcome = await self._bash(arguments)
            elif call.name == "str_replace_editor":
                outcome = await self._edit(arguments)
            elif call.name == "submit":
                outcome = await self._submit()
            else:
                raise ToolError(f"Error: unknown tool {call.name!r}.")
        except ToolError as err:
            outcome = ToolOutcome(err.message, error=True)
        outcome.exec_s = time.monotonic() - started
        return outcome

    # -- bash ------------------------------------------------------------------------------

    async def _bash(self, arguments: Mapping[str, Any]) -> ToolOutcome:
        command = str(arguments["command"])
        if not command.strip():
            raise ToolError("Error: the command is empty.")
        timeout_s = self._timeout_s
        asked = arguments.get("timeout")
        if isinstance(asked, int) and asked > 0:
            timeout_s = min(float(asked), self._timeout_s)
        result = await self._sandbox.run(
            command, timeout_s=timeout_s, env=self._env, cwd=self._workdir
        )
        output = result.output.decode(errors="replace")
        signum = killed_by(result.exit_code, result.timed_out)
        restarted = bool(getattr(result, "sandbox_restarted", False))
        self.last_killed = signum is not None
        text = await self._render_bash(result.exit_code, output, result.timed_out, restarted)
        return ToolOutcome(
            text,
            exit_code=result.exit_code,
            timed_out=result.timed_out,
            killed_signal=signum,
            sandbox_restarted=restarted,
            output_bytes=len(result.output) + result.bytes_dropped,
            command=command,
            output=output,
        )

    # -- submit ----------------------------------------------------------------------------

    async def _submit(self) -> ToolOutcome:
        result = await self._sandbox.run(
            SUBMIT_COMMAND, timeout_s=self._timeout_s, env=self._env, cwd=self._workdir
        )
        if result.exit_code != 0:
            detail = result.output.decode(errors="replace")[-2000:]
            raise ToolError(
                f"Error: the submission failed (`{SUBMIT_COMMAND}` exited {result.exit_code}):"
                f"\n{detail}"
            )
        patch = result.stdout.decode(errors="replace")
        return ToolOutcome(
            "Submitted.", submission=patch, exit_code=0, command="submit", output=patch
        )

    # -- the editor ------------------------------------------------------------------------

    async def _edit(self, arguments: Mapping[str, Any]) -> ToolOutcome:
        command = arguments["command"]
        path = str(arguments["path"])
        if not path.startswith("/"):
            raise ToolError(
                f"Error: the path {path!r} is not absolute; give the full path, e.g."
                f" {self._workdir.rstrip('/')}/{path}."
            )
        needed = {
            "create": ("file_text",),
            "str_replace": ("old_str",),
            "insert": ("insert_line", "new_str"),
        }.get(command, ())
        missing = [name for name in needed if name not in arguments]
        if missing:
            raise ToolError(f"Error: `{command}` needs the parameter(s) {', '.join(missing)}.")
        outcome: ToolOutcome
        if command == "view":
            outcome = await self._view(path, arguments.get("view_range"))
        elif command == "create":
            outcome = await self._create(path, str(arguments["file_text"]))
        elif command == "str_replace":
            outcome = await self._str_replace(
                path, str(arguments["old_str"]), str(arguments.get("new_str", ""))
            )
        else:
            outcome = await self._insert(
                path, int(arguments["insert_line"]), str(arguments["new_str"])
            )
        outcome.command = f"str_replace_editor {command} {path}"
        return outcome

    async def _read(self, path: str) -> bytes:
        result = await self._sandbox.run(
            _READ, timeout_s=60.0, env={**self._env, _PATH_ENV: path}, cwd=self._workdir
        )
        if result.exit_code == _MISSING:
            raise ToolError(f"Error: the path {path} does not exist.")
        if result.exit_code == _DIRECTORY:
            raise ToolError(f"Error: {path} is a directory; this command works on files.")
        if result.exit_code == _UNREADABLE:
            raise ToolError(f"Error: {path} is not readable.")
        if result.exit_code != 0:
            detail = result.stderr.decode(errors="replace").strip()[:500]
            raise ToolError(f"Error: could not read {path}: {detail or result.exit_code}")
        if result.output_truncated or result.bytes_dropped or len(result.stdout) > MAX_EDIT_BYTES:
            raise ToolError(
                f"Error: {path} is too large for the editor; use bash (grep -n, sed -n) instead."
            )
        return result.stdout

    async def _text(self, path: str) -> str:
        data = await self._read(path)
        if b"\0" in data[:8192]:
            raise ToolError(f"Error: {path} is a binary file; the editor only edits text files.")
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError:
            raise ToolError(
                f"Error: {path} is a binary file (not UTF-8 text); the editor only edits text"
                " files."
            ) from None

    async def _write(self, path: str, text: str) -> None:
        result = await self._sandbox.run(
            _WRITE,
            timeout_s=60.0,
            env={**self._env, _PATH_ENV: path},
            cwd=self._workdir,
            stdin=text.encode("utf-8"),
        )
        if result.exit_code != 0:
            detail = result.output.decode(errors="replace").strip()[:500]
            raise ToolError(f"Error: could not write {path}: {detail or result.exit_code}")

    async def _exists(self, path: str) -> bool:
        result = await self._sandbox.run(
            f'[ -e "${_PATH_ENV}" ]',
            timeout_s=60.0,
            env={**self._env, _PATH_ENV: path},
            cwd=self._workdir,
        )
        return result.exit_code == 0

    async def _view(self, path: str, view_range: object) -> ToolOutcome:
        try:
            text = await self._text(path)
        except ToolError as err:
            if "is a directory" not in err.message:
                raise
            if view_range is not None:
                raise ToolError(
                    f"Error: {path} is a directory; view_range only applies to files."
                ) from None
            return await self._list(path)
        lines = text.split("\n")
        if text.endswith("\n"):
            lines.pop()
        first, last = 1, len(lines)
        if view_range is not None:
            if (
                not isinstance(view_range, list)
                or len(view_range) != 2
                or not all(isinstance(n, int) for n in view_range)
            ):
                raise ToolError("Error: view_range must be two integers [first, last].")
            first, last = view_range[0], view_range[1]
            if last == -1:
                last = len(lines)
            if not 1 <= first <= max(len(lines), 1):
                raise ToolError(
                    f"Error: view_range first line {first} is outside the file's lines"
                    f" 1..{len(lines)}."
                )
            if not first <= last <= len(lines):
                raise ToolError(
                    f"Error: view_range last line {last} must be between {first} and"
                    f" {len(lines)} (or -1 for the end)."
                )
        body = _numbered(lines[first - 1 : last], first)
        return ToolOutcome(f"Here is the result of running `cat -n` on {path}:\n{body}\n")

    async def _list(self, path: str) -> ToolOutcome:
        result = await self._sandbox.run(
            _LIST, timeout_s=60.0, env={**self._env, _PATH_ENV: path}, cwd=self._workdir
        )
        listing = result.stdout.decode(errors="replace")
        return ToolOutcome(
            f"Files and directories in {path}, up to 2 levels deep (hidden ones left out):\n"
            f"{listing}"
        )

    async def _create(self, path: str, file_text: str) -> ToolOutcome:
        if await self._exists(path):
            raise ToolError(
                f"Error: {path} already exists; `create` does not overwrite files. Use"
                " str_replace or insert to change it."
            )
        await self._write(path, file_text)
        return ToolOutcome(f"File created successfully at: {path}")

    async def _str_replace(self, path: str, old: str, new: str) -> ToolOutcome:
        if not old:
            raise ToolError("Error: old_str is empty; give the exact text to replace.")
        text = await self._text(path)
        count = text.count(old)
        if count == 0:
            raise ToolError(
                f"Error: no replacement was made: old_str did not appear verbatim in {path}."
            )
        if count > 1:
            starts, at = [], text.find(old)
            while at != -1:
                starts.append(text.count("\n", 0, at) + 1)
                at = text.find(old, at + 1)
            raise ToolError(
                f"Error: no replacement was made: old_str occurs {count} times in {path}"
                f" (lines {', '.join(map(str, starts))}); include more context to make it unique."
            )
        at = text.index(old)
        edited = text[:at] + new + text[at + len(old) :]
        await self._write(path, edited)
        first = text.count("\n", 0, at) + 1
        return ToolOutcome(
            f"The file {path} has been edited. Here is the result of running `cat -n` on a"
            f" snippet of {path}:\n{_snippet(edited, first, new.count(chr(10)) + 1)}\n"
            "Review the changes and make sure they are as expected."
        )

    async def _insert(self, path: str, insert_line: int, new: str) -> ToolOutcome:
        text = await self._text(path)
        lines = text.split("\n")
        n_lines = len(lines) - 1 if text.endswith("\n") else len(lines)
        if not 0 <= insert_line <= n_lines:
            raise ToolError(
                f"Error: insert_line {insert_line} is outside the file's lines: it must be"
                f" between 0 and {n_lines}."
            )
        added = new.split("\n")
        if new.endswith("\n"):
            added.pop()
        edited = "\n".join(lines[:insert_line] + added + lines[insert_line:])
        await self._write(path, edited)
        return ToolOutcome(
            f"The file {path} has been edited. Here is the result of running `cat -n` on a"
            f" snippet of the edited file:\n{_snippet(edited, insert_line + 1, len(added))}\n"
            "Review the changes and make sure they are as expected."
        )


def _numbered(lines: list[str], first: int) -> str:
    return "\n".join(f"{number:6}\t{line}" for number, line in enumerate(lines, first))


def _snippet(text: str, first: int, count: int) -> str:
    lines = text.split("\n")
    start = max(1, first - _SNIPPET_LINES)
    stop = min(len(lines), first + count - 1 + _SNIPPET_LINES)
    return _numbered(lines[start - 1 : stop], start)
