"""CPU pools whose threads yield the processor to the event loop's thread.

A service's event loop answers every client; its CPU pool does the heavy work of one call
(rendering, tokenizing). On a busy machine the OS shares the cores among all runnable threads
alike, and the loop's thread then waits behind its own pool for tens of milliseconds while
hundreds of clients wait behind the loop. A pool made here runs its threads at a higher nice
value than the thread that made it, so whenever both are ready the loop runs first.
"""

from __future__ import annotations

import os
import sys
import threading
from concurrent.futures import ThreadPoolExecutor


def lower_thread_priority(increment: int) -> None:
    """Raises the calling thread's nice value by `increment` (at most 19). Linux gives each
    thread its own nice value; elsewhere it is the whole process's, so nothing is done there."""
    if increment <= 0 or sys.platform != "linux":
        return
    tid = threading.get_native_id()
    try:
        os.setpriority(
            os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + increment)
        )
    except OSError:  # a sandbox that forbids it: the pool still works, at the same priority
        pass


def cpu_pool(threads: int, name: str, nice: int) -> ThreadPoolExecutor:
    """A thread pool of `threads` threads named `name-N`, each `nice` steps below its maker's
    priority (0: the same)."""
    return ThreadPoolExecutor(
        threads, thread_name_prefix=name, initializer=lower_thread_priority, initargs=(nice,)
    )
