"""The board of running episodes (ListEpisodes): episode id, instance, turns, phase and elapsed
time of each, read from the runner's live episodes without touching them.

The phase comes from what the episode already keeps: no messages yet means the lease is still
being acquired; then the last message says whose move it is (an observation or the instance:
the policy's; a response: the command's); a final status means the loop ended and the patch is
being taken and graded.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass

from swerl.agent.episode import Episode
from swerl.agent.v1 import agent_pb2 as pb
from swerl.chassis.timeconv import duration_pb


@dataclass(frozen=True)
class BoardRow:
    episode_id: str
    instance_id: str
    turns: int
    phase: int  # pb.EpisodePhase
    elapsed_s: float
    owner: str


def phase_of(episode: Episode) -> int:
    if episode.status is not None:
        return pb.EPISODE_PHASE_EVALUATION
    if not episode.messages:
        return pb.EPISODE_PHASE_LEASE
    if episode.messages[-1]["role"] == "assistant":
        return pb.EPISODE_PHASE_COMMAND
    return pb.EPISODE_PHASE_POLICY


def board(episodes: Iterable[Episode]) -> list[BoardRow]:
    now = time.monotonic()
    rows = [
        BoardRow(
            episode_id=e.spec.episode_id,
            instance_id=e.spec.instance.instance_id,
            turns=e.turns,
            phase=phase_of(e),
            elapsed_s=now - e.clock.started,
            owner=e.spec.owner,
        )
        for e in episodes
    ]
    rows.sort(key=lambda row: -row.elapsed_s)
    return rows


def list_episodes_response(episodes: Iterable[Episode]) -> pb.ListEpisodesResponse:
    return pb.ListEpisodesResponse(
        episodes=[
            pb.RunningEpisode(
                episode_id=row.episode_id,
                instance_id=row.instance_id,
                turns=row.turns,
                phase=pb.EpisodePhase.ValueType(row.phase),
                elapsed_duration=duration_pb(row.elapsed_s),
                owner=row.owner,
            )
            for row in board(episodes)
        ]
    )
