"""Whatever a command kills or stops inside its sandbox, its call ends by its timeout + 1 s with an
exit status that says what happened, and the next command runs (issue 15, items 1 and 2). A
command that kills every process stops the container (docker-init ends with its child): the node
starts it again, files, id, lease and token kept, and says so on the next exit. Only a container
that cannot be started again is lost, with a reason that says why."""

from __future__ import annotations

import asyncio
import time

import docker
import grpc
import pytest
from testkit.exec import RPC_TIMEOUT_S, assert_status, rpc_error

from swerl.chassis import capability
from swerl.exec.client import ExecResult
from swerl.exec.v1 import sandbox_pb2 as pb

# The call of a command that did anything below must end by its timeout plus this.
MARGIN_S = 1.0
TIMEOUT_S = 5.0
MODES = pytest.mark.parametrize("session", [False, True], ids=["isolated", "session"])
# The command's own shell is the worker bash that evals it ($BASHPID); $$ is the supervisor
# that forked the worker (the shell "running" it); `kill -1` reaches every process but init and
# the caller. A command goes on after its kill here, so it is still running when what it killed
# is gone (for one that ends in the same instant, see the last test of this group).
ENDS_AT_ONCE = {
    "sigkill-own-shell": ("kill -9 $BASHPID", 137),
    "sigkill-own-shell-from-a-child": ("sh -c 'kill -9 $PPID'; sleep 30", 137),
    "sigkill-the-supervisor": ("kill -9 $$; sleep 30", 137),
    "sigkill-the-parent": ("kill -9 $(cut -d' ' -f4 /proc/$BASHPID/stat); sleep 30", 137),
    "sigkill-every-process": ("kill -9 -1; sleep 30", 137),
    "sigkill-every-process-from-a-child": ("sh -c 'kill -9 -1'; sleep 30", 137),
    "sigstop-own-shell": ("kill -STOP $BASHPID", 147),
    "sigstop-the-supervisor": ("kill -STOP $$; echo after", 0),
    "sigstop-every-process": ("kill -STOP -1; echo after", 0),
    "sigstop-the-watchdog": ("kill -STOP $__swerl_wd; echo after", 0),
}
# Commands that disable what would end them at their timeout, then hang: the node steps in.
HANG_AFTER = {
    "sigkill-the-watchdog": "kill -9 $__swerl_wd",
    "sigstop-the-watchdog": "kill -STOP $__swerl_wd",
    "sigstop-the-supervisor": "kill -STOP $$",
    "sigstop-every-process": "kill -STOP -1",
}


async def _timed(node, sandbox_id: str, command: str, **kwargs) -> tuple[ExecResult, float]:
    started = time.monotonic()
    result = await node.client.run(sandbox_id, command, deadline_s=60.0, **kwargs)
    return result, time.monotonic() - started


async def _state(node, sandbox_id: str) -> pb.SandboxState:
    request = pb.GetSandboxRequest(sandbox_id=sandbox_id)
    return (await node.stub.GetSandbox(request, timeout=RPC_TIMEOUT_S)).sandbox.state


def _docker_running(sandbox_id: str) -> bool:
    client = docker.from_env()
    try:
        return bool(client.api.inspect_container(f"swerl-{sandbox_id}")["State"]["Running"])
    finally:
        client.close()


def _docker(sandbox_id: str, action: str) -> None:
    client = docker.from_env()
    try:
        container = client.containers.get(f"swerl-{sandbox_id}")
        if action == "kill":
            container.kill()
        else:
            container.remove(force=True)
    finally:
        client.close()


@MODES
@pytest.mark.parametrize("case", sorted(ENDS_AT_ONCE))
async def test_a_command_that_kills_or_stops_the_shell_machinery_ends_and_the_next_one_runs(
    node, sandbox, case, session
):
    # docs/shell-protocol.md: N10, N16, C5, C6
    command, exit_code = ENDS_AT_ONCE[case]
    sid = sandbox.sandbox_id
    result, took = await _timed(node, sid, command, timeout_s=TIMEOUT_S, session=session)
    assert took < TIMEOUT_S + MARGIN_S, took
    assert (result.exit_code, result.timed_out) == (exit_code, False), result
    after, took = await _timed(node, sid, "echo ok", timeout_s=TIMEOUT_S, session=session)
    assert (after.exit_code, after.stdout, after.timed_out) == (0, b"ok\n", False)
    assert took < TIMEOUT_S + MARGIN_S
    # Only killing every process stops the container; the next command starts it again.
    assert after.sandbox_restarted == case.startswith("sigkill-every-process")
    assert await _state(node, sid) == pb.SANDBOX_STATE_RUNNING


