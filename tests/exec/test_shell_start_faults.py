"""A container that dies while its shell is starting does not hold the shell for the start's
60 s bound: the node sees the shell's process end (Docker's record of it), starts the container
again and the command runs in it."""

from __future__ import annotations

import time

from swerl.exec.v1 import sandbox_pb2 as pb

# bash runs $BASH_ENV before the command of `bash -c`: in the shell's launcher (`bash -c 'exec
# bash --login -s <in >out 2>err'`), that is before it opens its FIFOs. A hook there that kills
# every process (and then waits, so that the launcher never gets to its FIFOs: it dies with the
# container) stops the container at that very moment. It fires in the launcher only (not in
# the node's side execs, also `bash -c`) and once (it removes its trigger), so the container
# then starts normally again.
HOOK = "/tmp/swerl-start-hook.sh"
ARM = f"""cat > {HOOK} <<'HOOK'
case "$BASH_EXECUTION_STRING" in
  *"--login -s"*) [ -e /tmp/swerl-armed ] && {{ rm -f /tmp/swerl-armed; kill -9 -1; sleep 30; }} ;;
esac
HOOK
touch /tmp/swerl-armed"""


async def test_a_container_that_dies_while_its_shell_starts_is_started_again_in_seconds(
    node, base_image
):
    sandbox = await node.create(base_image, workdir="/tmp", env={"BASH_ENV": HOOK})
    sid = sandbox.sandbox_id
    armed = await node.client.run(sid, ARM)
    assert armed.exit_code == 0, armed.stderr
    # Killing the supervisor makes the next command start a new shell: its launcher runs the
    # hook and the container dies under the starting shell.
    killed = await node.client.run(sid, "kill -9 $$; sleep 30")
    assert killed.exit_code == 137
    started = time.monotonic()
    after = await node.client.run(sid, "echo ok; ls /tmp/swerl-armed 2>&1", timeout_s=30)
    took = time.monotonic() - started
    assert after.exit_code != 0 and after.stdout.startswith(b"ok\n"), after  # the hook fired
    assert after.sandbox_restarted, after
    assert took < 15.0, f"the command waited {took:.1f} s for the dead container's shell"
    # Nothing is left waiting: the sandbox runs commands as before.
    again = await node.client.run(sid, "echo again")
    assert again.stdout == b"again\n" and not again.sandbox_restarted
    got = await node.stub.GetSandbox(pb.GetSandboxRequest(sandbox_id=sid))
    assert got.sandbox.state == pb.SANDBOX_STATE_RUNNING
