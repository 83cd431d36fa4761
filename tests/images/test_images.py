"""`swerl images pull` / `status` against real in-process exec nodes on the local dockerd.

No registry is reachable here, so pulls of absent images fail: what is tested is that they are
reported cleanly (per node, with the node's reason, retried only when a retry can help), and
that images already on the node succeed.
"""

from __future__ import annotations

import asyncio
import json
import os
import tempfile
from pathlib import Path

import pytest

from swerl.cli import main
from swerl.exec.server import ExecNode, local_node
from swerl.exec.settings import ExecSettings
from swerl.images.pull import (
    ImageListError,
    ImagePuller,
    canonical_image,
    coverage,
    read_image_list,
)

# Nothing listens on this port: a pull fails at once with "connection refused".
UNREACHABLE = "localhost:5999/swerl-test/absent:1"
UNREACHABLE_2 = "localhost:5999/swerl-test/absent:2"
MALFORMED = "Not A/Reference"


def _puller(**overrides) -> ImagePuller:
    values = dict(retries=1, initial_wait_s=0.05, max_wait_s=0.1, call_timeout_s=120)
    values.update(overrides)
    return ImagePuller(**values)


@pytest.fixture
async def node():
    async with local_node("images-test") as (exec_node, _channel):
        yield f"127.0.0.1:{exec_node.port}"


async def test_images_already_on_the_node_succeed(node, base_image):
    seen = []
    puller = _puller(on_progress=lambda progress, image: seen.append(image))
    report = await puller.pull([node], [base_image, base_image])
    assert report.ok
    (progress,) = report.nodes
    assert progress.present == {base_image} and progress.done == 1
    assert report.missing() == {}
    assert seen == [base_image]


async def test_missing_images_are_reported_with_the_reason_and_retried_once(node, base_image):
    report = await _puller(retries=1).pull([node], [base_image, UNREACHABLE, MALFORMED])
    assert not report.ok
    (progress,) = report.nodes
    assert progress.present == {base_image}
    assert progress.error == ""
    assert progress.failed[UNREACHABLE].reason == "REGISTRY_UNREACHABLE"
    assert progress.failed[UNREACHABLE].message
    assert progress.failed[MALFORMED].reason == "INVALID_IMAGE_REFERENCE"
    # The unreachable registry got a second attempt; nothing else was asked for twice.
    assert progress.attempts == 2
    assert report.missing() == {
        MALFORMED: {node: "INVALID_IMAGE_REFERENCE"},
        UNREACHABLE: {node: "REGISTRY_UNREACHABLE"},
    }
    text = report.render()
    assert "missing images: 2" in text and UNREACHABLE in text


async def test_permanent_failures_are_not_retried(node):
    report = await _puller(retries=3).pull([node], [MALFORMED])
    assert report.nodes[0].attempts == 1
    assert report.nodes[0].failed[MALFORMED].reason == "INVALID_IMAGE_REFERENCE"


async def test_images_go_in_batches_and_every_node_gets_every_image(base_image):
    async with local_node("images-a") as (a, _), local_node("images-b") as (b, _):
        addresses = [f"127.0.0.1:{a.port}", f"127.0.0.1:{b.port}"]
        report = await _puller(batch_size=1).pull(addresses, [base_image, UNREACHABLE])
    assert [n.address for n in report.nodes] == addresses
    for progress in report.nodes:
        assert progress.present == {base_image}
        assert set(progress.failed) == {UNREACHABLE}
        assert progress.attempts == 3  # one batch for the present image, two for the other
    assert report.missing() == {UNREACHABLE: dict.fromkeys(addresses, "REGISTRY_UNREACHABLE")}


async def test_a_mirror_that_cannot_be_reached_is_reported_like_the_registry(node, base_image):
    report = await _puller(retries=0, mirror_prefix="localhost:5999/mirror").pull(
        [node], [base_image, "swerl-test/only-in-mirror:1"]
    )
    progress = report.nodes[0]
    assert progress.present == {base_image}  # present images are not pulled again
    assert progress.failed["swerl-test/only-in-mirror:1"].reason == "REGISTRY_UNREACHABLE"


