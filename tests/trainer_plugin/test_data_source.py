"""swerl.trainer_plugin.data_source.PrefetchingDataSource (`--data-source-path`) over the
framework's default data source (standin_data_source), against a real pool server on
port 0 with a simulated exec node: fetching batch i sends the images of batch i and batch i + 1.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path
from typing import Any

import pytest
import structlog
from testkit.playback import eventually
from testkit.plugin import make_args
from testkit.standin_common import load_function
from testkit.standin_data_source import DATA_ARGS

from swerl.devservers.simulated_nodes import SimulatedNode, SimulatedRegistry
from swerl.exec.sweinstance import image_name_for
from swerl.pool.server import PoolServer
from swerl.pool.settings import PoolSettings
from swerl.trainer_plugin import data_source
from swerl.trainer_plugin.prefetch import _prefetchers

DATA_SOURCE = "swerl.trainer_plugin.data_source.PrefetchingDataSource"
GYM = "SWE-Gym/SWE-Gym"
ROWS = 7
BATCH = 2


def instance_ids(count: int = ROWS) -> list[str]:
    return [f"swe-gym__task-{i}" for i in range(count)]


def images(ids: list[str]) -> list[str]:
    return [image_name_for(i, GYM) for i in ids]


def write_prompts(path: Path, ids: list[str]) -> Path:
    """`swerl data prepare`'s JSONL: text + metadata {instance, data_source}."""
    with path.open("w") as out:
        for instance_id in ids:
            row = {"instance_id": instance_id, "problem_statement": f"fix {instance_id}"}
            line = {
                "text": row["problem_statement"],
                "metadata": {"instance": row, "data_source": GYM},
            }
            out.write(json.dumps(line) + "\n")
    return path


def data_args(tmp_path: Path, pool_address: str = "", **overrides: Any) -> argparse.Namespace:
    """The framework's args (rollout batch of BATCH prompts x 4 samples) plus the plugin's."""
    plugin = {"pool_address": pool_address} if pool_address else {}
    args = make_args(["127.0.0.1:1"], **plugin)
    for key, value in {**DATA_ARGS, **overrides}.items():
        setattr(args, key, value)
    args.rollout_batch_size = BATCH
    if getattr(args, "prompt_data", None) is None:
        args.prompt_data = str(write_prompts(tmp_path / "prompts.jsonl", instance_ids()))
    return args


class RecordingPool:
    """A real PoolServer on 127.0.0.1:0 with one simulated exec node that pulls from a simulated
    registry; the pool's own prefetch is wrapped to record each PrefetchImages call's images."""

    def __init__(self, tmp_path: Path) -> None:
        registry = SimulatedRegistry(dict.fromkeys(images(instance_ids()), 1 << 20))
        self.node = SimulatedNode("sim-0", images=[], registry=registry)
        settings = PoolSettings(
            host="127.0.0.1", port=0, insecure=True, state_dir=tmp_path, capability_secret="s"
        )
        self.server = PoolServer(settings, connect={"sim-0:1": self.node}.__getitem__)
        self.requests: list[list[str]] = []

    @property
    def address(self) -> str:
        return self.server.address

    def sent(self) -> set[str]:
        return {image for request in self.requests for image in request}

    async def __aenter__(self) -> RecordingPool:
        await self.server.start()
        await self.server.pool.register_node("sim-0", "sim-0:1", 0, {})
        pool = self.server.pool
        prefetch = pool.prefetch

        def recording(names: Any) -> Any:
            self.requests.append(list(names))
            return prefetch(self.requests[-1])

        pool.prefetch = recording  # type: ignore[method-assign]
        return self

    async def __aexit__(self, *exc: object) -> None:
        for key in [key for key in _prefetchers if key[0] == self.address]:
            await _prefetchers.pop(key).close()
        await self.server.stop(0)


def rows_of(groups: list[list[Any]]) -> list[str]:
    return [group[0].metadata["instance"]["instance_id"] for group in groups]


