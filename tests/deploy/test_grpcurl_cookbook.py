"""docs/grpcurl.md's pool, agent and PRM recipes, run with the real grpcurl against real services
(the exec node's recipes are tested in tests/exec/test_grpcurl.py)."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from swerl.agent.server import local_agent
from swerl.chassis.hf import bundled_qwen3_tokenizer_dir
from swerl.devservers.replay import ReplayPolicyServer, scripts_for_tasks
from swerl.devservers.scripted_prm import ScriptedJudge, verdict
from swerl.prm.server import PrmServer
from swerl.prm.settings import PrmSettings
from swerl.stack import local_stack
from swerl.tasks import build_images, default_tasks_dir, load_tasks

REPO = Path(__file__).resolve().parents[2]
TASK = "swerl-examples__romans-5"
pytestmark = pytest.mark.docker


@pytest.fixture(scope="module")
def grpcurl_bin(tmp_path_factory) -> str:
    found = shutil.which("grpcurl")
    if found:
        return found
    bin_dir = tmp_path_factory.mktemp("grpcurl")
    subprocess.run(
        ["bash", str(REPO / "scripts" / "install-grpcurl.sh")],
        env={**os.environ, "GRPCURL_BIN_DIR": str(bin_dir)},
        check=True,
        capture_output=True,
        timeout=300,
    )
    return str(bin_dir / "grpcurl")


@pytest.fixture(scope="module")
def task(base_image):
    (found,) = [t for t in load_tasks(default_tasks_dir()) if t.instance_id == TASK]
    build_images([found], base_image=base_image, progress=lambda line: None)
    return found


def _messages(text: str) -> list[dict[str, Any]]:
    decoder, pos, out = json.JSONDecoder(), 0, []
    while True:
        while pos < len(text) and text[pos].isspace():
            pos += 1
        if pos == len(text):
            return out
        message, pos = decoder.raw_decode(text, pos)
        out.append(message)


class Curl:
    def __init__(self, binary: str, token: str) -> None:
        self.binary, self.token = binary, token

    async def __call__(self, address: str, method: str, body: Any = None, *flags: str) -> list:
        argv = [self.binary, "-plaintext", "-H", f"authorization: Bearer {self.token}", *flags]
        stdin = None
        if body is not None:
            argv += ["-d", "@"]
            bodies = body if isinstance(body, list) else [body]
            stdin = "\n".join(json.dumps(b) for b in bodies)
        argv += [address, *method.split()]
        done = await asyncio.to_thread(
            subprocess.run, argv, input=stdin, capture_output=True, text=True, timeout=300
        )
        assert done.returncode == 0, f"{method}: {done.stderr}"
        return done.stdout if method.startswith(("list", "describe")) else _messages(done.stdout)


def _instance(task) -> dict:
    # As the cookbook builds it from instance.json.
    fields = {
        "instance_id",
        "repo",
        "version",
        "base_commit",
        "test_patch",
        "eval_script",
        "log_parser",
        "eval_type",
        "image_name",
        "problem_statement",
    }
    pb = {k: v for k, v in task.instance.items() if k in fields}
    pb["fail_to_pass"], pb["pass_to_pass"] = (
        task.instance["FAIL_TO_PASS"],
        task.instance["PASS_TO_PASS"],
    )
    return pb


async def test_pool_recipes_lease_exec_keepalive_release_and_node_admin(grpcurl_bin, task):
    async with local_stack(nodes=1, purpose="cookbook") as stack:
        curl = Curl(grpcurl_bin, stack.token)
        pool = stack.pool_address
        p = "swerl.pool.v1.PoolService"
        assert "swerl.pool.v1.PoolService" in await curl(pool, "list")
        (health,) = await curl(pool, "grpc.health.v1.Health/Check", {"service": p})
        assert health["status"] == "SERVING"

        (nodes,) = await curl(pool, f"{p}/ListNodes", {})
        (node,) = nodes["nodes"]
        assert node["state"] == "NODE_STATE_HEALTHY"

        (acquired,) = await curl(
            pool,
            f"{p}/AcquireLease",
            {
                "request_id": "lease-1",
                "image": task.image_name,
                "owner": "operator",
                "ttl": "300s",
                "wait_timeout": "30s",
            },
        )
        lease = acquired["lease"]
        assert lease["lease_id"] and lease["sandbox_id"] and lease["token"]
        assert lease["node_address"] == node["address"]

        exec_curl = Curl(grpcurl_bin, stack.token)
        messages = await exec_curl(
            lease["node_address"],
            "swerl.exec.v1.SandboxService/Exec",
            {"start": {"sandbox_id": lease["sandbox_id"], "command": "ls /testbed"}},
            "-H",
            f"swerl-lease-token: {lease['token']}",
        )
        assert messages[-1]["exit"].get("exit_code", 0) == 0

        keepalive = await curl(
            pool,
            f"{p}/KeepAlive",
            [
                {"watch": {"lease_id": lease["lease_id"]}},
                {"renew": {"lease_id": lease["lease_id"], "ttl": "300s"}},
            ],
        )
        assert any(lease["lease_id"] in json.dumps(m) for m in keepalive)

        (listed,) = await curl(pool, f"{p}/ListLeases", {"states": ["LEASE_STATE_ACTIVE"]})
        assert [x["lease_id"] for x in listed["leases"]] == [lease["lease_id"]]
        (owned,) = await curl(pool, f"{p}/ListLeases", {"owner": "operator"})
        assert len(owned["leases"]) == 1

        (released,) = await curl(
            pool, f"{p}/ReleaseLease", {"request_id": "rel-1", "lease_id": lease["lease_id"]}
        )
        assert released["existed"] is True

        await curl(
            pool,
            f"{p}/Prewarm",
            {"request_id": "warm-1", "image": task.image_name, "count": 0},
        )
        (drained,) = await curl(
            pool, f"{p}/DrainNode", {"request_id": "drain-1", "node_id": node["node_id"]}
        )
        assert drained["node"]["state"] in ("NODE_STATE_DRAINING", "NODE_STATE_DRAINED")
        (registered,) = await curl(
            pool,
            f"{p}/RegisterNode",
            {"request_id": "reg-1", "node_id": node["node_id"], "address": node["address"]},
        )
        assert registered["node"]["state"] not in ("NODE_STATE_DRAINING", "NODE_STATE_DRAINED")


async def test_agent_and_prm_recipes_run_an_episode_and_judge_a_step(grpcurl_bin, task):
    replay = ReplayPolicyServer(scripts_for_tasks([task], "gold"))
    url = await replay.start()
    judge = ScriptedJudge(bundled_qwen3_tokenizer_dir(), default=[verdict(1)])
    judge_port = await judge.start()
    try:
        async with local_stack(nodes=1, purpose="cookbook-agent") as stack:
            prm = PrmServer(
                PrmSettings(
                    host="127.0.0.1",
                    port=0,
                    auth_token=stack.token,
                    judge_url=f"http://127.0.0.1:{judge_port}",
                    judge_tokenizer_path=bundled_qwen3_tokenizer_dir(),
                    log_level="warning",
                )
            )
            await prm.start()
            try:
                curl = Curl(grpcurl_bin, stack.token)
                (judged,) = await curl(
                    prm.address,
                    "swerl.prm.v1.PrmService/JudgeStep",
                    {
                        "request_id": "judge-1",
                        "episode_id": "ep-1",
                        "step_index": 0,
                        "issue": "to_roman(4) returns IIII",
                        "step": {
                            "response": "Let me look.\n```bash\ncat romans/convert.py\n```",
                            "action": "cat romans/convert.py",
                            "exit_code": 0,
                            "output": "_GREEDY = [...]",
                        },
                        "m": 3,
                        "seed": 7,
                    },
                )
                assert judged["state"] == "JUDGE_STATE_SCORED" and judged["score"] == 1
                async with local_agent(stack.pool_address, stack.token) as agent:
                    start = {
                        "start": {
                            "episode_id": "ep-1",
                            "instance": _instance(task),
                            "policy": {
                                "endpoint": url,
                                "api": "POLICY_API_SGLANG_GENERATE",
                                "tokenizer_path": str(bundled_qwen3_tokenizer_dir()),
                                "sampling_params": {"temperature": 0.0, "max_new_tokens": 1024},
                            },
                            "limits": {"max_turns": 20, "max_context_tokens": 32768},
                        }
                    }
                    messages = await curl(
                        agent.address,
                        "swerl.agent.v1.AgentService/RunEpisode",
                        start,
                        "-max-time",
                        "600",
                        "-max-msg-sz",
                        str(256 << 20),
                    )
            finally:
                await prm.stop(0)
    finally:
        await judge.stop()
        await replay.stop()
    kinds = [next(iter(m)) for m in messages]
    assert kinds[0] == "started" and kinds[-1] == "result"
    result = messages[-1]["result"]
    assert result["status"] == "EPISODE_STATUS_SUBMITTED" and result["reward"] == 1
