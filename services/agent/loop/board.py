"""The board of ListEpisodes: the running episodes (episode id, instance, turns, phase, elapsed
time), read from the runner's live episodes without touching them, and the last episodes that
ended, as their results passed through the service.

The phase comes from what the episode already keeps: no messages yet means the lease is still
being acquired; then the last message says whose move it is (an observation or the instance:
the policy's; a response: the command's); a final status means the loop ended and the patch is
being taken and graded.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from swerl.agent.loop.episode import Episode
from swerl.agent.v1 import agent_pb2 as pb
from swerl.chassis.timeconv import duration_pb

FINISHED_KEPT = 256


@dataclass(frozen=True)
class BoardRow:
    episode_id: str
    instance_id: str
    turns: int
    phase: pb.EpisodePhase
    elapsed_s: float
    owner: str


def phase_of(episode: Episode) -> pb.EpisodePhase:
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


class FinishedEpisodes:
    """The last FINISHED_KEPT episode results, reduced to what the board shows."""

    def __init__(self) -> None:
        self._ended: deque[pb.FinishedEpisode] = deque(maxlen=FINISHED_KEPT)

    def record(self, result: pb.EpisodeResult) -> None:
        ended = pb.FinishedEpisode(episode_id=result.episode_id, status=result.status)
        if result.HasField("reward"):
            ended.reward = result.reward
        ended.end_time.GetCurrentTime()
        self._ended.append(ended)

    def __iter__(self) -> Iterator[pb.FinishedEpisode]:
        return iter(list(self._ended))


def list_episodes_response(
    episodes: Iterable[Episode], finished: Iterable[pb.FinishedEpisode] = ()
) -> pb.ListEpisodesResponse:
    return pb.ListEpisodesResponse(
        finished=list(finished),
        episodes=[
            pb.RunningEpisode(
                episode_id=row.episode_id,
                instance_id=row.instance_id,
                turns=row.turns,
                phase=row.phase,
                elapsed_duration=duration_pb(row.elapsed_s),
                owner=row.owner,
            )
            for row in board(episodes)
        ],
    )
