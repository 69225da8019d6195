"""Organizations, users and API keys: the operations behind ``twinkle keys`` / ``twinkle orgs`` and
the admin API.

Owns name validation, "create if missing" for orgs and users, minting keys (the plaintext is
returned once; the DB keeps the sha256 digest and the display prefix), revocation, and the audit
events these changes write. Every function flushes; the caller commits.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from sqlmodel import Session, select

from gateway.accounts.audit import record_event
from gateway.accounts.keys import (
    MAX_USER_NAME_LEN,
    SCOPE_ADMIN,
    SCOPE_USER,
    digest_key,
    display_prefix,
    generate_api_key,
)
from gateway.db.tables import ApiKeyRow, OrganizationRow, UserRow, utcnow
from gateway.errors import InvalidRequestError, NotFoundError

DEFAULT_ORG = "default"
SCOPES = (SCOPE_USER, SCOPE_ADMIN)


def clean_name(name: str, field: str) -> str:
    value = (name or "").strip()
    if not value or len(value) > MAX_USER_NAME_LEN or not value.isprintable():
        raise InvalidRequestError(f"{field}: must be 1-{MAX_USER_NAME_LEN} printable characters")
    return value


def find_org(session: Session, name: str) -> OrganizationRow | None:
    return session.exec(select(OrganizationRow).where(OrganizationRow.name == name)).first()


def ensure_org(session: Session, name: str | None) -> OrganizationRow:
    """The organization called ``name`` (default "default"), created if missing."""
    org_name = clean_name(name or DEFAULT_ORG, "org")
    org = find_org(session, org_name)
    if org is None:
        org = OrganizationRow(name=org_name)
        session.add(org)
        session.flush()
        record_event(session, "organization_created", org_id=org.id, details={"name": org_name})
    return org


def ensure_user(
    session: Session, user_name: str, *, org_name: str | None = None, admin: bool = False
) -> UserRow:
    """User ``user_name``, created in ``org_name`` if missing. An existing user keeps its
    organization (asking for another one is an error); asking for admin promotes, never demotes."""
    name = clean_name(user_name, "user")
    user = session.exec(select(UserRow).where(UserRow.name == name)).first()
    if user is None:
        org = ensure_org(session, org_name)
        user = UserRow(name=name, is_admin=admin, org_id=org.id)
        session.add(user)
        session.flush()
        record_event(session, "user_created", org_id=org.id, details={"user": name})
        return user
    if user.org_id is None:  # a user from before organizations existed
        user.org_id = ensure_org(session, org_name).id
    elif org_name is not None:
        org = find_org(session, org_name.strip())
        if org is None or org.id != user.org_id:
            raise InvalidRequestError(f"org: user {name!r} already exists in another organization")
    if admin and not user.is_admin:
        user.is_admin = True
    session.add(user)
    session.flush()
    return user


def create_key(
    session: Session,
    user_id: int,
    *,
    scope: str = SCOPE_USER,
    name: str | None = None,
    expires_in_s: int | None = None,
    actor_user_id: int | None = None,
) -> tuple[str, ApiKeyRow]:
    """Mint a key for ``user_id``; returns (plaintext, row). An admin-scope key makes the user an
    admin. The plaintext exists only in the return value."""
    if scope not in SCOPES:
        raise InvalidRequestError(f"scope: must be one of {list(SCOPES)}, got {scope!r}")
    if expires_in_s is not None and expires_in_s <= 0:
        raise InvalidRequestError("expires_in_seconds: must be > 0")
    user = session.get(UserRow, user_id)
    if user is None:
        raise NotFoundError(f"user_id: user {user_id} not found")
    if scope == SCOPE_ADMIN and not user.is_admin:
        user.is_admin = True
        session.add(user)
    key = generate_api_key()
    expires: datetime | None = None
    if expires_in_s is not None:
        expires = utcnow() + timedelta(seconds=expires_in_s)
    row = ApiKeyRow(
        user_id=user_id,
        digest=digest_key(key),
        prefix=display_prefix(key),
        scope=scope,
        name=clean_name(name, "name") if name else None,
        expires_at=expires,
    )
    session.add(row)
    session.flush()
    record_event(
        session,
        "key_created",
        org_id=user.org_id,
        actor_user_id=actor_user_id,
        details={"key_prefix": row.prefix, "user": user.name, "scope": scope, "key_id": row.id},
    )
    return key, row


def revoke_key(session: Session, row: ApiKeyRow, *, actor_user_id: int | None = None) -> bool:
    """Revoke ``row``; False if it already was. Effective on the next request (also for JWTs
    minted from it: each JWT request re-reads the key row)."""
    if row.revoked_at is not None:
        return False
    row.revoked_at = utcnow()
    session.add(row)
    user = session.get(UserRow, row.user_id)
    record_event(
        session,
        "key_revoked",
        org_id=user.org_id if user else None,
        actor_user_id=actor_user_id,
        details={"key_prefix": row.prefix, "key_id": row.id},
    )
    session.flush()
    return True


def key_json(row: ApiKeyRow, user: UserRow | None = None) -> dict:
    """A key as the admin API and the CLI show it: never the digest, never the key."""

    def iso(ts: datetime | None) -> str | None:
        return None if ts is None else ts.isoformat() + "Z"

    return {
        "id": row.id,
        "prefix": row.prefix,
        "name": row.name,
        "user_id": row.user_id,
        "user": user.name if user is not None else None,
        "scope": row.scope,
        "created_at": iso(row.created_at),
        "expires_at": iso(row.expires_at),
        "revoked_at": iso(row.revoked_at),
    }
