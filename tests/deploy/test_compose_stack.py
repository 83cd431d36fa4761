"""deploy/compose.yaml brought up for real on the local dockerd: the image builds offline from
the wheelhouse, every service comes up healthy, and one demo episode (a bundled task, the replay
policy, PRM judging by the scripted judge) runs through agent -> pool -> exec node -> Evaluate.

Slow by nature (an image build and six containers on a small machine); it leaves no container,
network or volume behind.
"""

from __future__ import annotations

import os
import socket
import subprocess
import time
import uuid
from pathlib import Path

import docker
import pytest

from swerl.agent.v1 import agent_pb2 as pb
from swerl.agent.v1 import agent_pb2_grpc
from swerl.chassis.client import make_channel
from swerl.chassis.timeconv import duration_pb
from swerl.tasks import build_images, default_tasks_dir, load_tasks
from swerl.validate import instance_to_pb

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
TOKEN = "compose-test-token"
TASK = "swerl-examples__romans-5"
TOKENIZER_IN_IMAGE = "/opt/swerl/models/qwen3-tokenizer"

pytestmark = pytest.mark.docker


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _run(command: list[str], env: dict[str, str], timeout: float) -> str:
    result = subprocess.run(
        command, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout
    )
    assert result.returncode == 0, f"{' '.join(command)}:\n{result.stdout}\n{result.stderr}"
    return result.stdout


@pytest.fixture
def compose_stack(tmp_path, base_image):
    if subprocess.run(["docker", "compose", "version"], capture_output=True).returncode != 0:
        _run(["bash", str(DEPLOY / "install-compose.sh")], dict(os.environ), 300)
    tasks = [t for t in load_tasks(default_tasks_dir()) if t.instance_id == TASK]
    build_images(tasks, base_image=base_image, progress=lambda line: None)

    suffix = uuid.uuid4().hex[:8]
    node_id = f"compose-test-{suffix}"
    ports = {name: _free_port() for name in ("EXEC", "POOL", "AGENT", "PRM", "POLICY")}
    env = {
        **os.environ,
        "SWERL_TOKEN": TOKEN,
        "SWERL_CAPABILITY_SECRET": uuid.uuid4().hex,
        "SWERL_STATE_DIR": str(tmp_path / "state"),
        "SWERL_EXEC_NODE_ID": node_id,
        "SWERL_BASE_IMAGE": base_image,
        **{f"SWERL_{name}_PORT": str(port) for name, port in ports.items()},
    }
    compose = ["docker", "compose", "-f", str(DEPLOY / "compose.yaml"), "-p", f"swerl-{suffix}"]
    try:
        _run(["bash", str(DEPLOY / "build-wheelhouse.sh")], env, 600)
        _run([*compose, "build", "--quiet"], env, 600)
        _run([*compose, "up", "--detach", "--wait", "--wait-timeout", "240"], env, 300)
        yield f"127.0.0.1:{ports['AGENT']}", node_id
    finally:
        logs = subprocess.run(
            [*compose, "logs", "--no-color", "--tail", "30"],
            env=env,
            capture_output=True,
            text=True,
        )
        subprocess.run([*compose, "down", "--volumes", "--timeout", "10"], env=env, timeout=300)
        # Sandboxes are the node's containers, not compose's: a lease that was still held when
        # the node stopped leaves its sandbox to the reaper. Remove any of this node's.
        client = docker.from_env()
        try:
            leftovers = client.containers.list(all=True, filters={"label": f"swerl.node={node_id}"})
            for container in leftovers:
                container.remove(force=True)
        finally:
            client.close()
        if leftovers:
            print(logs.stdout[-5000:])


@pytest.mark.timeout(900)
async def test_one_demo_episode_runs_through_the_compose_stack(compose_stack):
    agent_address, node_id = compose_stack
    (task,) = [t for t in load_tasks(default_tasks_dir()) if t.instance_id == TASK]
    start = pb.EpisodeStart(
        episode_id=f"compose-{uuid.uuid4().hex[:8]}",
        instance=instance_to_pb(task.instance),
        policy=pb.PolicyConfig(endpoint="http://policy:30000", tokenizer_path=TOKENIZER_IN_IMAGE),
        limits=pb.EpisodeLimits(max_turns=8, eval_timeout=duration_pb(300)),
        prm=pb.PrmConfig(enabled=True, m=1),
        options=pb.EpisodeOptions(artifact_dir="/var/lib/swerl/artifacts", owner="compose-test"),
    )
    channel = make_channel(agent_address, token=TOKEN)
    kinds = []
    started = time.monotonic()
    try:
        stub = agent_pb2_grpc.AgentServiceStub(channel)
        call = stub.RunEpisode(iter([pb.RunEpisodeRequest(start=start)]), timeout=600)
        async for message in call:
            kinds.append(message.WhichOneof("kind"))
            if kinds[-1] == "started":
                assert message.started.node_id == node_id
            if kinds[-1] == "result":
                result = message.result
    finally:
        await channel.close()
    assert kinds[0] == "started" and kinds[-1] == "result" and "evaluation" in kinds
    assert result.status == pb.EPISODE_STATUS_SUBMITTED, result.error_message
    assert result.reward == 1.0
    assert result.artifact_dir.startswith("/var/lib/swerl/artifacts/")
    # The PRM service judged every turn through the scripted judge.
    assert result.step_scores
    assert all(s.state == pb.STEP_SCORE_STATE_SCORED for s in result.step_scores)
    print(f"episode through compose in {time.monotonic() - started:.1f} s")
    client = docker.from_env()
    try:
        # The episode's sandboxes (agent and evaluation) were released.
        assert client.containers.list(all=True, filters={"label": f"swerl.node={node_id}"}) == []
    finally:
        client.close()