async def test_fetching_batch_i_sends_the_images_of_batch_i_and_batch_i_plus_1(fw, tmp_path):
    ids = instance_ids()
    async with RecordingPool(tmp_path) as pool:
        args = data_args(tmp_path, pool.address)
        source = load_function(DATA_SOURCE)(args)
        base = fw_module(fw).RolloutDataSourceWithBuffer
        assert isinstance(source, base), "the framework's own data source, extended"

        first = source.get_samples(BATCH)
        assert rows_of(first) == ids[0:2]
        # Before any generate call: the fetched batch and the next one are on their way.
        await eventually(lambda: pool.sent() == set(images(ids[0:4])))
        await eventually(lambda: sorted(pool.node.pulled) == sorted(images(ids[0:4])))
        assert len(pool.requests) == 1, "one PrefetchImages call per fetch"

        second = source.get_samples(BATCH)
        assert rows_of(second) == ids[2:4]
        await eventually(lambda: pool.sent() == set(images(ids[0:6])))
        # Images already sent are not sent again: the second call carries batch 3 only.
        assert set(pool.requests[-1]) == set(images(ids[4:6]))
        await eventually(lambda: sorted(pool.node.pulled) == sorted(images(ids[0:6])))


async def test_the_fetched_groups_are_exactly_the_frameworks(fw, tmp_path):
    async with RecordingPool(tmp_path) as pool:
        args = data_args(tmp_path, pool.address, rollout_shuffle=True)
        ours = load_function(DATA_SOURCE)(args)
        theirs = fw_module(fw).RolloutDataSourceWithBuffer(args)
        for size in (BATCH, 3, BATCH, 4):  # across the end of an epoch (reshuffled)
            got, want = ours.get_samples(size), theirs.get_samples(size)
            assert [[vars(s) for s in g] for g in got] == [[vars(s) for s in g] for g in want]
            assert all(len(g) == args.n_samples_per_prompt for g in got)
        assert len(ours) == len(theirs) == ROWS
        assert (ours.epoch_id, ours.sample_offset) == (theirs.epoch_id, theirs.sample_offset)


async def test_buffered_partial_groups_come_first_in_the_lookahead(fw, tmp_path):
    ids = instance_ids()
    async with RecordingPool(tmp_path) as pool:
        args = data_args(tmp_path, pool.address)
        source = load_function(DATA_SOURCE)(args)
        plain = fw_module(fw).RolloutDataSourceWithBuffer(args)
        aborted = plain.get_samples(7)[-1:]  # a partial group of the last row, handed back
        source.add_samples(aborted)
        assert rows_of(source.get_samples(BATCH)) == [ids[6], ids[0]]
        await eventually(lambda: pool.sent() == set(images([ids[6], ids[0], ids[1], ids[2]])))


def test_the_lookahead_stops_at_a_reshuffled_epoch_and_wraps_an_ordered_one(fw, tmp_path):
    ids = instance_ids()
    for shuffle, expected in ((False, ids[6:] + ids[:1]), (True, ids[6:])):
        args = data_args(tmp_path, rollout_shuffle=shuffle)
        source = fw_module(fw).RolloutDataSourceWithBuffer(args)
        source.get_samples(3)
        source.get_samples(3)
        upcoming = data_source.upcoming_rows(source, 2)
        got = [row.metadata["instance"]["instance_id"] for row in upcoming]
        if shuffle:
            assert got == [source.dataset.samples[6].metadata["instance"]["instance_id"]]
        else:
            assert got == expected


async def test_a_pool_that_does_not_answer_never_fails_a_fetch_and_is_logged_once(fw, tmp_path):
    args = data_args(tmp_path, "127.0.0.1:1")
    args.swerl_prefetch_delay_s = 0.01
    source = load_function(DATA_SOURCE)(args)
    plain = fw_module(fw).RolloutDataSourceWithBuffer(data_args(tmp_path))
    with structlog.testing.capture_logs() as logs:
        for _ in range(3):
            got, want = source.get_samples(BATCH), plain.get_samples(BATCH)
            assert rows_of(got) == rows_of(want)
            await asyncio.sleep(0.3)  # the window's call fails (connection refused)
    failures = [e for e in logs if e["event"] == "prefetch.failed"]
    assert [e["log_level"] for e in failures][:1] == ["warning"]
    assert all(e["log_level"] == "debug" for e in failures[1:])
    for key in [key for key in _prefetchers if key[0] == "127.0.0.1:1"]:
        await _prefetchers.pop(key).close()


