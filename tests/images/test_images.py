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


async def test_cli_finds_the_nodes_through_the_pool(base_image, capsys):
    from swerl.pool.server import local_stack

    async with local_stack(nodes=1, purpose="images-pool") as stack:
        args = ["images", "pull", "--image", base_image, "--pool", stack.pool_address]
        assert await asyncio.to_thread(main, [*args, "--token", stack.token]) == 0
    out = capsys.readouterr().out
    assert "ensuring 1 images on 1 nodes" in out
    assert "every image is present on every node" in out


def test_home_plan_puts_each_image_on_exactly_the_pools_home_nodes():
    from swerl.images.pull import home_plan
    from swerl.pool.placement import homes

    ids = {f"10.0.0.{i}:5000": f"node-{i}" for i in range(6)}
    images = [f"xingyaoww/sweb.eval.x86_64.task_s_{i}:latest" for i in range(50)]
    plan = home_plan(images, ids, 2)
    for image in images:
        holders = sorted(ids[address] for address, listed in plan.items() if image in listed)
        assert holders == sorted(homes(image, list(ids.values()), 2))
    assert sum(len(listed) for listed in plan.values()) == 2 * len(images)


async def test_cli_pulls_onto_home_nodes_prefetches_and_shows_the_pools_cache(base_image, capsys):
    from swerl.pool.server import local_stack

    async with local_stack(nodes=2, purpose="images-homes") as stack:
        auth = ["--pool", stack.pool_address, "--token", stack.token]
        pull = ["images", "pull", "--image", base_image, "--replicas", "1", *auth]
        assert await asyncio.to_thread(main, pull) == 0
        assert "ensuring 1 images on their 1 home nodes of 2" in capsys.readouterr().out
        prefetch = ["images", "prefetch", "--image", base_image, *auth]
        assert await asyncio.to_thread(main, prefetch) == 0
        assert "prefetch of 1 images: present 1" in capsys.readouterr().out
        status = ["images", "status", "--image", base_image, *auth]
        assert await asyncio.to_thread(main, status) == 0
        out = capsys.readouterr().out
        assert "image cache (pool):" in out
        assert out.count("hits 0 misses 0 (hit rate -), pulls 0 (0 in flight)") == 2
