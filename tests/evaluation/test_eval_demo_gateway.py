"""`swerl eval`'s in-process agent serves the model gateway: a session opened on it (OpenSession)
answers the `openai` SDK in front of the replay policy with the real Qwen3 tokenizer, and
CloseSession returns the exact ids /generate saw. A remote agent (--agent) is left as it is."""

from __future__ import annotations

import argparse
from pathlib import Path

import openai
from google.protobuf import struct_pb2
from testkit.gateway import BASH_TOOL, KEY, SCRIPT, TOKENIZER

from swerl.agent.v1 import agent_pb2 as pb
from swerl.agent.v1 import agent_pb2_grpc
from swerl.chassis.client import make_channel
from swerl.devservers.replay import ReplayPolicyServer
from swerl.evaluation import cli


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cli.register(parser.add_subparsers())
    return parser.parse_args(["eval", "x", "-o", "out", *argv])


async def test_the_in_process_agent_of_swerl_eval_opens_gateway_sessions(capsys) -> None:
    replay = ReplayPolicyServer({KEY: SCRIPT}, keep_requests=True)
    url = await replay.start()
    try:
        # An agent in this process over a pool elsewhere (none needed: sessions lease nothing).
        async with cli._agent(_args("--pool", "127.0.0.1:9", "--token", "t")) as (address, token):
            assert "swerl eval: model gateway on http://127.0.0.1:" in capsys.readouterr().err
            channel = make_channel(address, token=token)
            stub = agent_pb2_grpc.AgentServiceStub(channel)
            params = struct_pb2.Struct()
            params.update({"max_new_tokens": 128})
            opened = await stub.OpenSession(
                pb.OpenSessionRequest(
                    policy=pb.PolicyConfig(
                        endpoint=url, tokenizer_path=TOKENIZER, sampling_params=params
                    ),
                    owner="eval",
                ),
                timeout=120,
            )
            async with openai.AsyncOpenAI(
                base_url=opened.openai_base_url, api_key=opened.secret
            ) as client:
                reply = await client.chat.completions.create(
                    model="m",
                    messages=[{"role": "user", "content": f"{KEY}: go"}],
                    tools=[BASH_TOOL],
                )
            assert reply.choices[0].message.tool_calls[0].function.name == "bash"
            closed = await stub.CloseSession(
                pb.CloseSessionRequest(session_id=opened.session_id, reward=0.0), timeout=120
            )
            await channel.close()
        sent, got = replay.stats.requests_seen[0]
        assert len(closed.records) == 1
        assert list(closed.records[0].prompt_ids) == sent
        assert list(closed.records[0].response_ids) == got
    finally:
        await replay.stop()


async def test_a_remote_agent_is_used_as_it_is(capsys) -> None:
    async with cli._agent(_args("--agent", "10.0.0.1:5", "--token", "t")) as (address, token):
        assert (address, token) == ("10.0.0.1:5", "t")
    assert "model gateway" not in capsys.readouterr().err


async def test_the_demo_tour_opens_a_session_forks_it_and_checks_its_chains(capsys) -> None:
    """`swerl demo`'s part 3 on an in-process agent with a gateway (as the demo starts it)."""
    import json

    from swerl.agent.server import local_agent
    from swerl.demo import GATEWAY_KEY, GATEWAY_SCRIPT, gateway_tour
    from swerl.web.runs import Run

    replay = ReplayPolicyServer({GATEWAY_KEY: GATEWAY_SCRIPT}, keep_requests=True)
    url = await replay.start()
    try:
        async with local_agent("127.0.0.1:9", "t", gateway_port=0, tokenizer_processes=0) as agent:
            channel = make_channel(agent.address, token="t")
            ok, report = await gateway_tour(
                agent_pb2_grpc.AgentServiceStub(channel),
                url,
                TOKENIZER,
                replay.stats.requests_seen,
            )
            await channel.close()
    finally:
        await replay.stop()
    assert ok, report
    assert "3 calls (root, extend, fork) -> 2 chains" in report and ": yes" in report
    folder = Path(report.split("swerl inspect ", 1)[1].strip())
    run = Run.open(folder)
    (summary,) = run.index
    assert summary.status == "CLOSED" and summary.reward == 1.0
    tree = run.detail(summary.key)["session"]
    assert [(r.index, r.kind, r.parent) for r in tree.rows] == [
        (0, "root", None),
        (1, "extend", 0),
        (2, "fork", 0),
    ]
    chains = json.loads((summary.artifact_dir / "tokens.json").read_text())["chains"]
    for chain, (sent, got) in zip(chains, replay.stats.requests_seen[1:], strict=True):
        assert chain["prompt_ids"] + chain["response_ids"] == sent + got