def test_a_broken_row_or_a_failing_prefetcher_never_fails_a_fetch(fw, tmp_path, monkeypatch):
    ids = instance_ids(3)
    prompts = write_prompts(tmp_path / "p.jsonl", ids)
    with prompts.open("a") as out:  # a row without an instance: skipped, its generate reports it
        out.write(json.dumps({"text": "no instance", "metadata": {}}) + "\n")
    args = data_args(tmp_path, "127.0.0.1:1", prompt_data=str(prompts))
    source = load_function(DATA_SOURCE)(args)
    assert data_source.images_of(source.dataset.samples) == images(ids)

    def broken(*_: Any) -> None:
        raise RuntimeError("prefetcher broke")

    monkeypatch.setattr(data_source, "send", broken)
    with structlog.testing.capture_logs() as logs:
        assert len(source.get_samples(BATCH)) == BATCH
        assert len(source.get_samples(BATCH)) == BATCH
    assert [e["event"] for e in logs if e["log_level"] == "warning"] == [
        "prefetch.data_source_failed"
    ]


async def test_without_a_running_loop_the_images_go_from_a_thread(fw, tmp_path):
    ids = instance_ids()
    async with RecordingPool(tmp_path) as pool:
        args = data_args(tmp_path, pool.address)
        source = load_function(DATA_SOURCE)(args)
        await asyncio.to_thread(source.get_samples, BATCH)
        await eventually(lambda: pool.sent() == set(images(ids[0:4])))


def test_without_a_pool_address_it_is_the_frameworks_data_source(fw, tmp_path):
    args = data_args(tmp_path)
    before = dict(_prefetchers)
    source = load_function(DATA_SOURCE)(args)
    assert rows_of(source.get_samples(BATCH)) == instance_ids()[:2]
    assert _prefetchers == before


def test_data_source_base_names_the_class_to_extend(fw, tmp_path):
    args = data_args(tmp_path)
    args.swerl_data_source_base = f"{fw.NAME}.rollout.data_source.RolloutDataSource"
    source = load_function(DATA_SOURCE)(args)
    assert isinstance(source, fw_module(fw).RolloutDataSource)
    assert not hasattr(source, "buffer")
    with pytest.raises(RuntimeError):
        source.add_samples([[object()]])


def fw_module(fw: Any) -> Any:
    return sys.modules[f"{fw.NAME}.rollout.data_source"]


def test_under_miles_multi_lora_it_extends_the_data_source_miles_would_swap_in(
    fw, tmp_path, monkeypatch
):
    # miles replaces its default by MultiLoRAAsyncDataSource when --multi-lora-n-adapters > 0
    # (args.multi_lora) and --data-source-path is the default (miles/utils/multi_lora.py at
    # 31f1ca96); with the flag pointing here, the plugin does that swap. slime has no such mode.
    import types

    class MultiLoRAAsyncDataSource:  # a marker; the real one keeps one source per adapter
        def __init__(self, args: Any) -> None:
            self.args = args

        def get_samples(self, num_samples: int = 1) -> list[list[Any]]:
            return []

    name = f"{fw.NAME}.rollout.multi_lora.data_source"
    for package in (f"{fw.NAME}.rollout.multi_lora", name):
        module = types.ModuleType(package)
        module.__path__ = []
        module.MultiLoRAAsyncDataSource = MultiLoRAAsyncDataSource
        monkeypatch.setitem(sys.modules, package, module)
    args = data_args(tmp_path, "127.0.0.1:1")
    args.multi_lora = True
    source = load_function(DATA_SOURCE)(args)
    if fw.NAME == "miles":
        assert isinstance(source, MultiLoRAAsyncDataSource)
        assert source.get_samples(1) == []
    else:
        assert isinstance(source, fw_module(fw).RolloutDataSourceWithBuffer)