@MODES
@pytest.mark.parametrize("command", ["kill -9 $$", "kill -9 -1"], ids=["supervisor", "every"])
async def test_a_command_that_ends_as_it_kills_the_supervisor_is_never_a_timeout(
    node, sandbox, command, session
):
    # docs/shell-protocol.md: N8, N10. Whether its own end (0) got out before the supervisor
    # died is a race inside the container; either way the call ends at once, is no timeout, and
    # the next command runs (on the container started again when every process was killed).
    sid = sandbox.sandbox_id
    result, took = await _timed(node, sid, command, timeout_s=TIMEOUT_S, session=session)
    assert took < TIMEOUT_S + MARGIN_S
    assert result.exit_code in (0, 137) and not result.timed_out, result
    after = await node.client.run(sid, "echo ok", timeout_s=TIMEOUT_S, session=session)
    assert (after.exit_code, after.stdout) == (0, b"ok\n")
    assert after.sandbox_restarted == (command == "kill -9 -1")


# Bare commands whose status once depended on timing (issue 24): killing the supervisor or every
# process ends 137 in both modes, as the supervisor's end says (the command's own W no longer
# races it out), and stopping the supervisor (`$$` is the supervisor in a command, whose own
# shell is a subshell) does not stop the command: its exit trap continues the supervisor and the
# command ends with its own status, 0.
BARE = {
    "sigkill-every-process": ("kill -9 -1", 137),
    "sigkill-the-supervisor": ("kill -9 $$", 137),
    "sigstop-the-supervisor": ("kill -STOP $$", 0),
}


@MODES
@pytest.mark.parametrize("case", sorted(BARE))
async def test_a_bare_kill_or_stop_of_the_machinery_ends_with_the_same_status_every_time(
    node, sandbox, case, session
):
    # docs/shell-protocol.md: C5, N10
    command, exit_code = BARE[case]
    sid = sandbox.sandbox_id
    for _ in range(3):
        result, took = await _timed(node, sid, command, timeout_s=TIMEOUT_S, session=session)
        assert took < TIMEOUT_S + MARGIN_S, took
        assert (result.exit_code, result.timed_out) == (exit_code, False), result
        after = await node.client.run(sid, "echo ok", timeout_s=TIMEOUT_S, session=session)
        assert (after.exit_code, after.stdout) == (0, b"ok\n")
        assert after.sandbox_restarted == (case == "sigkill-every-process")


@MODES
@pytest.mark.parametrize("case", sorted(HANG_AFTER))
async def test_a_command_that_disables_its_timeout_then_hangs_still_times_out_on_time(
    node, sandbox, case, session
):
    # docs/shell-protocol.md: N13, C6. After `kill -STOP -1` the supervisor continues the next
    # worker, and under load bash still reports that worker's stop for a moment (a stale 147):
    # C6 waits past it, or the next command's line went to a worker it had just killed.
    sid = sandbox.sandbox_id
    command = HANG_AFTER[case] + "; sleep 60"
    result, took = await _timed(node, sid, command, timeout_s=2.0, session=session)
    assert took < 2.0 + MARGIN_S, took
    assert (result.exit_code, result.timed_out) == (137, True), result
    for _ in range(2):  # the machinery the command broke is back for every later command
        after = await node.client.run(sid, "echo ok", timeout_s=TIMEOUT_S, session=session)
        assert (after.exit_code, after.stdout) == (0, b"ok\n")
    # ... the watchdog included: a plain hang times out inside the container again.
    hang, took = await _timed(node, sid, "sleep 60", timeout_s=1.0, session=session)
    assert (hang.exit_code, hang.timed_out) == (137, True)
    assert took < 1.0 + MARGIN_S


