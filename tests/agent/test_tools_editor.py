"""The `tools` protocol's tools on the real stack: real dockerd, pool and exec node. The editor
writes and reads exact bytes through the node (stdin and stdout of a command, never quoted into a
shell line), and each bad input gets the tool-error text the model sees."""

from __future__ import annotations

import contextlib
import os

import pytest

from swerl.agent.actions.tool_set import TOOLS, ToolBox
from swerl.agent.actions.toolcalls import CallIds, ToolCall, check_call
from swerl.agent.loop.sandbox import PoolSandboxProvider
from swerl.pool.client import PoolClient
from swerl.stack import local_stack

BASE_IMAGE = os.environ.get("SWERL_BASE_IMAGE", "swerl-base:bookworm")
pytestmark = pytest.mark.usefixtures("base_image")
WORKDIR = "/tmp/work"
_ids = CallIds(seed=1)


@contextlib.asynccontextmanager
async def toolbox():
    async with local_stack(nodes=1, max_sandboxes=2, purpose="tools-test") as stack:
        pool = PoolClient(stack.pool_address, token=stack.token)
        try:
            provider = PoolSandboxProvider(pool, lease_wait_s=60)
            async with provider.lease(
                BASE_IMAGE, owner="tools-test", instance_id="", request_id="tools", workdir=None
            ) as sandbox:

                async def render(code: int, output: str, timed_out: bool, restarted: bool) -> str:
                    return f"[{code}{' timeout' if timed_out else ''}]{output}"

                await sandbox.run(
                    f"mkdir -p {WORKDIR} && cd {WORKDIR} && git init -q",
                    timeout_s=30,
                    env={},
                    cwd="/",
                )
                yield (
                    ToolBox(
                        sandbox, workdir=WORKDIR, env={}, command_timeout_s=30, render_bash=render
                    ),
                    sandbox,
                )
        finally:
            await pool.close()


def call(name: str, **arguments) -> ToolCall:
    checked = check_call(ToolCall(_ids(), name, arguments, ""), list(TOOLS.values()))
    assert checked.ok, checked.error
    return checked


def edit(command: str, path: str, **arguments) -> ToolCall:
    return call("str_replace_editor", command=command, path=path, **arguments)


# Quotes, backslashes, $(...), a NUL-free but shell-hostile mix, CRLF and no final newline.
NASTY = "a = 'it''s' \"$(rm -rf /)\" `x` \\n \\\\ $HOME\r\nb = 1\t# é ✓\n\nlast line"


async def test_create_view_str_replace_and_insert_keep_exact_bytes():
    async with toolbox() as (box, sandbox):
        path = f"{WORKDIR}/pkg/nasty.py"
        created = await box.run(edit("create", path, file_text=NASTY))
        assert not created.error and created.text == f"File created successfully at: {path}"
        raw = await sandbox.run(f"cat {path}", timeout_s=10, env={}, cwd="/")
        assert raw.stdout == NASTY.encode()

        replaced = await box.run(edit("str_replace", path, old_str="b = 1", new_str="b = '$2'"))
        assert not replaced.error and "has been edited" in replaced.text
        inserted = await box.run(edit("insert", path, insert_line=0, new_str="# header\n"))
        assert not inserted.error
        raw = await sandbox.run(f"cat {path}", timeout_s=10, env={}, cwd="/")
        assert raw.stdout == ("# header\n" + NASTY.replace("b = 1", "b = '$2'")).encode()

        viewed = await box.run(edit("view", path, view_range=[2, 3]))
        assert viewed.text == (
            f"Here is the result of running `cat -n` on {path}:\n"
            "     2\ta = 'it''s' \"$(rm -rf /)\" `x` \\n \\\\ $HOME\r\n"
            "     3\tb = '$2'\t# é ✓\n"
        )
        whole = await box.run(edit("view", path, view_range=[5, -1]))
        assert whole.text.endswith("     5\tlast line\n")


async def test_view_of_a_directory_lists_its_files():
    async with toolbox() as (box, _):
        await box.run(edit("create", f"{WORKDIR}/src/m.py", file_text="x = 1\n"))
        listing = await box.run(edit("view", WORKDIR))
        assert not listing.error
        assert f"{WORKDIR}/src/m.py" in listing.text and "/.git" not in listing.text


