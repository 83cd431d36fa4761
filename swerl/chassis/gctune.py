"""Garbage-collector tuning for long-running services with large, long-lived heaps.

Python's cyclic collector walks every tracked object of a generation while the event loop waits.
A service that holds a big heap for its whole life (the pool's lease table, the agent's tokenizer
and hundreds of episodes) pays that walk on every full collection, and finds nothing: its
objects are freed by reference counting. `tune_collector` freezes what exists now (the start-up
heap: modules, descriptors, tokenizers) out of every later collection, and spaces the middle
and/or full collections further apart than Python's default of 10.
"""

from __future__ import annotations

import gc


def tune_collector(*, middle_every: int = 0, full_every: int = 0) -> None:
    """Freezes the current heap; `middle_every` young collections between two middle ones and
    `full_every` middle collections between two full ones (0 keeps Python's setting)."""
    gc.freeze()
    young, middle, full = gc.get_threshold()
    gc.set_threshold(young, middle_every or middle, full_every or full)
