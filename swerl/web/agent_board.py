"""The dashboard's reading of one agent: ListEpisodes, turned into plain rows."""

from __future__ import annotations

from typing import Any

import grpc

from swerl.agent.v1 import agent_pb2 as pb
from swerl.agent.v1 import agent_pb2_grpc


async def list_agent_episodes(
    channel: grpc.aio.Channel, timeout_s: float
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(running episodes, the last episodes that ended on the agent)."""
    stub = agent_pb2_grpc.AgentServiceStub(channel)
    response = await stub.ListEpisodes(pb.ListEpisodesRequest(), timeout=timeout_s)
    running = [
        {
            "episode_id": e.episode_id,
            "instance_id": e.instance_id,
            "turn": e.turns,
            "phase": pb.EpisodePhase.Name(e.phase).removeprefix("EPISODE_PHASE_"),
            "elapsed_s": round(e.elapsed_duration.ToMicroseconds() / 1e6, 1),
            "owner": e.owner,
        }
        for e in response.episodes
    ]
    finished = [
        {
            "episode_id": e.episode_id,
            "status": pb.EpisodeStatus.Name(e.status).removeprefix("EPISODE_STATUS_"),
            "reward": e.reward if e.HasField("reward") else None,
            "end_time": e.end_time.ToMicroseconds() / 1e6,
        }
        for e in response.finished
    ]
    return running, finished