async def test_a_node_that_cannot_be_reached_is_an_error_of_that_node_only(node, base_image):
    dead = "127.0.0.1:9"
    report = await _puller(retries=1, max_wait_s=0.05).pull([node, dead], [base_image])
    good, bad = report.nodes
    assert good.ok
    assert bad.error.startswith("UNAVAILABLE")
    assert bad.failed[base_image].reason == "NODE_FAILED"
    assert report.missing() == {base_image: {dead: "NODE_FAILED"}}


async def test_a_node_refusing_the_token_is_reported_with_its_reason(base_image):
    with tempfile.TemporaryDirectory() as state:
        settings = ExecSettings(
            host="127.0.0.1",
            port=0,
            auth_token="right",
            node_id=f"images-auth-{os.getpid()}",
            state_dir=Path(state),
            log_level="warning",
        )
        exec_node = ExecNode(settings)
        port = await exec_node.start()
        try:
            address = f"127.0.0.1:{port}"
            refused = await _puller(token="wrong").pull([address], [base_image])
            accepted = await _puller(token="right").pull([address], [base_image])
        finally:
            await exec_node.stop(0)
    assert refused.nodes[0].error.startswith("INVALID_TOKEN")
    assert refused.nodes[0].attempts == 1
    assert accepted.ok


async def test_status_shows_per_node_coverage(node, base_image):
    (cover,) = await coverage([node], [base_image, UNREACHABLE])
    assert cover.present == 1
    assert cover.missing == [UNREACHABLE]
    assert cover.node_id.startswith("images-test")
    assert "1/2 images present (50.0%), 1 missing" in cover.line(2)
    (dead,) = await coverage(["127.0.0.1:9"], [base_image])
    assert dead.error.startswith("UNAVAILABLE")


def test_docker_hub_names_compare_equal_to_their_listed_form():
    assert canonical_image("docker.io/swebench/x:latest") == "swebench/x:latest"
    assert canonical_image("docker.io/library/debian") == "debian:latest"
    assert canonical_image("localhost:5000/a/b") == "localhost:5000/a/b:latest"
    assert canonical_image("a/b@sha256:00") == "a/b@sha256:00"


def test_image_lists_come_from_text_files_prepared_data_and_raw_rows(tmp_path):
    text = tmp_path / "images.txt"
    text.write_text("a/b:1\n# comment\n\na/b:1\nc/d:2  # trailing\n")
    assert read_image_list(text) == ["a/b:1", "c/d:2"]

    prepared = tmp_path / "data.jsonl"
    rows = [
        {"text": "t", "metadata": {"instance": {"instance_id": "x__y-1", "image_name": "i:1"}}},
        {"text": "t", "metadata": {"instance": {"instance_id": "x__y-2"}, "data_source": "gym"}},
    ]
    prepared.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert read_image_list(prepared) == [
        "i:1",
        "docker.io/xingyaoww/sweb.eval.x86_64.x_s_y-2:latest",
    ]

    raw = tmp_path / "swe-bench.jsonl"
    raw.write_text(json.dumps({"instance_id": "django__django-1"}) + "\n")
    assert read_image_list(raw) == [
        "docker.io/swebench/sweb.eval.x86_64.django_1776_django-1:latest"
    ]

    broken = tmp_path / "broken.jsonl"
    broken.write_text("{not json\n")
    with pytest.raises(ImageListError, match=r"broken.jsonl:1"):
        read_image_list(broken)
    with pytest.raises(ImageListError, match="absent"):
        read_image_list(tmp_path / "absent.txt")


