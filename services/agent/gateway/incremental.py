"""Per-session incremental reading of the history a client re-sends with every call.

A harness re-sends its whole conversation each call, so decoding the JSON, converting the
messages and hashing them grows with the history. Three caches, one per session and protocol,
keep each call's Python work proportional to its new messages:

- BodyReader: the request body's bytes are compared (memcmp, no copy) with the previous body's;
  the messages whose JSON lies wholly in the common prefix are taken from the previous decode,
  and only the bytes after them are decoded.
- MessageMemo: a raw message that is the very object of the previous request (so it came from
  that byte-identical prefix) keeps its converted message(s) and match key(s). Identity, not
  equality: `{"flag": true}` and `{"flag": 1}` are equal Python dicts and render differently.
- DigestMemo: the rolling digests of an unchanged key prefix are kept.

Each cache holds one immutable snapshot, swapped whole at the end of a read: two calls of one
session read concurrently (in the CPU pool) at worst miss the cache, never mix states. Any body
the incremental parser does not take (bad JSON, another encoding) goes to json.loads, whose
result and error are the reference.
"""

from __future__ import annotations

import hashlib
import json
import operator
import re
from collections.abc import Callable, Sequence
from typing import Any

_WS = re.compile(r"[ \t\n\r]*")
_BOM = b"\xef\xbb\xbf"
_DECODER = json.JSONDecoder()


class _Unparsed(Exception):
    """The incremental parser declines this body (json.loads decides)."""


class NestedTooDeep(ValueError):
    """The body nests arrays and objects deeper than the JSON decoder goes (Python's recursion
    limit, ~1,000 levels): refused as a bad body, not a failure of the gateway."""

    def __init__(self) -> None:
        super().__init__("the request body nests arrays or objects too deeply")


def _skip(text: str, pos: int) -> int:
    match = _WS.match(text, pos)
    assert match is not None
    return match.end()


def _value(text: str, pos: int) -> tuple[Any, int]:
    try:
        return _DECODER.raw_decode(text, pos)
    except ValueError as err:
        raise _Unparsed from err


def _expect(text: str, pos: int, char: str) -> int:
    if text[pos : pos + 1] != char:
        raise _Unparsed
    return pos + 1


# The previous body: its bytes, the members before "messages" (decoded), the decoded messages and
# the byte offset where each message's JSON ends.
_BodyState = tuple[bytes, dict[str, Any], list[Any], list[int]]


class BodyReader:
    """Decodes one session's request bodies (a top-level object with a "messages" array).

    The unchanged prefix is found on the bytes (`bytes.startswith` over a memoryview of the
    previous body: one memcmp, no copy) and only the bytes after it are decoded to text: a
    history's re-sent part costs a compare, not a UTF-8 decode, two slices and a compare."""

    def __init__(self) -> None:
        self._state: _BodyState | None = None
        self.reused_messages = 0  # of the last read: messages taken from the previous decode

    def decode(self, raw: bytes) -> Any:
        # A UTF-8 byte order mark is no part of the JSON text (RFC 8259 lets a parser ignore
        # it); without it the body reads, and is reused, like one sent without.
        if raw.startswith(_BOM):
            raw = raw[len(_BOM) :]
        try:
            resume = self._resume(raw)
            start = resume[2][-1] if resume is not None else 0
            text = raw[start:].decode("utf-8") if start else raw.decode("utf-8")
            body, state = self._parse(raw, text, start, resume)
        except (_Unparsed, UnicodeDecodeError):
            # The previous body stays the reference: one bad request spoils no later reuse.
            self.reused_messages = 0
            try:
                return json.loads(raw)  # the reference answer, or its error
            except RecursionError as err:
                raise NestedTooDeep from err
        except RecursionError as err:
            self.reused_messages = 0
            raise NestedTooDeep from err
        self._state = state
        return body

    def _resume(self, raw: bytes) -> tuple[dict[str, Any], list[Any], list[int]] | None:
        """The previous body's head and the longest run of messages whose bytes are unchanged."""
        state = self._state
        if state is None or not state[3]:
            return None
        old, head, messages, ends = state
        view = memoryview(old)
        lo, hi = 0, len(ends)
        if raw.startswith(view[: ends[-1]]):
            lo = hi
        else:  # prefix equality is monotone in the offset: binary search the last equal end
            hi -= 1
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if raw.startswith(view[: ends[mid - 1]]):
                    lo = mid
                else:
                    hi = mid - 1
        if lo == 0:
            return None
        return head, messages[:lo], ends[:lo]

    def _parse(
        self,
        raw: bytes,
        text: str,
        start: int,
        resume: tuple[dict[str, Any], list[Any], list[int]] | None,
    ) -> tuple[Any, _BodyState]:
        """Parse `text`, the body's bytes from `start` on (0, or the end of the last reused
        message). Message ends are recorded as offsets into `text` and turned into byte
        offsets at the end."""
        head: dict[str, Any] = {}
        messages: list[Any] = []
        ends: list[int] = []
        body: dict[str, Any]
        if resume is None:
            self.reused_messages = 0
            pos = _expect(text, _skip(text, 0), "{")
            body = {}
            pos = _skip(text, pos)
            if text[pos : pos + 1] == "}":
                return self._finish(raw, text, start, pos + 1, body, head, messages, [], ends)
            in_messages = False
            kept: list[int] = []
        else:
            head, messages, kept = dict(resume[0]), list(resume[1]), resume[2]
            self.reused_messages = len(messages)
            body = dict(head)
            body["messages"] = messages
            pos = 0
            in_messages = True
        while True:
            if in_messages:
                pos = self._messages(text, pos, messages, ends)
                in_messages = False
            else:
                pos = _skip(text, pos)
                if text[pos : pos + 1] != '"':
                    raise _Unparsed
                key, pos = _value(text, pos)
                pos = _skip(text, _expect(text, _skip(text, pos), ":"))
                if key == "messages" and "messages" not in body and text[pos : pos + 1] == "[":
                    head = dict(body)
                    body["messages"] = messages
                    pos = _skip(text, pos + 1)
                    if text[pos : pos + 1] == "]":
                        pos += 1
                    else:
                        item, pos = _value(text, pos)
                        messages.append(item)
                        ends.append(pos)
                        in_messages = True
                        continue
                else:
                    body[key], pos = _value(text, pos)
            pos = _skip(text, pos)
            if text[pos : pos + 1] == ",":
                pos += 1
                continue
            pos = _expect(text, pos, "}")
            return self._finish(raw, text, start, pos, body, head, messages, kept, ends)

    @staticmethod
    def _messages(text: str, pos: int, messages: list[Any], ends: list[int]) -> int:
        """The rest of the messages array after the element ending at `pos`; past its `]`."""
        while True:
            pos = _skip(text, pos)
            if text[pos : pos + 1] == "]":
                return pos + 1
            pos = _skip(text, _expect(text, pos, ","))
            item, pos = _value(text, pos)
            messages.append(item)
            ends.append(pos)

    @staticmethod
    def _finish(
        raw: bytes,
        text: str,
        start: int,
        pos: int,
        body: dict[str, Any],
        head: dict[str, Any],
        messages: list[Any],
        kept: list[int],
        ends: list[int],
    ) -> tuple[Any, _BodyState]:
        """`kept`: byte offsets of the reused messages' ends; `ends`: offsets into `text` of
        the messages decoded now."""
        if _skip(text, pos) != len(text):
            raise _Unparsed  # extra data: json.loads words the error
        return body, (raw, head, messages, [*kept, *_byte_offsets(text, start, ends)])


