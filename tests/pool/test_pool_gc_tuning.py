"""`swerl pool serve` tunes the garbage collector of its process once the pool has started."""

from __future__ import annotations

import gc

from swerl.pool.server import tune_garbage_collector
from swerl.pool.settings import PoolSettings


def test_pool_process_freezes_its_start_up_heap_and_collects_the_middle_generation_less():
    before = gc.get_threshold()
    try:
        tune_garbage_collector(PoolSettings(insecure=True, gc_middle_threshold=100))
        assert gc.get_freeze_count() > 0
        assert gc.get_threshold() == (before[0], 100, before[2])
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)


def test_zero_middle_threshold_keeps_the_collector_thresholds():
    before = gc.get_threshold()
    try:
        tune_garbage_collector(PoolSettings(insecure=True, gc_middle_threshold=0))
        assert gc.get_threshold() == before
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)
