"""API keys and request authentication.

Owns: key format (``tml-`` + ``secrets.token_urlsafe(32)``, i.e. 32 random bytes), storage (only the
sha256 hex digest and a 10-character display prefix are stored), lookup (by the indexed digest, then
``secrets.compare_digest``; unknown keys do the same work), where a request carries its key
(``X-API-Key``, ``Authorization: Bearer``, ``Twinkle-Authorization: Bearer``), and the FastAPI
dependency `PrincipalDep`. A key never appears in a log line, an error message or a response.
"""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Request
from sqlalchemy import Engine
from sqlmodel import Session, select
from starlette.datastructures import Headers

from gateway.errors import AuthenticationError, InvalidRequestError, PermissionDeniedError
from gateway.tables import ApiKeyRow, UserRow

KEY_PREFIX = "tml-"
KEY_RANDOM_BYTES = 32
DISPLAY_PREFIX_LEN = 10
MAX_KEY_LEN = 256
MAX_USER_NAME_LEN = 128
SCOPE_USER = "user"
SCOPE_ADMIN = "admin"

# Compared against when no row matches, so unknown keys cost the same as known ones.
_DUMMY_DIGEST = hashlib.sha256(b"twinkle-no-such-key").hexdigest()


@dataclass(frozen=True, slots=True)
class Principal:
    """Who is calling: the owner of the API key on this request."""

    user_id: int
    user_name: str
    scope: str
    key_id: int

    @property
    def is_admin(self) -> bool:
        return self.scope == SCOPE_ADMIN


def generate_api_key() -> str:
    """A new plaintext key: ``tml-`` + 43 url-safe characters (32 random bytes)."""
    return KEY_PREFIX + secrets.token_urlsafe(KEY_RANDOM_BYTES)


def digest_key(key: str) -> str:
    """sha256 hex digest of the full key (what the database stores)."""
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


def display_prefix(key: str) -> str:
    """The non-secret part shown in listings: ``tml-`` and 6 more characters."""
    return key[:DISPLAY_PREFIX_LEN]


def create_user_and_key(session: Session, *, user_name: str, admin: bool) -> str:
    """Create user ``user_name`` if missing, add a key (scope "admin" if ``admin`` else "user"),
    and return the plaintext key; this is the only time it exists. An existing user asked for an
    admin key is marked ``is_admin``; nobody is demoted. Flushes; the caller commits
    (`gateway.db.session_scope` does)."""
    name = user_name.strip()
    if not name or len(name) > MAX_USER_NAME_LEN or not name.isprintable():
        raise InvalidRequestError(f"user name must be 1-{MAX_USER_NAME_LEN} printable characters")
    user = session.exec(select(UserRow).where(UserRow.name == name)).first()
    if user is None:
        user = UserRow(name=name, is_admin=admin)
        session.add(user)
        session.flush()
    elif admin and not user.is_admin:
        user.is_admin = True
        session.add(user)
    key = generate_api_key()
    assert user.id is not None
    session.add(
        ApiKeyRow(
            user_id=user.id,
            digest=digest_key(key),
            prefix=display_prefix(key),
            scope=SCOPE_ADMIN if admin else SCOPE_USER,
        )
    )
    session.flush()
    return key


def authenticate(session: Session, raw_key: str | None) -> Principal:
    """Resolve a plaintext key to its `Principal`, or raise `AuthenticationError` (missing,
    not ``tml-``, unknown, or revoked). Messages never contain the key."""
    if not raw_key:
        raise AuthenticationError("missing API key (send it in the X-API-Key header)")
    if not raw_key.startswith(KEY_PREFIX) or len(raw_key) > MAX_KEY_LEN:
        raise AuthenticationError("invalid API key")
    digest = digest_key(raw_key)
    row = session.exec(
        select(ApiKeyRow, UserRow)
        .join(UserRow, UserRow.id == ApiKeyRow.user_id)
        .where(ApiKeyRow.digest == digest)
    ).first()
    key_row, user_row = row if row is not None else (None, None)
    stored = key_row.digest if key_row is not None else _DUMMY_DIGEST
    matches = secrets.compare_digest(stored.encode("ascii"), digest.encode("ascii"))
    if key_row is None or user_row is None or not matches:
        raise AuthenticationError("invalid API key")
    if key_row.revoked_at is not None:
        raise AuthenticationError("API key has been revoked")
    assert key_row.id is not None and user_row.id is not None
    return Principal(
        user_id=user_row.id, user_name=user_row.name, scope=key_row.scope, key_id=key_row.id
    )


def extract_api_key(headers: Headers) -> str | None:
    """The key from ``X-API-Key``, else ``Authorization: Bearer``, else
    ``Twinkle-Authorization: Bearer`` (first header present wins)."""
    value = headers.get("x-api-key")
    if value and value.strip():
        return value.strip()
    for name in ("authorization", "twinkle-authorization"):
        value = headers.get(name)
        if not value:
            continue
        scheme, _, token = value.strip().partition(" ")
        if scheme.lower() == "bearer" and token.strip():
            return token.strip()
    return None


def authenticate_engine(engine: Engine, raw_key: str | None) -> Principal:
    """`authenticate` in its own short read-only session."""
    with Session(engine) as session:
        return authenticate(session, raw_key)


def get_principal(request: Request) -> Principal:
    """FastAPI dependency (sync: runs in the threadpool). Uses ``request.app.state.db_engine`` and
    leaves the result on ``request.state.principal`` for logging and metrics."""
    principal = authenticate_engine(request.app.state.db_engine, extract_api_key(request.headers))
    request.state.principal = principal
    return principal


PrincipalDep = Annotated[Principal, Depends(get_principal)]


def get_admin_principal(principal: PrincipalDep) -> Principal:
    """FastAPI dependency: like `get_principal`, but the key must have scope "admin" (else 403)."""
    if not principal.is_admin:
        raise PermissionDeniedError("this endpoint needs an admin API key")
    return principal


AdminPrincipalDep = Annotated[Principal, Depends(get_admin_principal)]
