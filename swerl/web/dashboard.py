"""`swerl dashboard`: a read-only live view of one pool (nodes, leases, warm spares) and its
agents (episodes running), polled every few seconds and pushed to the page as JSON, which redraws
itself without reloading. The page asks for the services' bearer token before it shows anything.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import statistics
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import grpc
from aiohttp import web

from swerl.chassis.client import make_channel
from swerl.pool.v1 import pool_pb2, pool_pb2_grpc
from swerl.web.render import plotly_js_path, render

COOKIE = "swerl_dashboard"
HISTORY = 720  # polls kept for the charts (an hour at the default interval)
REWARD_WINDOW_S = 300.0  # the mean reward chart averages the episodes that ended this recently
_LEASE_STATES = [
    pool_pb2.LEASE_STATE_PENDING,
    pool_pb2.LEASE_STATE_PULLING,
    pool_pb2.LEASE_STATE_ACTIVE,
    pool_pb2.LEASE_STATE_RELEASING,
]


@dataclass
class DashboardConfig:
    pool: str
    agents: list[str] = field(default_factory=list)
    token: str = ""
    interval_s: float = 2.0
    rpc_timeout_s: float = 5.0


def _budget(used_bytes: int, budget_bytes: int) -> str:
    """A node's image disk budget as the table shows it ("-" where the node has none)."""
    if budget_bytes <= 0:
        return "-"
    gib = 1 << 30
    return f"{used_bytes / gib:.1f} / {budget_bytes / gib:.1f} GiB"


def _name(enum: Any, value: int, prefix: str) -> str:
    return str(enum.Name(value)).removeprefix(prefix)


def _age_s(ts: Any, now: float) -> float:
    return max(0.0, now - ts.ToMicroseconds() / 1e6) if ts.seconds else 0.0


class Poller:
    """Keeps the latest snapshot of the fleet and a short history for the charts."""

    def __init__(self, config: DashboardConfig) -> None:
        self.config = config
        self.snapshot: dict[str, Any] = {"ready": False}
        self.history: deque[dict[str, Any]] = deque(maxlen=HISTORY)
        self._seen_leases: set[str] = set()
        self._ended: deque[float] = deque()
        self._task: asyncio.Task[None] | None = None
        self._pool_channel = make_channel(config.pool, token=config.token or None)
        self._pool = pool_pb2_grpc.PoolServiceStub(self._pool_channel)
        self._agents = [
            (address, make_channel(address, token=config.token or None))
            for address in config.agents
        ]

    async def start(self) -> None:
        self._task = asyncio.create_task(self._loop())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self._pool_channel.close()
        for _, channel in self._agents:
            await channel.close()

    async def _loop(self) -> None:
        while True:
            await self.poll()
            await asyncio.sleep(self.config.interval_s)

    async def poll(self) -> None:
        now = time.time()
        snapshot: dict[str, Any] = {"ready": True, "time": now, "errors": []}
        timeout = self.config.rpc_timeout_s
        try:
            nodes = await self._pool.ListNodes(pool_pb2.ListNodesRequest(), timeout=timeout)
            leases = await self._pool.ListLeases(
                pool_pb2.ListLeasesRequest(states=_LEASE_STATES), timeout=timeout
            )
        except grpc.aio.AioRpcError as exc:
            snapshot["errors"].append(f"pool {self.config.pool}: {exc.code().name} {exc.details()}")
            nodes, leases = pool_pb2.ListNodesResponse(), pool_pb2.ListLeasesResponse()
        snapshot["nodes"] = [
            {
                "node_id": n.node_id,
                "address": n.address,
                "state": _name(pool_pb2.NodeState, n.state, "NODE_STATE_"),
                "capacity": n.capacity,
                "leases": n.lease_count,
                "warm_spares": n.warm_spare_count,
                "images": n.image_count,
                "image_budget": _budget(n.image_used_bytes, n.image_budget_bytes),
                "pulls_in_flight": n.pulls_in_flight,
                "last_seen_s": round(_age_s(n.last_seen_time, now), 1),
                "health_message": n.health_message,
                "failures": n.consecutive_failures,
                "version": n.version,
            }
            for n in nodes.nodes
        ]
        snapshot["leases"] = [
            {
                "lease_id": lease.lease_id,
                "node_id": lease.node_id,
                "state": _name(pool_pb2.LeaseState, lease.state, "LEASE_STATE_"),
                "owner": lease.owner,
                "instance_id": lease.instance_id,
                "age_s": round(_age_s(lease.create_time, now), 1),
                "wait_s": round(lease.wait_duration.ToMicroseconds() / 1e6, 3),
                "warm": lease.from_warm_spare,
            }
            for lease in leases.leases
        ]
        by_state: dict[str, int] = {}
        for lease in snapshot["leases"]:
            by_state[lease["state"]] = by_state.get(lease["state"], 0) + 1
        snapshot["leases_by_state"] = by_state
        snapshot["warm_spares"] = sum(n["warm_spares"] for n in snapshot["nodes"])
        snapshot["agents"] = [
            await self._agent(address, channel) for address, channel in self._agents
        ]
        # Episodes that ended in the last minute: as the agents report them, or, with no agent
        # given, the leases that were seen and are gone (a finished or failed episode each).
        current = {lease["lease_id"] for lease in snapshot["leases"]}
        for _ in self._seen_leases - current:
            self._ended.append(now)
        self._seen_leases = current
        while self._ended and self._ended[0] < now - 60:
            self._ended.popleft()
        finished = [e for a in snapshot["agents"] for e in a["finished"]]
        ended_per_min = (
            sum(1 for e in finished if e["end_time"] >= now - 60)
            if self._agents
            else len(self._ended)
        )
        waits = [lease["wait_s"] for lease in snapshot["leases"]]
        rewards = [
            e["reward"]
            for e in finished
            if e["reward"] is not None and e["end_time"] >= now - REWARD_WINDOW_S
        ]
        point = {
            "time": now,
            "ended_per_min": ended_per_min,
            "p50_wait_s": statistics.median(waits) if waits else None,
            "mean_reward": statistics.fmean(rewards) if rewards else None,
            "active_leases": len(current),
        }
        self.history.append(point)
        self.snapshot = snapshot

    async def _agent(self, address: str, channel: grpc.aio.Channel) -> dict[str, Any]:
        from swerl.web.agent_board import list_agent_episodes

        try:
            running, finished = await list_agent_episodes(channel, self.config.rpc_timeout_s)
        except grpc.aio.AioRpcError as exc:
            return {
                "address": address,
                "error": f"{exc.code().name} {exc.details()}",
                "running": [],
                "finished": [],
            }
        return {"address": address, "error": "", "running": running, "finished": finished}


