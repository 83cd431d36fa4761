"""The exec node's image cache against real parts: a loopback registry holding the bundled task
images and a second dockerd with its own image store (tests/testkit/dockerd.py)."""

from __future__ import annotations

import asyncio
import time
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families
from testkit.dockerd import pull_events, start_registry
from testkit.exec import assert_status, rpc_error

from swerl.chassis.settings import add_settings_arguments, settings_from_args
from swerl.exec import images as images_module
from swerl.exec.settings import ExecSettings
from swerl.exec.v1 import sandbox_pb2 as pb

TASKS = 6


def _ordered(registry_images: dict[str, str]) -> list[str]:
    images = [registry_images[i] for i in sorted(registry_images)]
    assert len(images) == TASKS
    return images


def _budget_for(count: int, image_sizes: dict[str, int]) -> int:
    """Bytes that hold `count` of the task images but never `count + 1`."""
    budget = count * max(image_sizes.values()) + min(image_sizes.values()) // 2
    assert (count + 1) * min(image_sizes.values()) > budget
    return budget


def _counter(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def _attempts(reason: str) -> float:
    return _counter("swerl_exec_image_pull_attempt_failures_total", reason=reason)


def _pulls_of(events: list[dict], image: str) -> int:
    return sum(1 for e in events if (e.get("Actor") or {}).get("ID") == image)


async def test_eight_concurrent_ensures_of_a_missing_image_cause_one_pull(
    cache_node, registry_images, second_dockerd
):
    node = await cache_node()
    image = _ordered(registry_images)[0]
    since = time.time()
    hits, misses = (
        _counter("swerl_exec_image_cache_hits_total"),
        _counter("swerl_exec_image_cache_misses_total"),
    )

    answers = await asyncio.gather(*(node.ensure(image) for _ in range(8)))

    assert [a[image].status for a in answers] == [pb.IMAGE_PULL_STATUS_PULLED] * 8
    assert all(a[image].size_bytes > 0 for a in answers)
    events = await asyncio.to_thread(pull_events, second_dockerd.host, since, time.time())
    assert _pulls_of(events, image) == 1, events
    assert _counter("swerl_exec_image_cache_misses_total") - misses == 8
    # Present now: a ninth request is a hit and pulls nothing.
    assert (await node.ensure(image))[image].status == pb.IMAGE_PULL_STATUS_PRESENT
    assert _counter("swerl_exec_image_cache_hits_total") - hits == 1


async def test_a_budget_for_three_images_evicts_lru_unused_images_never_one_in_use(
    cache_node, registry_images, image_sizes, second_dockerd
):
    budget = _budget_for(3, image_sizes)
    node = await cache_node(image_disk_budget=budget)
    t0, t1, t2, t3, t4, t5 = _ordered(registry_images)
    evictions = _counter("swerl_exec_image_evictions_total")
    evicted: dict[str, list[str]] = {}

    async def run_task(image: str, *, keep: bool = False) -> None:
        """Pulls the image, runs a command in a sandbox of it, destroys it unless `keep`."""
        result = (await node.ensure(image))[image]
        assert result.status in (pb.IMAGE_PULL_STATUS_PULLED, pb.IMAGE_PULL_STATUS_PRESENT), (
            result.reason,
            result.message,
        )
        evicted[image] = list(result.evicted_images)
        sandbox = await node.create(image)
        assert (await node.client.run(sandbox.sandbox_id, "git --version")).exit_code == 0
        if not keep:
            await node.destroy(sandbox.sandbox_id)
        info = await node.info()
        assert info.image_budget_bytes == budget
        assert 0 < info.image_used_bytes <= budget
        assert t0 in await node.images(), "the image of a running sandbox was evicted"

    await run_task(t0, keep=True)  # runs all along
    await run_task(t1)
    await run_task(t2)
    assert evicted == {t0: [], t1: [], t2: []}
    await run_task(t3)  # t0 is older but in use: t1 goes
    assert evicted[t3] == [t1]
    await run_task(t2)  # present, used again: t3 is now the least recently used
    await run_task(t4)
    assert evicted[t4] == [t3]
    await run_task(t5)
    assert evicted[t5] == [t2]

    images = await node.images()
    assert {t0, t4, t5} <= images.keys() and not {t1, t2, t3} & images.keys()
    assert images[t0].in_use_count == 1 and images[t4].in_use_count == 0
    assert images[t0].cached and not images[t0].pinned
    assert images[t4].last_use_time.ToSeconds() <= images[t5].last_use_time.ToSeconds()
    assert images[t4].use_count == 1
    base = next(i for i in images.values() if i.pinned)
    assert not base.cached  # loaded by hand, never pulled by the node: outside the cache
    assert _counter("swerl_exec_image_evictions_total") - evictions == 3
    info = await node.info()
    assert info.images_cached == 3


async def test_a_restarted_node_keeps_its_lru_order(cache_node, registry_images, image_sizes):
    budget = _budget_for(2, image_sizes)
    t0, t1, t2 = _ordered(registry_images)[:3]
    first = await cache_node(image_disk_budget=budget, node_id="cache-restart")
    await first.ensure(t0)
    await first.ensure(t1)
    sandbox = await first.create(t0)  # t0, pulled first, becomes the most recently used
    await first.destroy(sandbox.sandbox_id)
    before = await first.images()
    await first.close()

    second = await cache_node(image_disk_budget=budget, node_id="cache-restart")
    after = await second.images()
    for image in (t0, t1):
        assert after[image].last_use_time == before[image].last_use_time
        assert after[image].use_count == before[image].use_count
    result = (await second.ensure(t2))[t2]
    assert result.status == pb.IMAGE_PULL_STATUS_PULLED
    assert list(result.evicted_images) == [t1]


async def test_a_stopped_registry_answers_every_waiter_unreachable_and_the_node_serves(
    cache_node, tmp_path, second_dockerd
):
    registry = start_registry(tmp_path / "gone")
    image = f"{registry.address}/swerl-test/anything:1"
    registry.stop()
    node = await cache_node(image_pull_attempts=2)
    pulls = _counter("swerl_exec_image_pulls_total", outcome="REGISTRY_UNREACHABLE")
    attempts = _attempts("REGISTRY_UNREACHABLE")

    answers = await asyncio.gather(*(node.ensure(image, timeout=30) for _ in range(4)))

    assert [a[image].reason for a in answers] == ["REGISTRY_UNREACHABLE"] * 4
    assert all(a[image].status == pb.IMAGE_PULL_STATUS_FAILED for a in answers)
    # One pull, tried twice (the failure is transient), answered all four waiters.
    assert _counter("swerl_exec_image_pulls_total", outcome="REGISTRY_UNREACHABLE") - pulls == 1
    assert _attempts("REGISTRY_UNREACHABLE") - attempts == 2
    health = health_pb2_grpc.HealthStub(node.channel)
    check = await health.Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
    assert check.status == health_pb2.HealthCheckResponse.SERVING
    # A request right after is answered from the failure memory, without a new pull.
    assert (await node.ensure(image))[image].reason == "REGISTRY_UNREACHABLE"
    assert _counter("swerl_exec_image_pulls_total", outcome="REGISTRY_UNREACHABLE") - pulls == 1


async def test_an_image_bigger_than_the_budget_is_too_large_without_pulling(
    cache_node, registry_images, second_dockerd
):
    node = await cache_node(image_disk_budget=4096)
    image = _ordered(registry_images)[0]
    since = time.time()

    result = (await node.ensure(image))[image]

    assert result.status == pb.IMAGE_PULL_STATUS_FAILED
    assert result.reason == "IMAGE_TOO_LARGE", result.message
    assert result.size_bytes > 4096
    events = await asyncio.to_thread(pull_events, second_dockerd.host, since, time.time())
    assert _pulls_of(events, image) == 0
    assert image not in await node.images()


async def test_a_missing_tag_is_image_not_found(cache_node, registry, registry_images):
    node = await cache_node(image_pull_attempts=3)
    image = f"{registry.address}/swerl-test/never-pushed:1"
    attempts = _attempts("IMAGE_NOT_FOUND")
    result = (await node.ensure(image))[image]
    assert (result.status, result.reason) == (pb.IMAGE_PULL_STATUS_FAILED, "IMAGE_NOT_FOUND")
    assert _attempts("IMAGE_NOT_FOUND") - attempts == 1  # not retried: it cannot help


async def test_a_registry_refusing_anonymous_pulls_is_registry_auth(cache_node, tmp_path):
    registry = start_registry(tmp_path / "auth", auth=True)
    try:
        node = await cache_node(image_pull_attempts=3)
        image = f"{registry.address}/swerl-test/private:1"
        pulls = _counter("swerl_exec_image_pulls_total", outcome="REGISTRY_AUTH")
        attempts = _attempts("REGISTRY_AUTH")
        result = (await node.ensure(image))[image]
    finally:
        registry.stop()
    assert (result.status, result.reason) == (pb.IMAGE_PULL_STATUS_FAILED, "REGISTRY_AUTH")
    assert _counter("swerl_exec_image_pulls_total", outcome="REGISTRY_AUTH") - pulls == 1
    assert _attempts("REGISTRY_AUTH") - attempts == 1  # not retried: it cannot help


async def test_pinned_images_are_never_evicted_nor_counted(
    cache_node, registry_images, image_sizes
):
    t0, t1, t2 = _ordered(registry_images)[:3]
    node = await cache_node(image_disk_budget=_budget_for(1, image_sizes), pinned_images=[t0])
    await node.ensure(t0)
    assert (await node.ensure(t1))[t1].evicted_images == []  # t0 is not counted
    assert list((await node.ensure(t2))[t2].evicted_images) == [t1]
    images = await node.images()
    assert images[t0].pinned and not images[t0].cached
    assert t1 not in images and t2 in images


async def test_a_budget_whose_images_are_all_in_use_refuses_another_image(
    cache_node, registry_images, image_sizes
):
    t0, t1 = _ordered(registry_images)[:2]
    node = await cache_node(image_disk_budget=_budget_for(1, image_sizes))
    await node.ensure(t0)
    await node.create(t0)  # keeps t0 in use

    result = (await node.ensure(t1))[t1]

    assert (result.status, result.reason) == (pb.IMAGE_PULL_STATUS_FAILED, "IMAGE_CACHE_FULL")
    images = await node.images()
    assert t0 in images and t1 not in images
    assert (await node.info()).image_used_bytes <= _budget_for(1, image_sizes)


async def test_create_sandbox_still_refuses_an_image_only_the_registry_has(
    cache_node, registry_images
):
    node = await cache_node()
    error = await rpc_error(node.create(_ordered(registry_images)[0]))
    assert_status(error, grpc.StatusCode.FAILED_PRECONDITION, "IMAGE_NOT_PRESENT")


def test_budget_and_pins_are_flags_and_environment_variables(monkeypatch, tmp_path):
    import argparse

    parser = argparse.ArgumentParser()
    add_settings_arguments(parser, ExecSettings)
    args = parser.parse_args(
        ["--insecure", "--image-disk-budget", "1000", "--pinned-images", "a:1", "b:2"]
    )
    settings = settings_from_args(ExecSettings, args)
    assert settings.image_disk_budget == 1000 and settings.pinned_images == ["a:1", "b:2"]
    monkeypatch.setenv("SWERL_EXEC_IMAGE_DISK_BUDGET", "2000")
    monkeypatch.setenv("SWERL_EXEC_INSECURE", "true")
    assert ExecSettings().image_disk_budget == 2000
    with pytest.raises(ValueError):
        ExecSettings(image_disk_budget=-1)


def _scrape(port: int, name: str) -> float:
    """One sample's value as the node's Prometheus endpoint serves it (0 when absent)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and not sample.labels:
                return float(sample.value)
    return 0.0


async def test_a_real_pull_adds_its_unpacked_size_to_the_pulled_bytes_counter(
    cache_node, registry_images, second_dockerd
):
    node = await cache_node(metrics_port=0)
    port = node.node.server.metrics_port
    assert port
    image = _ordered(registry_images)[0]
    name = "swerl_exec_image_pulled_bytes_total"
    before = await asyncio.to_thread(_scrape, port, name)

    result = (await node.ensure(image))[image]

    assert result.status == pb.IMAGE_PULL_STATUS_PULLED
    size = await asyncio.to_thread(_docker_size, second_dockerd, image)
    assert result.size_bytes == size > 0
    assert await asyncio.to_thread(_scrape, port, name) - before == size
    # A hit pulls nothing and adds nothing.
    assert (await node.ensure(image))[image].status == pb.IMAGE_PULL_STATUS_PRESENT
    assert await asyncio.to_thread(_scrape, port, name) - before == size


def _docker_size(dockerd, image: str) -> int:
    client = dockerd.client()
    try:
        return int(client.images.get(image).attrs["Size"])
    finally:
        client.close()


def _image_ids(dockerd) -> set[str]:
    """Every image id on the dockerd, intermediate and dangling ones included."""
    client = dockerd.client()
    try:
        return {image.id for image in client.images.list(all=True)}
    finally:
        client.close()


async def _until(check, what: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


async def test_an_image_whose_pull_is_under_way_is_never_evicted_to_make_room(
    cache_node, registry_images, image_sizes, monkeypatch
):
    """The window guarded: an image already downloaded whose pull has not answered yet (it waits
    to check the budget again) while another pull's room-making must evict all it can. The
    older cached image goes; the one being pulled stays and is answered PULLED.

    Real pulls from the registry into the second dockerd; the test only orders the steps: it
    holds the pull back until the competing request is queued for the budget, and holds the
    budget (as a long room-making would) until the image is downloaded."""
    budget = _budget_for(2, image_sizes)
    t0, pulled, other = _ordered(registry_images)[:3]
    node = await cache_node(image_disk_budget=budget)
    cache = node.node.manager.images
    real_size = images_module.registry_size
    asked: list[str] = []

    def registry_size(reference: str) -> int | None:
        # `other`'s registry reports a size that fits the budget alone, but only once
        # everything else cached is gone: its room-making must try every eviction it may do.
        asked.append(reference)
        return budget - 1 if reference == other else real_size(reference)

    monkeypatch.setattr(images_module, "registry_size", registry_size)
    assert (await node.ensure(t0))[t0].status == pb.IMAGE_PULL_STATUS_PULLED  # LRU-oldest
    t0_id = (await node.images())[t0].image_id
    released = asyncio.Event()
    real_pull = cache._pull_with_retries

    async def held_back_pull(image: str, source: str) -> None:
        await released.wait()
        await real_pull(image, source)

    monkeypatch.setattr(cache, "_pull_with_retries", held_back_pull)
    pulling = asyncio.ensure_future(node.ensure(pulled))
    await _until(lambda: pulled in cache._reserved, "the pull to reserve its room")
    async with cache._budget_lock:
        competing = asyncio.ensure_future(node.ensure(other))
        await _until(lambda: other in asked, "the other request to ask for its size")
        await asyncio.sleep(0.3)  # now queued for the budget
        released.set()
        await _until(
            lambda: set(cache.store.image_uses()) - {t0_id}, "the pull to download its image"
        )
        assert not pulling.done() and not competing.done()
    # `other` decides first: t0 is evicted, `pulled` may not be, so `other` finds no room.
    refused = (await competing)[other]
    assert (refused.status, refused.reason) == (pb.IMAGE_PULL_STATUS_FAILED, "IMAGE_CACHE_FULL")
    assert list(refused.evicted_images) == [t0]
    answered = (await pulling)[pulled]
    assert answered.status == pb.IMAGE_PULL_STATUS_PULLED, (answered.reason, answered.message)
    images = await node.images()
    assert pulled in images and t0 not in images and other not in images
    assert (await node.info()).image_used_bytes <= budget


async def test_an_image_that_outgrows_the_budget_once_unpacked_is_too_large_and_removed(
    cache_node, registry_images, image_sizes, second_dockerd
):
    instance = sorted(registry_images)[0]
    image = registry_images[instance]
    compressed = await asyncio.to_thread(images_module.registry_size, image)
    unpacked = image_sizes[instance]
    assert compressed is not None and compressed < unpacked
    # The registry's compressed size lets the pull start; the unpacked size does not fit.
    budget = (compressed + unpacked) // 2
    node = await cache_node(image_disk_budget=budget)
    before = await asyncio.to_thread(_image_ids, second_dockerd)
    since = time.time()

    result = (await node.ensure(image))[image]

    assert (result.status, result.reason) == (pb.IMAGE_PULL_STATUS_FAILED, "IMAGE_TOO_LARGE")
    assert "unpacked" in result.message and result.size_bytes == unpacked
    events = await asyncio.to_thread(pull_events, second_dockerd.host, since, time.time())
    assert _pulls_of(events, image) == 1  # pulled for real, then removed again
    # Nothing is left: no image, no dangling layer image, nothing counted against the budget.
    assert await asyncio.to_thread(_image_ids, second_dockerd) == before
    assert image not in await node.images()
    info = await node.info()
    assert (info.image_used_bytes, info.images_cached) == (0, 0)
