"""Lease capability tokens: minted by the pool, checked by exec nodes, with no call between them.

A token names one lease, one sandbox and an expiry, and carries an HMAC-SHA256 of the three under
a secret the pool and its nodes share. A node that holds the secret checks a token on its own:
the sandbox must be the one asked about, the lease the one bound to it, the expiry in the future.
Renewals mint new tokens; old ones simply run out. No grpc here: the pool and nodes both import it.

    token = mint(secret, lease_id="lse-1", sandbox_id="sbx-1", expire_time=time.time() + 60)
    claims = verify(secret, token)   # raises CapabilityError subclasses
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import time
from dataclasses import dataclass

from swerl.chassis.errors import PermissionDenied, Unauthenticated

LEASE_TOKEN_METADATA_KEY = "swerl-lease-token"
_VERSION = "v1"


class LeaseTokenMissing(Unauthenticated):
    """A call about a sandbox carried no `swerl-lease-token` metadata."""

    reason = "LEASE_TOKEN_MISSING"


class LeaseTokenInvalid(Unauthenticated):
    """The token is malformed or its signature does not match (wrong secret, tampered)."""

    reason = "LEASE_TOKEN_INVALID"


class LeaseTokenExpired(Unauthenticated):
    """The token was genuine but its expiry has passed; renew the lease for a fresh one."""

    reason = "LEASE_TOKEN_EXPIRED"


class LeaseTokenForeign(PermissionDenied):
    """A genuine token for another sandbox, or for a lease the sandbox is not bound to."""

    reason = "LEASE_TOKEN_FOREIGN"


@dataclass(frozen=True)
class Claims:
    lease_id: str
    sandbox_id: str
    expire_time: float


def _signature(secret: bytes, lease_id: str, sandbox_id: str, expire_ms: int) -> str:
    message = f"{_VERSION}|{lease_id}|{sandbox_id}|{expire_ms}".encode()
    digest = hmac.new(secret, message, hashlib.sha256).digest()
    return base64.urlsafe_b64encode(digest).rstrip(b"=").decode()


def mint(secret: bytes, *, lease_id: str, sandbox_id: str, expire_time: float) -> str:
    """A token for `sandbox_id` under `lease_id`, valid until `expire_time` (unix seconds)."""
    expire_ms = int(expire_time * 1000)
    signature = _signature(secret, lease_id, sandbox_id, expire_ms)
    return f"{_VERSION}.{lease_id}.{sandbox_id}.{expire_ms}.{signature}"


def verify(secret: bytes, token: str | None, *, now: float | None = None) -> Claims:
    """The claims of a genuine, unexpired token; raises LeaseToken* otherwise."""
    if not token:
        raise LeaseTokenMissing(f"calls about a leased sandbox need '{LEASE_TOKEN_METADATA_KEY}'")
    parts = token.split(".")
    if len(parts) != 5 or parts[0] != _VERSION or not parts[3].isdigit():
        raise LeaseTokenInvalid("the lease token is malformed")
    _, lease_id, sandbox_id, expire_text, signature = parts
    expected = _signature(secret, lease_id, sandbox_id, int(expire_text))
    # compare_digest keeps the comparison time independent of where the signatures differ.
    if not hmac.compare_digest(expected.encode(), signature.encode()):
        raise LeaseTokenInvalid("the lease token's signature does not match")
    expire_time = int(expire_text) / 1000
    if expire_time <= (time.time() if now is None else now):
        raise LeaseTokenExpired("the lease token has expired; renew the lease", lease_id=lease_id)
    return Claims(lease_id, sandbox_id, expire_time)


def check(
    secret: bytes, token: str | None, *, sandbox_id: str, bound_lease_id: str | None
) -> Claims:
    """`verify`, then that the token is for this sandbox and the lease bound to it (if any)."""
    claims = verify(secret, token)
    if claims.sandbox_id != sandbox_id or (bound_lease_id and claims.lease_id != bound_lease_id):
        raise LeaseTokenForeign(
            "the lease token is for another sandbox or lease", sandbox_id=sandbox_id
        )
    return claims
