"""GetDiff on real git repositories inside a sandbox."""

from __future__ import annotations

import asyncio

import grpc
from testkit.exec import RPC_TIMEOUT_S, ExecStream, assert_status, rpc_error

from swerl.exec.client import exec_start
from swerl.exec.v1 import sandbox_pb2 as pb

REPO = "/tmp/repo"
MAKE_REPO = f"""
set -e
mkdir -p {REPO} && cd {REPO}
git init -q
git config user.email agent@example.com && git config user.name agent
printf 'one\\ntwo\\n' > tracked.txt
printf 'keep\\n' > staged.txt
printf 'gone\\n' > deleted.txt
git add . && git commit -qm base
printf 'one\\nTWO\\nthree\\n' > tracked.txt
rm deleted.txt
printf 'new file\\n' > untracked.txt
head -c 4096 /dev/urandom > blob.bin
printf 'ignored.log\\n' > .git/info/exclude && echo noise > ignored.log
echo 'staged change' >> staged.txt && git add staged.txt
"""
STATUS = f"git -C {REPO} status --porcelain=v1 -uall; git -C {REPO} diff --cached --stat"


async def _diff(node, sandbox_id: str, **fields) -> pb.GetDiffResponse:
    request = pb.GetDiffRequest(sandbox_id=sandbox_id, **fields)
    return await node.stub.GetDiff(request, timeout=RPC_TIMEOUT_S)


async def _write_file(node, sandbox_id: str, path: str, data: bytes) -> None:
    stream = ExecStream(node.stub, exec_start(sandbox_id, f"cat > {path}", open_stdin=True))
    stream.send_stdin(data, close=True)
    result = await asyncio.wait_for(stream.result(), 30)
    assert result.exit_code == 0, result.stderr


async def test_diff_patch_applies_to_the_base_and_leaves_the_agent_index_alone(node, sandbox):
    sid = sandbox.sandbox_id
    made = await node.client.run(sid, MAKE_REPO)
    assert made.exit_code == 0, made.stderr
    head = (await node.client.run(sid, f"git -C {REPO} rev-parse HEAD")).stdout.strip().decode()
    before = await node.client.run(sid, STATUS)

    diff = await _diff(node, sid, path=REPO, include_untracked=True)

    after = await node.client.run(sid, STATUS)
    assert after.stdout == before.stdout
    assert diff.base_commit == head
    assert set(diff.files) == {
        "tracked.txt",
        "staged.txt",
        "deleted.txt",
        "untracked.txt",
        "blob.bin",
    }
    assert b"GIT binary patch" in diff.patch

    await _write_file(node, sid, "/tmp/agent.patch", diff.patch)
    applied = await node.client.run(
        sid,
        f"set -e; git clone -q {REPO} /tmp/clone && cd /tmp/clone && git checkout -q {head}\n"
        "git apply --check /tmp/agent.patch && git apply /tmp/agent.patch\n"
        f"diff -r --exclude=.git --exclude=ignored.log {REPO} /tmp/clone && echo SAME",
    )
    assert applied.exit_code == 0, applied.stderr
    assert applied.stdout.endswith(b"SAME\n")


async def test_diff_without_untracked_lists_only_tracked_changes(node, sandbox):
    sid = sandbox.sandbox_id
    made = await node.client.run(sid, MAKE_REPO)
    assert made.exit_code == 0, made.stderr
    diff = await _diff(node, sid, path=REPO)
    assert set(diff.files) == {"tracked.txt", "staged.txt", "deleted.txt"}
    assert b"untracked.txt" not in diff.patch


async def test_diff_of_a_clean_repository_is_empty(node, sandbox):
    sid = sandbox.sandbox_id
    made = await node.client.run(
        sid,
        f"set -e; mkdir {REPO}; cd {REPO}; git init -q; echo x > f;"
        " git -c user.email=a@b -c user.name=a add f;"
        " git -c user.email=a@b -c user.name=a commit -qm c",
    )
    assert made.exit_code == 0, made.stderr
    diff = await _diff(node, sid, path=REPO, include_untracked=True)
    assert (diff.patch, list(diff.files)) == (b"", [])


async def test_diff_outside_a_git_repository_is_failed_precondition(node, sandbox):
    sid = sandbox.sandbox_id
    for path in ("", "/tmp", "/does/not/exist"):  # "" is the sandbox workdir, /tmp
        err = await rpc_error(_diff(node, sid, path=path))
        assert_status(err, grpc.StatusCode.FAILED_PRECONDITION, "NOT_A_GIT_REPOSITORY")


async def test_diff_against_an_unknown_base_ref_is_failed_precondition(node, sandbox):
    sid = sandbox.sandbox_id
    made = await node.client.run(sid, MAKE_REPO)
    assert made.exit_code == 0, made.stderr
    err = await rpc_error(_diff(node, sid, path=REPO, base_ref="no-such-branch"))
    assert_status(err, grpc.StatusCode.FAILED_PRECONDITION, "UNKNOWN_BASE_REF")
