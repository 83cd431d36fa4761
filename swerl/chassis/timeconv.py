"""Seconds (float) to and from google.protobuf Duration and Timestamp, for every servicer."""

from __future__ import annotations

from google.protobuf import duration_pb2, timestamp_pb2


def duration_pb(seconds: float) -> duration_pb2.Duration:
    d = duration_pb2.Duration()
    d.FromNanoseconds(int(seconds * 1e9))
    return d


def seconds_of(d: duration_pb2.Duration) -> float:
    return d.seconds + d.nanos / 1e9


def timestamp_pb(unix_seconds: float) -> timestamp_pb2.Timestamp:
    ts = timestamp_pb2.Timestamp()
    ts.FromNanoseconds(int(unix_seconds * 1e9))
    return ts