POLLER = web.AppKey("poller", Poller)
CONFIG = web.AppKey("config", DashboardConfig)


def _authorized(request: web.Request) -> bool:
    token = request.app[CONFIG].token
    if not token:
        return True
    offered = request.cookies.get(COOKIE, "")
    header = request.headers.get("Authorization", "")
    if header.startswith("Bearer "):
        offered = header.removeprefix("Bearer ")
    return hmac.compare_digest(offered.encode(), token.encode())


async def index(request: web.Request) -> web.Response:
    if not _authorized(request):
        return render("login.html.j2", status=401, error="", pool=request.app[CONFIG].pool)
    config = request.app[CONFIG]
    return render("dashboard.html.j2", config=config)


async def login(request: web.Request) -> web.Response:
    form = await request.post()
    offered = str(form.get("token", ""))
    token = request.app[CONFIG].token
    if token and not hmac.compare_digest(offered.encode(), token.encode()):
        return render(
            "login.html.j2", status=401, error="wrong token", pool=request.app[CONFIG].pool
        )
    response = web.Response(status=303, headers={"Location": "/"})
    response.set_cookie(COOKIE, offered, httponly=True, samesite="Strict")
    return response


async def state(request: web.Request) -> web.Response:
    if not _authorized(request):
        raise web.HTTPUnauthorized(text="the services' bearer token is required")
    poller = request.app[POLLER]
    return web.json_response({**poller.snapshot, "history": list(poller.history)})


async def plotly_js(request: web.Request) -> web.FileResponse:
    return web.FileResponse(plotly_js_path(), headers={"Cache-Control": "max-age=3600"})


def make_app(config: DashboardConfig) -> web.Application:
    app = web.Application()
    app[CONFIG] = config

    async def lifecycle(app: web.Application) -> Any:
        poller = Poller(config)
        app[POLLER] = poller
        await poller.start()
        yield
        await poller.close()

    app.cleanup_ctx.append(lifecycle)
    app.router.add_get("/", index)
    app.router.add_post("/login", login)
    app.router.add_get("/api/state", state)
    app.router.add_get("/static/plotly.min.js", plotly_js)
    return app