async def test_cli_pull_and_status_exit_codes_and_report(node, base_image, tmp_path, capsys):
    images = tmp_path / "images.txt"
    images.write_text(f"{base_image}\n")
    report = tmp_path / "report.json"
    args = ["images", "pull", "--images", str(images), "--node", node, "--report", str(report)]
    assert await asyncio.to_thread(main, args) == 0
    assert json.loads(report.read_text())["ok"] is True
    assert (
        await asyncio.to_thread(main, ["images", "status", "--images", str(images), "--node", node])
        == 0
    )

    args = ["images", "pull", "--image", base_image, "--image", UNREACHABLE, "--node", node]
    assert await asyncio.to_thread(main, [*args, "--retries", "0"]) == 1
    out = capsys.readouterr().out
    assert "missing images: 1" in out and "REGISTRY_UNREACHABLE" in out
    status = ["images", "status", "--image", UNREACHABLE, "--node", node]
    assert await asyncio.to_thread(main, status) == 1
    assert f"missing {UNREACHABLE}" in capsys.readouterr().out

    assert await asyncio.to_thread(main, ["images", "pull", "--node", node]) == 2
    assert await asyncio.to_thread(main, ["images", "pull", "--image", base_image]) == 2
    # Home sets are the pool's: --replicas over hand-named nodes is refused.
    replicas = ["images", "pull", "--image", base_image, "--node", node, "--replicas", "1"]
    assert await asyncio.to_thread(main, replicas) == 2
    assert "--replicas takes the nodes from --pool" in capsys.readouterr().err


async def test_cli_finds_the_nodes_through_the_pool(base_image, capsys):
    from swerl.stack import local_stack

    async with local_stack(nodes=1, purpose="images-pool") as stack:
        args = ["images", "pull", "--image", base_image, "--pool", stack.pool_address]
        assert await asyncio.to_thread(main, [*args, "--token", stack.token]) == 0
    out = capsys.readouterr().out
    assert "ensuring 1 images on 1 nodes" in out
    assert "every image is present on every node" in out


def test_pre_pull_homes_are_the_pools_homes_when_some_nodes_are_not_healthy(tmp_path):
    from swerl.devservers.simulated_nodes import SimulatedNode
    from swerl.images.pull import PoolNode, home_plan
    from swerl.pool import placement
    from swerl.pool.model import Node, NodeState
    from swerl.pool.pulls import Pulls
    from swerl.pool.settings import PoolSettings
    from swerl.pool.state import PoolState

    state = PoolState(
        PoolSettings(insecure=True, port=0, state_dir=tmp_path / "pool", image_replicas=2)
    )
    kinds = [NodeState.HEALTHY] * 5 + [
        NodeState.UNHEALTHY,
        NodeState.DRAINING,
        NodeState.PENDING,
        NodeState.DRAINED,
    ]
    for i, kind in enumerate(kinds):
        node_id = f"node-{i}"
        state.nodes[node_id] = Node(
            node_id=node_id,
            address=f"10.0.0.{i}:50051",
            conn=SimulatedNode(node_id),
            asked_capacity=4,
            labels={},
            register_time=0.0,
            state=kind,
        )
    pulls = Pulls(state, refresh=lambda node: None)
    images = [f"xingyaoww/sweb.eval.x86_64.task_s_{i}:latest" for i in range(200)]
    listed = [PoolNode(n.node_id, n.address, n.state) for n in state.nodes.values()]

    plan = home_plan(images, listed, 2)

    healthy = {n.address for n in state.nodes.values() if n.state is NodeState.HEALTHY}
    assert set(plan) == healthy  # nothing is pre-pulled where the pool would not pull
    id_of = {n.address: n.node_id for n in state.nodes.values()}
    for image in images:
        holders = {id_of[address] for address, listed in plan.items() if image in listed}
        assert holders == set(pulls.homes_of(image)), image
    assert sum(len(listed) for listed in plan.values()) == 2 * len(images)
    # Hashing over every node the pool lists (what pre-pull once did) homes a good share of the
    # images on nodes that take no sandbox: the case this guards.
    every = [n.node_id for n in state.nodes.values()]
    not_healthy = {n.node_id for n in state.nodes.values() if n.state is not NodeState.HEALTHY}
    assert sum(bool(set(placement.homes(i, every, 2)) & not_healthy) for i in images) > 50


