"""The exec node's side of lease capability tokens (see swerl.chassis.capability).

When the node has a capability secret (shared with its pool), every call about a sandbox
(Exec, ExecCommands, GetDiff, Evaluate on a leased sandbox) must carry a `swerl-lease-token`
minted by the pool for that sandbox and the lease bound to it; `SandboxManager.check_lease_token`
checks it. Without a secret (a standalone node for local tools) there is nothing to check. This
module only reads the token from a call's metadata.
"""

from __future__ import annotations

from typing import Any

from swerl.chassis.capability import LEASE_TOKEN_METADATA_KEY
from swerl.exec.sandboxes import SandboxManager


def lease_token(manager: SandboxManager, context: Any) -> str | None:
    """The call's lease token; None when it has none or the node checks none (nothing read)."""
    if not manager.checks_lease_tokens:
        return None
    for key, value in context.invocation_metadata() or ():
        if key == LEASE_TOKEN_METADATA_KEY:
            return str(value)
    return None


def require_lease_token(manager: SandboxManager, context: Any, sandbox_id: str) -> None:
    """Checks the call's lease token for `sandbox_id`; a no-op when the node has no secret."""
    manager.check_lease_token(sandbox_id, lease_token(manager, context))
