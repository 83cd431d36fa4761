"""A session's call tree: each recorded policy call is a node whose prompt is exactly its parent's
prompt and sampled ids plus the rendered tokens in between; each root-to-leaf path is a chain and
becomes one token record.

A node is found two ways: by the digest of the messages up to and including the model's reply
(a client echoing its history), and, for a history that matched no digest, by its ids extending a
node's ids (a client that rewrote its messages to the same tokens). A call that extends a node
which already has a child forks: the history was rewritten after that node (compaction, a
retried turn, a sub-agent started from it).
"""

from __future__ import annotations

import enum
import time
from array import array
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from swerl.agent.policy.tokens import TokenRecordData

# Ids at the end of a parent's tokens that a child's prompt is checked against when recorded.
_SEAM = 16


class CallKind(enum.Enum):
    ROOT = "root"
    EXTEND = "extend"
    FORK = "fork"


@dataclass(eq=False)
class CallNode:
    """One recorded policy call."""

    index: int
    parent: CallNode | None
    kind: CallKind
    protocol: str
    prompt_ids: array[int]
    output_ids: array[int]
    logprobs: array[float]
    finish_reason: str
    weight_version: str
    reused_tokens: int
    tool_calls: int
    # Messages the request carried, and those rendered for it (all of them for a root; those
    # after the continued call's reply otherwise): where and how far a fork rewrote history.
    request_messages: int = 0
    rendered_messages: int = 0
    end_time: float = field(default_factory=time.time)
    children: list[CallNode] = field(default_factory=list)

    def token_count(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    def extended(self, ids: Sequence[int]) -> array[int]:
        """A child's prompt: this call's prompt and sampled ids, then `ids` (one copy of the
        history, no comparison: such a prompt extends this call by construction)."""
        # The short tail first, then one allocation and copy of the long prompt.
        return self.prompt_ids + (self.output_ids + array("i", ids))

    def path(self) -> list[CallNode]:
        out: list[CallNode] = []
        node: CallNode | None = self
        while node is not None:
            out.append(node)
            node = node.parent
        out.reverse()
        return out


class CallTree:
    """The recorded calls of one session. Mutated on the event loop only."""

    def __init__(self) -> None:
        self.calls: list[CallNode] = []
        self._by_digest: dict[bytes, CallNode] = {}

    def find(self, digest: bytes) -> CallNode | None:
        return self._by_digest.get(digest)

    def longest_token_prefix(self, ids: array[int]) -> CallNode | None:
        """The call with the most ids that are a prefix of `ids` (memcmp per call)."""
        best: CallNode | None = None
        for node in self.calls:
            n = node.token_count()
            if n < len(ids) and (best is None or n > best.token_count()):
                if ids[: len(node.prompt_ids)] == node.prompt_ids and (
                    ids[len(node.prompt_ids) : n] == node.output_ids
                ):
                    best = node
        return best

    def add(
        self,
        parent: CallNode | None,
        *,
        protocol: str,
        prompt_ids: array[int],
        output_ids: array[int],
        logprobs: array[float],
        finish_reason: str,
        weight_version: str,
        reused_tokens: int,
        tool_calls: int,
        digest: bytes | None,
        request_messages: int = 0,
        rendered_messages: int = 0,
    ) -> CallNode:
        if parent is None:
            kind = CallKind.ROOT
        else:
            # The caller built the prompt as parent.extended(...) or found the parent as its
            # token prefix (longest_token_prefix compares every id): here only the seam is
            # checked, in time independent of the history (a whole compare was an O(history)
            # copy and compare on the event loop every call).
            n = parent.token_count()
            seam = parent.output_ids[-_SEAM:] if parent.output_ids else parent.prompt_ids[-_SEAM:]
            if len(prompt_ids) < n or prompt_ids[n - len(seam) : n] != seam:
                raise AssertionError("a call's prompt does not extend its parent's tokens")
            kind = CallKind.FORK if parent.children else CallKind.EXTEND
        node = CallNode(
            index=len(self.calls),
            parent=parent,
            kind=kind,
            protocol=protocol,
            prompt_ids=prompt_ids,
            output_ids=output_ids,
            logprobs=logprobs,
            finish_reason=finish_reason,
            weight_version=weight_version,
            reused_tokens=reused_tokens,
            tool_calls=tool_calls,
            request_messages=request_messages,
            rendered_messages=rendered_messages,
        )
        if parent is not None:
            parent.children.append(node)
        self.calls.append(node)
        if digest is not None:
            # A later identical reply (a retried call) keeps the first: both extend one history.
            self._by_digest.setdefault(digest, node)
        return node

    def leaves(self) -> Iterator[CallNode]:
        return (node for node in self.calls if not node.children)


def chain_records(tree: CallTree, calls: int) -> list[TokenRecordData]:
    """One record per root-to-leaf chain of the first `calls` calls (those recorded when the
    session ended: this may run in the CPU pool while a late call is added on the loop), leaves
    in the order they were recorded. A call shared by several chains is trained (mask 1) in the
    first of them only, masked 0 elsewhere."""
    trained: set[int] = set()
    records = []
    nodes = tree.calls[:calls]
    for leaf in (n for n in nodes if not any(c.index < calls for c in n.children)):
        path = leaf.path()
        record = TokenRecordData(prompt_ids=path[0].prompt_ids.tolist())
        previous: CallNode | None = None
        for node in path:
            if previous is not None:
                between = node.prompt_ids[previous.token_count() :]
                record.response_ids += between
                record.loss_mask += [0] * len(between)
                record.logprobs += [0.0] * len(between)
            own = node.index not in trained
            trained.add(node.index)
            record.response_ids += node.output_ids
            record.loss_mask += [1 if own else 0] * len(node.output_ids)
            record.logprobs += node.logprobs if own else [0.0] * len(node.output_ids)
            if node.weight_version:
                record.weight_versions.append(node.weight_version)
            previous = node
        records.append(record)
    return records
