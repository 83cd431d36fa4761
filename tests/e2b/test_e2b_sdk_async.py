"""The real E2B SDK (async) against `swerl e2b serve`, and slime's E2BSandbox call pattern
reproduced with the SDK only (slime is not imported)."""

from __future__ import annotations

import asyncio
import hashlib
import io
import os
import time

import pytest
from e2b import AsyncSandbox, CommandExitException, SandboxQuery
from e2b.exceptions import NotFoundException
from testkit.e2b import IMAGE_KEY, Face

pytestmark = pytest.mark.docker


async def test_the_async_sdk_runs_streams_backgrounds_and_keeps_files(face: Face, base_image: str):
    sandbox = await AsyncSandbox.create(
        base_image, timeout=120, metadata={"suite": "async"}, **face.opts
    )
    try:
        assert (await sandbox.commands.run("echo hi")).stdout == "hi\n"

        seen: list[str] = []
        result = await sandbox.commands.run(
            "for i in 1 2 3; do echo n$i; sleep 0.2; done", on_stdout=seen.append
        )
        assert "".join(seen) == result.stdout == "n1\nn2\nn3\n"

        handle = await sandbox.commands.run("sleep 0.3; echo bg", background=True)
        assert (await handle.wait()).stdout == "bg\n"

        sleeper = await sandbox.commands.run("sleep 60", background=True)
        assert await sleeper.kill() is True
        with pytest.raises(CommandExitException):
            await sleeper.wait()

        blob = os.urandom(1 << 20)
        await sandbox.files.write("/tmp/a/blob.bin", blob)
        assert bytes(await sandbox.files.read("/tmp/a/blob.bin", format="bytes")) == blob
        assert [e.name for e in await sandbox.files.list("/tmp/a")] == ["blob.bin"]

        await sandbox.set_timeout(90)
        info = await sandbox.get_info()
        assert 80 < info.end_at.timestamp() - time.time() <= 91
        paginator = AsyncSandbox.list(query=SandboxQuery(metadata={"suite": "async"}), **face.opts)
        assert [s.sandbox_id for s in await paginator.next_items()] == [sandbox.sandbox_id]
    finally:
        await sandbox.kill()
    with pytest.raises(NotFoundException):
        await sandbox.get_info()
    await asyncio.to_thread(face.assert_nothing_left)


async def test_slimes_e2b_sandbox_call_pattern(face: Face, base_image: str):
    # slime's E2BSandbox: the image under a metadata key, the default template, a lifetime.
    sandbox = await AsyncSandbox.create(timeout=3600, metadata={IMAGE_KEY: base_image}, **face.opts)
    try:

        async def exec_(cmd: str, *, user: str = "root", env=None, timeout: int = 120):
            try:
                res = await sandbox.commands.run(
                    cmd,
                    user=user,
                    envs=env,
                    timeout=timeout,
                    on_stdout=lambda s: None,
                    on_stderr=lambda s: None,
                )
                return res.exit_code, res.stdout or "", res.stderr or ""
            except CommandExitException as e:
                return e.exit_code, e.stdout or "", e.stderr or ""

        assert await exec_("id -un") == (0, "root\n", "")
        assert await exec_('echo "$TASK"', env={"TASK": "t-1"}) == (0, "t-1\n", "")
        code, _, _ = await exec_(
            "id agent >/dev/null 2>&1 || useradd -m -s /bin/bash agent && mkdir -p /work"
            " && chown -R agent:agent /work && id agent",
            timeout=60,
        )
        assert code == 0
        assert await exec_("id -un; pwd", user="agent") == (0, "agent\n/\n", "")
        assert (await exec_("exit 7"))[0] == 7

        # A detached command, polled through a marker file.
        await exec_("nohup bash -c 'sleep 1; echo finished > /work/marker' >/dev/null 2>&1 &")
        deadline = time.monotonic() + 30
        while (await exec_("test -f /work/marker"))[0] != 0:
            assert time.monotonic() < deadline, "the detached command never wrote its marker"
            await asyncio.sleep(0.2)
        assert await sandbox.files.read("/work/marker", user="root") == "finished\n"

        payload = os.urandom(300_000)
        await sandbox.files.write(
            "/work/upload.bin",
            io.BytesIO(payload),
            user="root",
            gzip=False,
            use_octet_stream=True,
            request_timeout=600,
        )
        await sandbox.files.write("/work/patch.diff", "--- a\n+++ b\n", user="agent")
        assert await sandbox.files.read("/work/patch.diff", user="root") == "--- a\n+++ b\n"
        assert (await exec_("stat -c %U /work/patch.diff"))[1] == "agent\n"
        assert (await exec_("sha256sum < /work/upload.bin | cut -c1-16"))[1].strip() == (
            hashlib.sha256(payload).hexdigest()[:16]
        )
    finally:
        await sandbox.kill()
    await asyncio.to_thread(face.assert_nothing_left)
