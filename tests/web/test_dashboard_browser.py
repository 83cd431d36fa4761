"""`swerl dashboard` in a real headless chromium against a real pool, exec node and agent on
the real dockerd, with an episode running (replay policy slowed so its phases can be seen)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from urllib.error import HTTPError
from urllib.request import Request, urlopen

import grpc
import pytest
from aiohttp import web
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait
from testkit.web import (
    TOKENIZER_DIR,
    console_errors,
    run_episode,
    save_screenshot,
    start_message,
)

from swerl.agent.server import local_agent
from swerl.agent.v1 import agent_pb2 as pb
from swerl.agent.v1 import agent_pb2_grpc
from swerl.chassis.client import error_info, make_channel
from swerl.devservers.replay import ReplayPolicyServer, scripts_for_tasks
from swerl.stack import local_stack
from swerl.tasks import build_images, default_tasks_dir, load_tasks
from swerl.web.dashboard import DashboardConfig, make_app

pytestmark = pytest.mark.docker


@contextlib.asynccontextmanager
async def running_stack(latency_s: float):
    tasks = load_tasks(default_tasks_dir())
    await asyncio.to_thread(
        build_images, tasks[:1], base_image="swerl-base:bookworm", progress=lambda line: None
    )
    # The gold script after one slow command, so that the COMMAND phase lasts long enough
    # to be seen at every poll interval (the policy's latency does the same for POLICY).
    scripts = {
        key: ["First a slow look around.\n\n```bash\nsleep 3 && ls\n```", *script]
        for key, script in scripts_for_tasks(tasks[:1], "gold").items()
    }
    replay = ReplayPolicyServer(scripts, tokenizer_dir=TOKENIZER_DIR, latency_s=latency_s)
    url = await replay.start()
    try:
        async with local_stack(nodes=1, max_sandboxes=4, purpose="web-dash") as stack:
            async with local_agent(stack.pool_address, stack.token, tokenizer_processes=0) as agent:
                yield stack, agent, url, tasks[0]
    finally:
        await replay.stop()


@contextlib.asynccontextmanager
async def dashboard(config: DashboardConfig):
    runner = web.AppRunner(make_app(config))
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


async def test_list_episodes_shows_a_running_episode_and_needs_the_token(tmp_path):
    async with running_stack(latency_s=1.0) as (stack, agent, url, task):
        start = start_message(task, url, "board-0", str(tmp_path))
        channel = make_channel(agent.address, token=stack.token)
        stub = agent_pb2_grpc.AgentServiceStub(channel)
        episode = asyncio.create_task(run_episode(stub, start))
        phases = set()
        try:
            deadline = time.monotonic() + 120
            while not episode.done() and time.monotonic() < deadline:
                listed = await stub.ListEpisodes(pb.ListEpisodesRequest(), timeout=10)
                for e in listed.episodes:
                    assert (e.episode_id, e.instance_id, e.owner) == (
                        "board-0",
                        task.instance_id,
                        "web-test",
                    )
                    phases.add(pb.EpisodePhase.Name(e.phase))
                await asyncio.sleep(0.2)
            result = await episode
            assert result.status == pb.EPISODE_STATUS_SUBMITTED
            after = await stub.ListEpisodes(pb.ListEpisodesRequest(), timeout=10)
            assert list(after.episodes) == []
            [ended] = after.finished
            assert ended.episode_id == "board-0" and ended.status == pb.EPISODE_STATUS_SUBMITTED
            assert ended.HasField("reward") and ended.reward == result.reward == 1.0
            assert abs(ended.end_time.ToMicroseconds() / 1e6 - time.time()) < 60
        finally:
            await channel.close()
        assert {"EPISODE_PHASE_POLICY", "EPISODE_PHASE_COMMAND"} <= phases, phases
        anonymous = make_channel(agent.address, token=None)
        try:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await agent_pb2_grpc.AgentServiceStub(anonymous).ListEpisodes(
                    pb.ListEpisodesRequest(), timeout=10
                )
        finally:
            await anonymous.close()
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert error_info(err.value)[0] == "MISSING_TOKEN"


_READ_TABLES = """
const read = id => Array.from(document.querySelectorAll("#" + id + " tbody tr"))
  .map(tr => Array.from(tr.cells).map(td => td.textContent));