def _byte_offsets(text: str, start: int, ends: Sequence[int]) -> list[int]:
    """Offsets into `text` as offsets into the UTF-8 body it was decoded from at `start`."""
    if text.isascii():  # one byte per character (a flag of the string: no scan)
        return [start + end for end in ends]
    out, at, byte = [], 0, start
    for end in ends:
        byte += len(text[at:end].encode("utf-8"))
        out.append(byte)
        at = end
    return out


# One converted raw message: the chat-template messages it became and their match keys.
Group = list[tuple[dict[str, Any], bytes]]


def _common(old: Sequence[bytes], new: Sequence[bytes]) -> int:
    """How many leading keys of `new` equal those of `old` (bytes: equal means the same bytes).
    The whole of `old` is tried first with one list comparison (a C loop that takes identical
    items at once)."""
    n = len(old)
    if n <= len(new) and new[:n] == old:
        return n
    k = 0
    for a, b in zip(old, new, strict=False):
        if a != b:
            break
        k += 1
    return k


def _same_objects(old: Sequence[Any], new: Sequence[Any]) -> int:
    """How many leading items of `new` are the very objects of `old` (identity, never `==`:
    decoded JSON values that JSON tells apart compare equal in Python, `True == 1 == 1.0`,
    `0.0 == -0.0`, dicts whatever their key order; only BodyReader's reuse of a byte-identical
    prefix hands the same objects back)."""
    n = len(old)
    if n <= len(new) and all(map(operator.is_, old, new)):
        return n
    k = 0
    for a, b in zip(old, new, strict=False):
        if a is not b:
            break
        k += 1
    return k


class MessageMemo:
    """Converted messages of the previous request, reused for the very same raw objects."""

    def __init__(self) -> None:
        # Raw messages, the chat-template messages and keys they became, and where each raw
        # message's messages start in those lists.
        self._state: tuple[list[Any], list[dict[str, Any]], list[bytes], list[int]] = (
            [],
            [],
            [],
            [0],
        )

    def convert(
        self, raw_messages: Sequence[Any], one: Callable[[Any, int], Group]
    ) -> tuple[list[dict[str, Any]], list[bytes]]:
        old_raw, old_messages, old_keys, old_starts = self._state
        k = _same_objects(old_raw, raw_messages)
        messages, keys, starts = (
            old_messages[: old_starts[k]],
            old_keys[: old_starts[k]],
            old_starts[: k + 1],
        )
        for i in range(k, len(raw_messages)):
            for message, key in one(raw_messages[i], i):
                messages.append(message)
                keys.append(key)
            starts.append(len(messages))
        self._state = (list(raw_messages), messages, keys, starts)
        return list(messages), list(keys)


class DigestMemo:
    """Rolling digests (entry i identifies seed + keys[: i + 1]), kept for an unchanged prefix
    of keys (the same key objects, so no byte is compared twice)."""

    def __init__(self) -> None:
        self._state: tuple[bytes, list[bytes], list[bytes]] = (b"", [], [])

    def digests(self, seed: bytes, keys: Sequence[bytes]) -> list[bytes]:
        old_seed, old_keys, old_digests = self._state
        k = _common(old_keys, keys) if seed == old_seed else 0
        out = old_digests[:k]
        digest = out[-1] if out else hashlib.blake2b(seed, digest_size=16).digest()
        for key in keys[k:]:
            digest = roll(digest, key)
            out.append(digest)
        self._state = (seed, list(keys), out)
        return list(out)


def roll(previous: bytes, key: bytes) -> bytes:
    """The digest of a message list from its prefix's digest and the next message's key (fed
    in two parts, the digest of their concatenation without copying a long key)."""
    digest = hashlib.blake2b(previous, digest_size=16)
    digest.update(key)
    return digest.digest()
