"""The exec node's side of lease capability tokens (see swerl.chassis.capability).

When the node has a capability secret (shared with its pool), every call about a sandbox
(Exec, GetDiff, Evaluate on a leased sandbox) must carry a `swerl-lease-token` minted by the pool
for that sandbox and the lease bound to it. Without a secret (a standalone node for local tools)
there is nothing to check. Raises the chassis' LeaseToken* errors, which the boundary maps.
"""

from __future__ import annotations

from typing import Any

from swerl.chassis.capability import LEASE_TOKEN_METADATA_KEY, check
from swerl.exec.sandboxes import SandboxManager


def require_lease_token(manager: SandboxManager, context: Any, sandbox_id: str) -> None:
    """Checks the call's lease token for `sandbox_id`; a no-op when the node has no secret."""
    secret = manager.settings.capability_secret
    if secret is None:
        return
    token = None
    for key, value in context.invocation_metadata() or ():
        if key == LEASE_TOKEN_METADATA_KEY:
            token = value
            break
    record = manager._records.get(sandbox_id)
    check(
        secret.get_secret_value().encode(),
        token,
        sandbox_id=sandbox_id,
        bound_lease_id=record.lease_id if record is not None else None,
    )