async def test_after_killing_every_process_files_session_lease_and_token_are_kept(
    node_factory, base_image
):
    # docs/shell-protocol.md: N16
    secret = "capability-secret"
    node = await node_factory(capability_secret=secret)
    sandbox = await node.create(base_image, workdir="/tmp", lease_id="lse-kept")
    sid = sandbox.sandbox_id
    token = capability.mint(
        secret.encode(), lease_id="lse-kept", sandbox_id=sid, expire_time=time.time() + 300
    )
    metadata = ((capability.LEASE_TOKEN_METADATA_KEY, token),)
    async with node.client.commands(sid, metadata=metadata) as shell:
        written = await shell.run("echo kept > /tmp/before && export KEPT=yes", session=True)
        assert written.exit_code == 0
        killer = await shell.run("kill -9 -1; sleep 30", timeout_s=TIMEOUT_S)
        assert (killer.exit_code, killer.timed_out, killer.signaled) == (137, False, False)
        after = await shell.run("cat /tmp/before; echo $KEPT", session=True)
        assert after.sandbox_restarted
        assert (after.exit_code, after.stdout) == (0, b"kept\nyes\n")
        # Said once: the command after that one ran on a sandbox nobody restarted.
        again = await shell.run("echo again")
        assert (again.stdout, again.sandbox_restarted) == (b"again\n", False)
    got = await node.stub.GetSandbox(pb.GetSandboxRequest(sandbox_id=sid), timeout=RPC_TIMEOUT_S)
    assert (got.sandbox.sandbox_id, got.sandbox.lease_id) == (sid, "lse-kept")
    assert got.sandbox.state == pb.SANDBOX_STATE_RUNNING
    listed = await node.stub.ListSandboxes(pb.ListSandboxesRequest(), timeout=RPC_TIMEOUT_S)
    assert [(s.sandbox_id, s.state) for s in listed.sandboxes] == [(sid, pb.SANDBOX_STATE_RUNNING)]


async def test_get_sandbox_tells_the_containers_real_state_until_a_command_starts_it_again(
    node, sandbox
):
    # docs/shell-protocol.md: N16
    sid = sandbox.sandbox_id
    assert (await node.client.run(sid, "echo up")).stdout == b"up\n"
    await asyncio.to_thread(_docker, sid, "kill")
    assert await _state(node, sid) == pb.SANDBOX_STATE_EXITED
    listed = await node.stub.ListSandboxes(pb.ListSandboxesRequest(), timeout=RPC_TIMEOUT_S)
    assert [s.state for s in listed.sandboxes] == [pb.SANDBOX_STATE_EXITED]
    after = await node.client.run(sid, "echo back")
    assert (after.stdout, after.sandbox_restarted) == (b"back\n", True)
    assert await _state(node, sid) == pb.SANDBOX_STATE_RUNNING
    assert await asyncio.to_thread(_docker_running, sid)


async def test_a_sandbox_that_cannot_start_again_is_lost_with_sandbox_not_running(node, sandbox):
    # docs/shell-protocol.md: N16. Without `sleep` the container's main process cannot run.
    sid = sandbox.sandbox_id
    killer, took = await _timed(
        node,
        sid,
        "rm -f /usr/bin/sleep /bin/sleep && kill -9 -1; while :; do :; done",
        timeout_s=TIMEOUT_S,
    )
    assert (killer.exit_code, killer.timed_out) == (137, False)
    assert took < TIMEOUT_S + MARGIN_S
    for _ in range(2):  # lost for good, and said at once the second time
        err = await rpc_error(node.client.run(sid, "ls"))
        assert_status(err, grpc.StatusCode.FAILED_PRECONDITION, "SANDBOX_NOT_RUNNING")
        assert "cannot be started again" in err.details()
    assert await _state(node, sid) == pb.SANDBOX_STATE_EXITED
    assert not await asyncio.to_thread(_docker_running, sid)


async def test_a_sandbox_whose_container_was_removed_is_lost_with_its_own_reason(node, sandbox):
    # docs/shell-protocol.md: N16
    sid = sandbox.sandbox_id
    assert (await node.client.run(sid, "echo up")).exit_code == 0
    await asyncio.to_thread(_docker, sid, "remove")
    err = await rpc_error(node.client.run(sid, "echo again"))
    assert_status(err, grpc.StatusCode.FAILED_PRECONDITION, "SANDBOX_CONTAINER_REMOVED")
    assert await _state(node, sid) == pb.SANDBOX_STATE_EXITED
    destroyed = await node.stub.DestroySandbox(
        pb.DestroySandboxRequest(sandbox_id=sid), timeout=RPC_TIMEOUT_S
    )
    assert destroyed.existed