async def test_bash_and_submit():
    async with toolbox() as (box, _):
        ran = await box.run(call("bash", command="echo hi; exit 3"))
        assert (ran.text, ran.exit_code, ran.error) == ("[3]hi\n", 3, False)
        slow = await box.run(call("bash", command="sleep 5", timeout=1))
        assert slow.timed_out and slow.text.startswith("[")
        await box.run(edit("create", f"{WORKDIR}/new.txt", file_text="new\n"))
        submitted = await box.run(call("submit"))
        assert not submitted.error and submitted.text == "Submitted."
        assert submitted.submission is not None and "+new" in submitted.submission


async def test_editor_bad_inputs_get_clear_tool_errors():
    async with toolbox() as (box, sandbox):
        path = f"{WORKDIR}/f.py"
        await box.run(edit("create", path, file_text="x = 1\ny = 2\nx = 1\n"))
        await sandbox.run(
            f"printf 'PNG\\000\\001' > {WORKDIR}/img.bin && printf '\\377\\376ab' > {WORKDIR}/l1",
            timeout_s=10,
            env={},
            cwd="/",
        )
        cases = [
            (
                edit("view", f"{WORKDIR}/missing.py"),
                f"Error: the path {WORKDIR}/missing.py does not exist.",
            ),
            (
                edit("str_replace", f"{WORKDIR}/missing.py", old_str="a", new_str="b"),
                f"Error: the path {WORKDIR}/missing.py does not exist.",
            ),
            (
                edit("str_replace", path, old_str="x = 1", new_str="x = 2"),
                f"Error: no replacement was made: old_str occurs 2 times in {path} (lines 1, 3);"
                " include more context to make it unique.",
            ),
            (
                edit("str_replace", path, old_str="z = 3", new_str=""),
                f"Error: no replacement was made: old_str did not appear verbatim in {path}.",
            ),
            (
                edit("str_replace", path, old_str="", new_str="q"),
                "Error: old_str is empty; give the exact text to replace.",
            ),
            (
                edit("view", f"{WORKDIR}/img.bin"),
                f"Error: {WORKDIR}/img.bin is a binary file; the editor only edits text files.",
            ),
            (
                edit("str_replace", f"{WORKDIR}/l1", old_str="ab", new_str="cd"),
                f"Error: {WORKDIR}/l1 is a binary file (not UTF-8 text); the editor only edits"
                " text files.",
            ),
            (
                edit("create", path, file_text="again"),
                f"Error: {path} already exists; `create` does not overwrite files. Use"
                " str_replace or insert to change it.",
            ),
            (
                edit("create", "rel/x.py", file_text=""),
                f"Error: the path 'rel/x.py' is not absolute; give the full path, e.g."
                f" {WORKDIR}/rel/x.py.",
            ),
            (
                edit("insert", path, insert_line=9, new_str="z"),
                "Error: insert_line 9 is outside the file's lines: it must be between 0 and 3.",
            ),
            (
                edit("view", path, view_range=[0, 2]),
                "Error: view_range first line 0 is outside the file's lines 1..3.",
            ),
            (
                edit("view", path, view_range=[2, 7]),
                "Error: view_range last line 7 must be between 2 and 3 (or -1 for the end).",
            ),
            (
                edit("view", path, view_range=[1]),
                "Error: view_range must be two integers [first, last].",
            ),
            (
                edit("view", WORKDIR, view_range=[1, 2]),
                f"Error: {WORKDIR} is a directory; view_range only applies to files.",
            ),
            (edit("create", path), "Error: `create` needs the parameter(s) file_text."),
            (
                edit("insert", path, new_str="z"),
                "Error: `insert` needs the parameter(s) insert_line.",
            ),
            (call("bash", command="  "), "Error: the command is empty."),
        ]
        for bad, expected in cases:
            outcome = await box.run(bad)
            assert outcome.error, expected
            assert outcome.text == expected
        # Nothing above changed the file.
        raw = await sandbox.run(f"cat {path}", timeout_s=10, env={}, cwd="/")
        assert raw.stdout == b"x = 1\ny = 2\nx = 1\n"