async def test_cli_pre_pulls_where_the_pool_places_with_a_draining_and_an_unhealthy_node(
    base_image, tmp_path, capsys
):
    from swerl.pool import placement
    from swerl.pool.client import PoolClient
    from swerl.pool.v1 import pool_pb2
    from swerl.stack import local_stack

    async with local_stack(
        nodes=3,
        max_sandboxes=2,
        purpose="images-health",
        pool_settings={"image_replicas": 2},
    ) as stack:
        pool = PoolClient(stack.pool_address, token=stack.token)
        try:
            nodes = {n.node_id: n for n in await pool.list_nodes()}
            # The base image's ranking over all three nodes: hashed over every node, its two homes
            # are `first` and `second`. One goes draining, the other unhealthy, so the pool's
            # homes are `third` alone.
            first, second, third = placement.homes(base_image, list(nodes), 3)
            # One lease on each node (least loaded first); the one on `first` keeps it draining.
            leases = [await pool.acquire(base_image, wait_s=60) for _ in range(3)]
            assert {lease.node_id for lease in leases} == set(nodes)
            kept = next(lease for lease in leases if lease.node_id == first)
            for lease in leases:
                if lease is not kept:
                    await pool.release(lease.lease_id)
            await pool.drain_node(first)
            by_id = {n.settings.node_id: n for n in stack.nodes}
            await by_id[second].stop(0)
            deadline = asyncio.get_running_loop().time() + 60
            while True:
                states = {n.node_id: n.state for n in await pool.list_nodes()}
                if states[second] == pool_pb2.NODE_STATE_UNHEALTHY:
                    break
                assert asyncio.get_running_loop().time() < deadline, states
                await asyncio.sleep(0.2)
            assert states[first] == pool_pb2.NODE_STATE_DRAINING
            assert states[third] == pool_pb2.NODE_STATE_HEALTHY

            report = tmp_path / "pull.json"
            auth = ["--pool", stack.pool_address, "--token", stack.token]
            pull = ["images", "pull", "--image", base_image, "--replicas", "2", *auth]
            assert await asyncio.to_thread(main, [*pull, "--report", str(report)]) == 0
            out = capsys.readouterr().out
            assert "on their 2 home nodes of 1 healthy (2 not healthy, skipped)" in out
            pulled_on = [node["address"] for node in json.loads(report.read_text())["nodes"]]
            assert pulled_on == [nodes[third].address]
            # The pool's placement homes (what PrefetchImages reports and a pull would use).
            (prefetch,) = await pool.prefetch_images([base_image])
            assert list(prefetch.home_node_ids) == [third]
            assert stack.pool.pool._pulls.homes_of(base_image) == [third]
            await pool.release(kept.lease_id)
        finally:
            await pool.close()


async def test_cli_pulls_onto_home_nodes_prefetches_and_shows_the_pools_cache(base_image, capsys):
    from swerl.stack import local_stack

    async with local_stack(nodes=2, purpose="images-homes") as stack:
        auth = ["--pool", stack.pool_address, "--token", stack.token]
        pull = ["images", "pull", "--image", base_image, "--replicas", "1", *auth]
        assert await asyncio.to_thread(main, pull) == 0
        assert "ensuring 1 images on their 1 home nodes of 2 healthy\n" in capsys.readouterr().out
        prefetch = ["images", "prefetch", "--image", base_image, *auth]
        assert await asyncio.to_thread(main, prefetch) == 0
        assert "prefetch of 1 images: present 1" in capsys.readouterr().out
        status = ["images", "status", "--image", base_image, *auth]
        assert await asyncio.to_thread(main, status) == 0
        out = capsys.readouterr().out
        assert "image cache (pool):" in out
        assert out.count("hits 0 misses 0 (hit rate -), pulls 0 (0 in flight)") == 2
