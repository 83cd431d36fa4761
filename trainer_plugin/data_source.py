"""A data source that prefetches the task images of the batches the rollout is about to run.

    --data-source-path swerl.trainer_plugin.data_source.PrefetchingDataSource

slime and miles build their rollout data source from `--data-source-path` (a class, called
with `args`; default `<framework>.rollout.data_source.RolloutDataSourceWithBuffer`) and fetch
each rollout's prompt groups with `get_samples(num_samples)` before they create the batch's
generate calls. That is the first moment the trainer sees which tasks run next, well before the
generate calls, which the framework starts together but admits behind a semaphore. So here,
each time a batch is fetched:

- the images of the whole fetched batch go to the pool's `PrefetchImages` at once (the generate
  calls behind the semaphore get a head start of one episode or more), and
- the images of the rows the data source will hand out next (`prefetch_next_batches` batches,
  each at least a rollout batch of prompts: the partial groups in its buffer first, then the
  dataset rows after its offset) go in the same call, so the next batch's pulls overlap the
  current batch's episodes. At the end of a shuffled epoch the rows of the next epoch are not
  known yet (the framework shuffles them when the epoch starts), so the look-ahead stops there;
  without `--rollout-shuffle` it wraps around to the first rows.

`PrefetchingDataSource(args)` returns an instance of a subclass of the framework's default data
source (miles under multi-LoRA: its `MultiLoRAAsyncDataSource`, the class miles itself swaps in
when `--data-source-path` is left alone; or `data_source_base`), so everything else — the
buffer of partial rollouts, save / load, `len()`, `.dataset` — is the framework's own. The
images are those `generate` uses (the same rule, instance.py). Prefetch is advice: it goes
through the same per-process prefetcher as the generate hook (one `PrefetchImages` per
`prefetch_delay_s` window; an image is sent once per few minutes), and nothing that goes wrong
with it fails a fetch (logged once). Off, and a plain framework data source, unless
`pool_address` is set.
"""

from __future__ import annotations

import asyncio
import importlib
import threading
from collections.abc import Iterable, Sequence
from typing import Any

import structlog

from swerl.exec.sweinstance import InstanceError, sample_instance
from swerl.trainer_plugin import framework
from swerl.trainer_plugin.prefetch import Prefetcher, prefetcher
from swerl.trainer_plugin.settings import PluginSettings, plugin_settings

_log = structlog.get_logger("swerl.trainer_plugin")


class PrefetchingDataSource:
    """`--data-source-path` target: builds the framework's default data source (or the class
    `data_source_base` names) with image prefetch on every `get_samples`."""

    def __new__(cls, args: Any) -> Any:
        base = base_class(plugin_settings(args), args)
        return prefetching_class(base)(args)


def base_class(settings: PluginSettings, args: Any = None) -> type:
    """The data source class to extend: `data_source_base`, else the one the framework uses by
    default for these `args` (miles under multi-LoRA: its MultiLoRAAsyncDataSource)."""
    if settings.data_source_base:
        module_name, _, name = settings.data_source_base.rpartition(".")
        found = getattr(importlib.import_module(module_name), name)
        if not isinstance(found, type):
            raise TypeError(f"data_source_base {settings.data_source_base!r} is not a class")
        return found
    return framework.default_data_source_class(framework.find(settings.framework), args)


_classes: dict[type, type] = {}


def prefetching_class(base: type) -> type:
    """`base` with `get_samples` prefetching the images of the fetched and the next batches."""
    found = _classes.get(base)
    if found is None:
        name = f"Prefetching{base.__name__}"
        found = _classes[base] = type(name, (PrefetchOnFetch, base), {"__module__": __name__})
    return found


class PrefetchOnFetch:
    """The mixin: the base's `get_samples`, then the prefetch (which never raises)."""

    args: Any
    _swerl_prefetch_warned = False

    def get_samples(self, num_samples: int) -> Any:
        groups = super().get_samples(num_samples)  # type: ignore[misc]
        try:
            settings = plugin_settings(self.args)
            if settings.pool_address:
                current = images_of(_flat(groups))
                ahead = lookahead(self.args, settings, num_samples)
                upcoming = images_of(upcoming_rows(self, ahead)) if ahead else []
                send(settings, [*current, *upcoming])
                _log.info(
                    "prefetch.fetched_batch",
                    groups=len(groups),
                    images=len(current),
                    next_images=len(set(upcoming) - set(current)),
                )
        except Exception as exc:  # Advice only: a fetch never fails because of it.
            if not self._swerl_prefetch_warned:
                self._swerl_prefetch_warned = True
                _log.warning("prefetch.data_source_failed", error=repr(exc))
        return groups


def lookahead(args: Any, settings: PluginSettings, num_samples: int) -> int:
    """How many rows after the fetched batch to prefetch: `prefetch_next_batches` batches, each
    the size of this fetch but at least a rollout batch (fully-async rollouts fetch one group
    at a time)."""
    batch = max(
        num_samples,
        int(getattr(args, "rollout_batch_size", 0) or 0),
        int(getattr(args, "over_sampling_batch_size", 0) or 0),
    )
    return settings.prefetch_next_batches * batch


def upcoming_rows(source: Any, count: int) -> list[Any]:
    """Up to `count` rows (samples) the data source hands out next, read without changing it:
    the groups left in its buffer (the framework's default pops them first), then the dataset
    rows from its offset on; past the end of the epoch only when the order is not reshuffled."""
    rows: list[Any] = []
    buffer = getattr(source, "buffer", None)
    if isinstance(buffer, list):
        for group in buffer[:count]:
            rows.extend(_flat([group])[:1])
    dataset = getattr(source, "dataset", None)
    samples = getattr(dataset, "samples", None)
    offset = getattr(source, "sample_offset", None)
    if not isinstance(samples, Sequence) or not isinstance(offset, int):
        return rows
    need = count - len(rows)
    if need > 0:
        rows.extend(samples[offset : offset + need])
    need = count - len(rows)
    if need > 0 and not getattr(getattr(source, "args", None), "rollout_shuffle", False):
        rows.extend(samples[: min(need, offset)])
    return rows


def images_of(samples: Iterable[Any]) -> list[str]:
    """The distinct task images of `samples`, in order (rows without a usable instance are
    skipped: their generate call reports them)."""
    images: dict[str, None] = {}
    for sample in samples:
        try:
            image = sample_instance(getattr(sample, "metadata", None), "").image_name
        except InstanceError:
            continue
        if image:
            images[image] = None
    return list(images)


def send(settings: PluginSettings, images: list[str]) -> None:
    """Hands `images` to this process's prefetcher (the one the generate hook uses) on the
    running event loop — slime and miles fetch batches inside their rollout coroutine — or, with
    no loop running, sends them from a short-lived thread."""
    if not images:
        return
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        threading.Thread(target=_send_blocking, args=(settings, images), daemon=True).start()
        return
    found = prefetcher(settings)
    if found is not None:
        for image in images:
            found.add(image)


def _send_blocking(settings: PluginSettings, images: list[str]) -> None:
    async def once() -> None:
        token = settings.pool_token.get_secret_value() if settings.pool_token else None
        one = Prefetcher(settings.pool_address, token, 0.0)
        for image in images:
            one.add(image)
        await one.close()

    try:
        asyncio.run(once())
    except Exception as exc:  # Advice only.
        _log.warning("prefetch.failed", images=len(images), error=repr(exc))


def _flat(groups: Iterable[Any]) -> list[Any]:
    out: list[Any] = []
    for item in groups:
        if isinstance(item, list):
            out.extend(_flat(item))
        else:
            out.append(item)
    return out