async def test_a_container_that_keeps_stopping_is_not_started_again_forever(node, sandbox):
    # docs/shell-protocol.md: N16 (MAX_RESTARTS within RESTART_WINDOW_S)
    from swerl.exec.shell import MAX_RESTARTS

    sid = sandbox.sandbox_id
    killer = "kill -9 -1; sleep 30"
    for _ in range(MAX_RESTARTS):
        assert (await node.client.run(sid, killer, timeout_s=TIMEOUT_S)).exit_code == 137
        assert (await node.client.run(sid, "true")).sandbox_restarted
    assert (await node.client.run(sid, killer, timeout_s=TIMEOUT_S)).exit_code == 137
    err = await rpc_error(node.client.run(sid, "true"))
    assert_status(err, grpc.StatusCode.FAILED_PRECONDITION, "SANDBOX_NOT_RUNNING")
    assert f"stopped {MAX_RESTARTS} times" in err.details()


def _kill_every_process_inside(sandbox_id: str) -> None:
    """What a command's `kill -9 -1` does, from a process of Docker's own: no kill event."""
    client = docker.from_env()
    try:
        container = client.containers.get(f"swerl-{sandbox_id}")
        container.exec_run(["sh", "-c", "kill -9 -1"], detach=True)
    finally:
        client.close()


@pytest.mark.parametrize("how", ["docker-kills-it", "dockerd-down-meanwhile"])
async def test_a_container_docker_stops_as_it_is_started_again_is_stopped_not_lost(
    node, sandbox, monkeypatch, how
):
    # Issue 24: a command kills every process while dockerd restarts; the node's start of the
    # container again (right after the command's end, so that the next command finds it up)
    # meets dockerd stopping it (a restarting dockerd stops every container, and its record of
    # the kill goes with it). That is Docker's doing, not the command's: the sandbox is not
    # lost, and the next command starts the container again. Before, the sandbox was lost
    # (SANDBOX_NOT_RUNNING), and an agent blamed the policy for it (SANDBOX_BROKEN).
    sid = sandbox.sandbox_id
    backend = node.node.backend
    real_start = backend.start
    interfered: list[str] = []

    async def start_then_stopped(container_id: str) -> str:
        refused = await real_start(container_id)
        if not interfered:
            interfered.append(container_id)
            if how == "docker-kills-it":
                await asyncio.to_thread(_docker, sid, "kill")  # a kill Docker records
            else:  # seen down by the node's health check, then its containers stopped
                backend.mark_down("dockerd restarting (test)")
                backend.mark_up()
                await asyncio.to_thread(_kill_every_process_inside, sid)
        return refused

    monkeypatch.setattr(backend, "start", start_then_stopped)
    killer = await node.client.run(sid, "kill -9 -1; sleep 30", timeout_s=TIMEOUT_S)
    assert (killer.exit_code, killer.timed_out) == (137, False)
    after = await node.client.run(sid, "echo next")
    assert interfered
    assert (after.exit_code, after.stdout, after.sandbox_restarted) == (0, b"next\n", True)
    assert await _state(node, sid) == pb.SANDBOX_STATE_RUNNING


async def test_a_container_that_stops_by_itself_as_it_is_started_again_is_still_lost(
    node, sandbox, monkeypatch
):
    # The other side of the test above: with no sign of Docker (no kill it recorded, dockerd
    # never seen down), a container that dies right after its start is the sandbox's own
    # trouble, and the sandbox is lost as before.
    sid = sandbox.sandbox_id
    backend = node.node.backend
    real_start = backend.start

    async def start_then_dies(container_id: str) -> str:
        refused = await real_start(container_id)
        await asyncio.to_thread(_kill_every_process_inside, sid)
        return refused

    monkeypatch.setattr(backend, "start", start_then_dies)
    killer = await node.client.run(sid, "kill -9 -1; sleep 30", timeout_s=TIMEOUT_S)
    assert killer.exit_code == 137
    err = await rpc_error(node.client.run(sid, "echo next"))
    assert_status(err, grpc.StatusCode.FAILED_PRECONDITION, "SANDBOX_NOT_RUNNING")
    assert "stopped again right after a start" in err.details()
