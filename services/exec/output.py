"""Bounded command output: keep the head and the tail, count what falls out of the middle.

Head bytes are passed on as they arrive (the caller streams them live); once the head budget is
spent, bytes go to a tail window of fixed size and only the newest survive until the command
ends. Memory stays bounded by the cap however much a command prints.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

STDOUT = 1
STDERR = 2


@dataclass
class OutputCap:
    max_bytes: int
    head_used: int = 0
    tail_size: int = 0
    dropped: int = 0
    _tail: deque[tuple[int, bytes]] = field(default_factory=deque)

    @property
    def head_budget(self) -> int:
        return self.max_bytes // 2

    @property
    def tail_budget(self) -> int:
        return self.max_bytes - self.head_budget

    @property
    def truncated(self) -> bool:
        return self.dropped > 0

    def feed(self, stream: int, data: bytes) -> list[tuple[int, bytes]]:
        """Takes a chunk; returns what may be sent now."""
        ready: list[tuple[int, bytes]] = []
        room = self.head_budget - self.head_used
        if room > 0:
            head, data = data[:room], data[room:]
            self.head_used += len(head)
            if head:
                ready.append((stream, head))
        if data:
            self._push_tail(stream, data)
        return ready

    def finish(self) -> list[tuple[int, bytes]]:
        """The tail window, oldest first; call once when the command has ended."""
        tail = list(self._tail)
        self._tail.clear()
        self.tail_size = 0
        return tail

    def _push_tail(self, stream: int, data: bytes) -> None:
        if len(data) >= self.tail_budget:
            self.dropped += self.tail_size + len(data) - self.tail_budget
            self._tail.clear()
            self._tail.append((stream, data[len(data) - self.tail_budget :]))
            self.tail_size = self.tail_budget
            return
        self._tail.append((stream, data))
        self.tail_size += len(data)
        while self.tail_size > self.tail_budget:
            old_stream, old = self._tail[0]
            excess = self.tail_size - self.tail_budget
            if len(old) <= excess:
                self._tail.popleft()
                self.tail_size -= len(old)
                self.dropped += len(old)
            else:
                self._tail[0] = (old_stream, old[excess:])
                self.tail_size -= excess
                self.dropped += excess
