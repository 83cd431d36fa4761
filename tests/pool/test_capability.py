"""Lease capability tokens: minted by the pool, checked by nodes with the shared secret only."""

from __future__ import annotations

import time

import pytest

from swerl.chassis import capability

SECRET = b"shared-secret"


def token(**overrides) -> str:
    fields = {"lease_id": "lse-1", "sandbox_id": "sbx-1", "expire_time": time.time() + 60}
    fields.update(overrides)
    return capability.mint(SECRET, **fields)


def test_genuine_token_names_its_lease_sandbox_and_expiry():
    expire = time.time() + 60
    claims = capability.check(
        SECRET, token(expire_time=expire), sandbox_id="sbx-1", bound_lease_id="lse-1"
    )
    assert (claims.lease_id, claims.sandbox_id) == ("lse-1", "sbx-1")
    assert abs(claims.expire_time - expire) < 0.002


@pytest.mark.parametrize(
    ("presented", "error", "code"),
    [
        (None, capability.LeaseTokenMissing, "UNAUTHENTICATED"),
        ("", capability.LeaseTokenMissing, "UNAUTHENTICATED"),
        ("v1.a.b", capability.LeaseTokenInvalid, "UNAUTHENTICATED"),
        ("v2.lse-1.sbx-1.1.sig", capability.LeaseTokenInvalid, "UNAUTHENTICATED"),
    ],
)
def test_missing_or_malformed_tokens_are_refused(presented, error, code):
    with pytest.raises(error) as caught:
        capability.check(SECRET, presented, sandbox_id="sbx-1", bound_lease_id="lse-1")
    assert caught.value.code == code


def test_token_signed_with_another_secret_is_invalid():
    forged = capability.mint(b"other", lease_id="lse-1", sandbox_id="sbx-1", expire_time=2e9)
    with pytest.raises(capability.LeaseTokenInvalid):
        capability.check(SECRET, forged, sandbox_id="sbx-1", bound_lease_id="lse-1")


def test_tampered_expiry_breaks_the_signature():
    parts = token().split(".")
    parts[3] = str(int(parts[3]) + 3_600_000)
    with pytest.raises(capability.LeaseTokenInvalid):
        capability.check(SECRET, ".".join(parts), sandbox_id="sbx-1", bound_lease_id="lse-1")


def test_expired_token_is_refused():
    with pytest.raises(capability.LeaseTokenExpired) as caught:
        capability.check(
            SECRET, token(expire_time=time.time() - 1), sandbox_id="sbx-1", bound_lease_id=None
        )
    assert (caught.value.code, caught.value.reason) == ("UNAUTHENTICATED", "LEASE_TOKEN_EXPIRED")


def test_token_for_another_sandbox_or_lease_is_foreign():
    with pytest.raises(capability.LeaseTokenForeign) as caught:
        capability.check(SECRET, token(), sandbox_id="sbx-2", bound_lease_id="lse-1")
    assert caught.value.code == "PERMISSION_DENIED"
    with pytest.raises(capability.LeaseTokenForeign):
        capability.check(SECRET, token(), sandbox_id="sbx-1", bound_lease_id="lse-9")
