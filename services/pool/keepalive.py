"""Keeping leases alive: KeepAlive streams (watchers), renewals, and the lease tokens.

A holder watches its leases on a KeepAlive stream and renews them; each renewal moves the
lease's expiry and answers with the expiry and the (possibly re-minted) token. The node's own
expiry of the sandbox is kept ahead of the lease's by node_expiry_slack_s, so most renewals need
no node call and are answered inline; the rest renew on the node first. When a lease ends, its
watchers are told by the lifecycle (swerl.pool.state).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable

from swerl.chassis import capability
from swerl.pool.errors import NodeRejected, NodeSandboxGone, NodeUnreachable
from swerl.pool.model import Expiry, ExpiryBatch, Lease, LeaseState, LossReason, Lost, Watcher
from swerl.pool.settings import PoolSettings
from swerl.pool.state import PoolState

ACTIVE, RELEASING, ENDED = LeaseState.ACTIVE, LeaseState.RELEASING, LeaseState.ENDED
# A renewal batch yields to the loop after this many leases, so an AcquireLease arriving behind
# a holder that renews thousands of leases at once waits for one slice, not the whole batch.
RENEW_SLICE = 256


class Tokens:
    """Mints the capability tokens that nodes check on every sandbox call of a lease."""

    def __init__(self, settings: PoolSettings) -> None:
        self._settings = settings
        secret = settings.capability_secret
        self._secret = secret.get_secret_value().encode() if secret else None

    def issue(self, lease: Lease, ttl_s: float) -> None:
        """Makes the lease's token valid at least token_grace_s past its expiry.

        A new token runs ttl x token_reissue_fraction further, and renewals keep it until that
        margin is used up: minting (an HMAC) on every renewal was the largest part of a
        renewal's cost at 20,000 renewals a second.
        """
        if self._secret is None:
            return
        wanted = lease.expire_time + self._settings.token_grace_s
        if lease.token and lease.token_expire_time >= wanted:
            return
        expire = wanted + ttl_s * self._settings.token_reissue_fraction
        lease.token = capability.mint(
            self._secret, lease_id=lease.lease_id, sandbox_id=lease.sandbox_id, expire_time=expire
        )
        lease.token_expire_time = int(expire * 1000) / 1000  # What nodes read (whole ms).


class KeepAlive:
    def __init__(self, state: PoolState, tokens: Tokens) -> None:
        self._state = state
        self._settings = state.settings
        self._tokens = tokens

    def open_watcher(self) -> Watcher:
        return Watcher()

    def close_watcher(self, watcher: Watcher) -> None:
        for lease_id in watcher.leases:
            lease = self._state.leases.get(lease_id)
            if lease is not None:
                lease.watchers.discard(watcher)
        watcher.leases.clear()

    def watch(self, watcher: Watcher, lease_id: str) -> Lease | None:
        lease = self._state.leases.get(lease_id)
        if lease is None or lease.state in (RELEASING, ENDED):
            reason = lease.loss_reason if lease is not None else LossReason.NOT_FOUND
            message = lease.loss_message if lease is not None else "the pool has no such lease"
            watcher.events.put_nowait(Lost(lease_id, reason or LossReason.NOT_FOUND, message))
            return None
        watcher.leases.add(lease_id)
        lease.watchers.add(watcher)
        lease.claimed = True
        if lease.state is ACTIVE:
            watcher.events.put_nowait(Expiry(lease_id, lease.expire_time, lease.token))
        return lease

    async def renew(self, watcher: Watcher, lease_id: str, ttl_s: float) -> None:
        expiry = await self._renew(watcher, lease_id, ttl_s)
        if expiry is not None:
            watcher.events.put_nowait(expiry)

    async def renew_batch(self, watcher: Watcher, renewals: Iterable[tuple[str, float]]) -> None:
        """Renews many leases; one ExpiryBatch for those alive, a Lost for each that ended."""
        expiries: list[Expiry] = []
        slow: list[tuple[str, float]] = []
        leases, max_ttl = self._state.leases, self._settings.max_ttl_s
        margin = self._settings.node_expiry_slack_s / 2
        now = time.time()
        for count, (lease_id, ttl_s) in enumerate(renewals, 1):
            if count % RENEW_SLICE == 0:
                await asyncio.sleep(0)
                now = time.time()
            # Most renewals need no node call (the node's expiry is kept ahead): done inline.
            lease = leases.get(lease_id)
            if lease is not None and lease.state is ACTIVE:
                ttl = min(ttl_s if ttl_s > 0 else lease.ttl_s, max_ttl)
                if lease.node_expire_time >= now + ttl + margin:
                    expiries.append(self._extend(watcher, lease, ttl, now))
                    continue
            slow.append((lease_id, ttl_s))
        if slow:
            results = await asyncio.gather(*(self._renew(watcher, i, t) for i, t in slow))
            expiries.extend(e for e in results if e is not None)
        if expiries:
            watcher.events.put_nowait(ExpiryBatch(expiries))

    def _ttl(self, lease: Lease, ttl_s: float) -> float:
        return min(ttl_s if ttl_s > 0 else lease.ttl_s, self._settings.max_ttl_s)

    def _extend(
        self, watcher: Watcher, lease: Lease, ttl: float, now: float, cap: float | None = None
    ) -> Expiry:
        """Moves the lease's expiry to now + ttl (no further than `cap`), never backwards."""
        watcher.leases.add(lease.lease_id)
        lease.watchers.add(watcher)
        wanted = now + ttl
        if cap is not None:
            wanted = min(wanted, cap)
        if wanted > lease.expire_time:
            lease.expire_time = wanted
            self._tokens.issue(lease, ttl)
        return Expiry(lease.lease_id, lease.expire_time, lease.token)

    async def _renew(self, watcher: Watcher, lease_id: str, ttl_s: float) -> Expiry | None:
        lease = self._state.leases.get(lease_id)
        if lease is None or lease.state is not ACTIVE:
            self.watch(watcher, lease_id)
            return None
        cap = None
        ttl = self._ttl(lease, ttl_s)
        slack = self._settings.node_expiry_slack_s
        if lease.node_expire_time < time.time() + ttl + slack / 2:
            node = self._state.nodes.get(lease.node_id)
            try:
                if node is None:
                    raise NodeUnreachable("the lease's node is not registered")
                lease.node_expire_time = await node.conn.renew(lease.sandbox_id, ttl + slack)
            except NodeSandboxGone:
                if lease.state is ACTIVE:
                    self._state.end(
                        lease, LossReason.SANDBOX_LOST, "the node no longer has the sandbox"
                    )
                return None
            except (NodeUnreachable, NodeRejected):
                # What the node enforces is what is reported.
                cap = lease.node_expire_time
        if lease.state is not ACTIVE:
            return None
        return self._extend(watcher, lease, ttl, time.time(), cap)