return {nodes: read("nodes"), leases: read("leases"), episodes: read("episodes")};
"""


def _watch_dashboard(browser, url: str, token: str, screenshots, done) -> dict:
    """Signs in, then watches the page without reloading it until the episode has ended."""
    browser.get(url + "/")
    assert browser.find_element(By.ID, "login").is_displayed()
    browser.find_element(By.ID, "token").send_keys("not-the-token")
    browser.find_element(By.ID, "sign-in").click()
    # The sign-in form posts and the answer is a new page: wait for it, not for the old one.
    refusal = WebDriverWait(browser, 30).until(
        lambda b: b.find_elements(By.ID, "login-error") or None
    )
    assert refusal[0].text == "wrong token"
    browser.find_element(By.ID, "token").send_keys(token)
    browser.find_element(By.ID, "sign-in").click()
    WebDriverWait(browser, 30).until(lambda b: b.find_elements(By.ID, "nodes") or None)
    # Until signed in, the page itself answered 401 (twice: no token, wrong token); reading the
    # log empties it, so what follows counts only the signed-in page.
    refused = console_errors(browser)
    assert len(refused) == 2 and all("401" in line for line in refused), refused
    loaded_at = browser.execute_script("return window.swerlLoadedAt")
    seen = {"phases": [], "nodes": set(), "lease_owners": set(), "charts": 0}
    deadline = time.monotonic() + 240
    shot = False
    while time.monotonic() < deadline:
        # One read of all three tables: the page replaces their rows at every update.
        tables = browser.execute_script(_READ_TABLES)
        for cells in tables["nodes"]:
            if len(cells) > 1:
                seen["nodes"].add((cells[0], cells[1]))
        for cells in tables["leases"]:
            if len(cells) > 2:
                seen["lease_owners"].add(cells[2])
        for cells in tables["episodes"]:
            if len(cells) > 4 and cells[1] == "dash-0":
                if not seen["phases"] or seen["phases"][-1] != cells[4]:
                    seen["phases"].append(cells[4])
                if not shot and cells[4] == "COMMAND":
                    save_screenshot(browser, screenshots / "dashboard-running.png")
                    shot = True
        if done() and len(seen["phases"]) > 1:
            break
        time.sleep(0.2)
    seen["charts"] = len(browser.find_elements(By.CSS_SELECTOR, ".js-plotly-plot"))
    seen["same_page"] = browser.execute_script("return window.swerlLoadedAt") == loaded_at
    seen["errors"] = console_errors(browser)
    if not shot:
        save_screenshot(browser, screenshots / "dashboard-running.png")
    return seen


_REWARD_POINTS = """
const chart = document.getElementById("chart-reward");
return chart && chart.data ? chart.data[0].y.filter(v => v !== null).length : 0;
"""


def _shoot_with_rewards(browser, screenshots) -> int:
    """Waits until the page's mean-reward chart has drawn a few points of the ended episode,
    then saves dashboard.png (the picture docs/images/dashboard.png is made from)."""
    WebDriverWait(browser, 30).until(lambda b: b.execute_script(_REWARD_POINTS) >= 6)
    save_screenshot(browser, screenshots / "dashboard.png")
    return int(browser.execute_script(_REWARD_POINTS))


def _state_after_the_episode(page: str, token: str) -> dict:
    """The dashboard's JSON once a poll has seen the ended episode."""
    request = Request(page + "/api/state", headers={"Authorization": f"Bearer {token}"})
    deadline = time.monotonic() + 30
    while True:
        with urlopen(request, timeout=10) as response:
            state = json.loads(response.read())
        if state["history"] and state["history"][-1]["mean_reward"] is not None:
            return state
        assert time.monotonic() < deadline, state
        time.sleep(0.5)


async def test_dashboard_shows_the_node_and_a_running_episodes_phase_changing(
    tmp_path, browser, screenshots
):
    async with running_stack(latency_s=1.5) as (stack, agent, url, task):
        config = DashboardConfig(
            pool=stack.pool_address, agents=[agent.address], token=stack.token, interval_s=0.5
        )
        async with dashboard(config) as page:
            # the JSON behind the page needs the token too
            with pytest.raises(HTTPError) as err:
                await asyncio.to_thread(urlopen, page + "/api/state", timeout=10)
            assert err.value.code == 401
            request = Request(page + "/api/state", headers={"Authorization": "Bearer wrong"})
            with pytest.raises(HTTPError) as err:
                await asyncio.to_thread(urlopen, request, timeout=10)
            assert err.value.code == 401

            channel = make_channel(agent.address, token=stack.token)
            stub = agent_pb2_grpc.AgentServiceStub(channel)
            episode = asyncio.create_task(
                run_episode(stub, start_message(task, url, "dash-0", str(tmp_path)))
            )
            try:
                seen = await asyncio.to_thread(
                    _watch_dashboard, browser, page, stack.token, screenshots, episode.done
                )
                result = await episode
                state = await asyncio.to_thread(_state_after_the_episode, page, stack.token)
                reward_points = await asyncio.to_thread(_shoot_with_rewards, browser, screenshots)
            finally:
                await channel.close()
    # the charts' figures: one episode ended in the last minute, with reward +1
    assert state["history"][-1]["ended_per_min"] == 1
    assert state["history"][-1]["mean_reward"] == 1.0
    assert reward_points >= 6  # the picture's reward chart has data
    assert state["agents"][0]["finished"][0]["episode_id"] == "dash-0"
    assert result.status == pb.EPISODE_STATUS_SUBMITTED
    node_id = stack.nodes[0].settings.node_id
    assert (node_id, "HEALTHY") in seen["nodes"]
    assert "web-test" in seen["lease_owners"]
    # the phase changed on the page while it stayed loaded
    assert {"POLICY", "COMMAND"} <= set(seen["phases"]), seen["phases"]
    assert len(seen["phases"]) >= 3, seen["phases"]
    assert seen["same_page"]
    assert seen["charts"] == 3
    assert seen["errors"] == []
