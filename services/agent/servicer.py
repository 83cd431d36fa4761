"""AgentService: RunEpisode's request stream in, the runner's messages out."""

from __future__ import annotations

from collections.abc import AsyncIterator

from swerl.agent.gateway.wire import SessionRpcs
from swerl.agent.loop.board import FinishedEpisodes, list_episodes_response
from swerl.agent.loop.runner import EpisodeRunner
from swerl.agent.v1 import agent_pb2 as pb
from swerl.agent.v1 import agent_pb2_grpc


class AgentServicer(agent_pb2_grpc.AgentServiceServicer):
    def __init__(self, runner: EpisodeRunner, sessions: SessionRpcs | None = None) -> None:
        self._runner = runner
        self._finished = FinishedEpisodes()
        self._sessions = sessions or SessionRpcs(None)

    async def RunEpisode(
        self, request_iterator: AsyncIterator[pb.RunEpisodeRequest], context
    ) -> AsyncIterator[pb.RunEpisodeResponse]:
        async for response in self._runner.stream(request_iterator):
            if response.HasField("result"):
                self._finished.record(response.result)
            yield response

    async def ListEpisodes(
        self, request: pb.ListEpisodesRequest, context
    ) -> pb.ListEpisodesResponse:
        return list_episodes_response(list(self._runner.running.values()), self._finished)

    async def OpenSession(self, request: pb.OpenSessionRequest, context) -> pb.OpenSessionResponse:
        return await self._sessions.open(request)

    async def GetSession(self, request: pb.GetSessionRequest, context) -> pb.GetSessionResponse:
        return self._sessions.get(request)

    async def CloseSession(
        self, request: pb.CloseSessionRequest, context
    ) -> pb.CloseSessionResponse:
        return await self._sessions.close(request)
