"""API keys and request authentication.

Owns: key format (``tml-`` + ``secrets.token_urlsafe(32)``, i.e. 32 random bytes), storage (only the
sha256 hex digest and a 10-character display prefix are stored), lookup (by the indexed digest, then
``secrets.compare_digest``; unknown keys do the same work), where a request carries its key
(``X-API-Key``, ``Authorization: Bearer``, ``Twinkle-Authorization: Bearer``), the checks made on
every request (revoked, expired, user or organization disabled; so a revocation is effective on the
next request, also for JWTs minted from the key), and the FastAPI dependencies `PrincipalDep`,
`AdminPrincipalDep` and `KeyPrincipalDep` (the key itself, not a JWT: for routes that mint
credentials). A key never appears in a log line, an error message or a response.
"""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated

from fastapi import Depends, Request
from sqlalchemy import Engine
from sqlmodel import Session, select
from starlette.datastructures import Headers

from gateway.db.tables import ApiKeyRow, OrganizationRow, UserRow, utcnow
from gateway.errors import AuthenticationError, InvalidTokenError, PermissionDeniedError

if TYPE_CHECKING:  # gateway.context imports this module: the type only
    from gateway.context import AppServices

KEY_PREFIX = "tml-"
KEY_RANDOM_BYTES = 32
DISPLAY_PREFIX_LEN = 10
MAX_KEY_LEN = 256
MAX_USER_NAME_LEN = 128
MAX_JWT_LEN = 4096
SCOPE_USER = "user"
SCOPE_ADMIN = "admin"

# Compared against when no row matches, so unknown keys cost the same as known ones.
_DUMMY_DIGEST = hashlib.sha256(b"twinkle-no-such-key").hexdigest()


@dataclass(frozen=True, slots=True)
class Principal:
    """Who is calling: the owner of the API key (or of the JWT's key) on this request."""

    user_id: int
    user_name: str
    scope: str
    key_id: int
    org_id: int | None = None
    org_name: str | None = None
    key_prefix: str = ""
    #: authenticated by a JWT minted from the key (not the key itself): such a caller may not
    #: exchange its credential for a new JWT, so a token never outlives its ``exp``
    via_jwt: bool = False

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


def _principal(session: Session, key_row: ApiKeyRow, *, via_jwt: bool = False) -> Principal:
    """The principal of a key row that matched, after the revocation, expiry and disable checks
    (done on every request, so a revocation takes effect on the next one)."""
    if key_row.revoked_at is not None:
        raise AuthenticationError("API key has been revoked")
    if key_row.expires_at is not None and key_row.expires_at <= utcnow():
        raise AuthenticationError("API key has expired")
    user = session.get(UserRow, key_row.user_id)
    if user is None or user.disabled_at is not None:
        raise AuthenticationError("the API key's user is disabled")
    org = session.get(OrganizationRow, user.org_id) if user.org_id is not None else None
    if org is not None and org.disabled_at is not None:
        raise AuthenticationError("the API key's organization is disabled")
    assert key_row.id is not None and user.id is not None
    return Principal(
        user_id=user.id,
        user_name=user.name,
        scope=key_row.scope,
        key_id=key_row.id,
        org_id=org.id if org is not None else None,
        org_name=org.name if org is not None else None,
        key_prefix=key_row.prefix,
        via_jwt=via_jwt,
    )


def authenticate(session: Session, raw_key: str | None, jwt_verifier=None) -> Principal:
    """Resolve a plaintext key (or, with ``jwt_verifier``, a JWT) to its `Principal`, or raise
    `AuthenticationError` (missing, not ``tml-``, unknown, revoked, expired, disabled). Messages
    never contain the key."""
    if not raw_key:
        raise AuthenticationError("missing API key (send it in the X-API-Key header)")
    if jwt_verifier is not None and raw_key.startswith("eyJ") and len(raw_key) <= MAX_JWT_LEN:
        key_id = jwt_verifier(raw_key)  # raises InvalidTokenError
        key_row = session.get(ApiKeyRow, key_id)
        if key_row is None:
            raise InvalidTokenError("invalid token")
        try:
            return _principal(session, key_row, via_jwt=True)
        except AuthenticationError as exc:
            raise InvalidTokenError(exc.message) from None
    if not raw_key.startswith(KEY_PREFIX) or len(raw_key) > MAX_KEY_LEN:
        raise AuthenticationError("invalid API key")
    digest = digest_key(raw_key)
    key_row = session.exec(select(ApiKeyRow).where(ApiKeyRow.digest == digest)).first()
    stored = key_row.digest if key_row is not None else _DUMMY_DIGEST
    matches = secrets.compare_digest(stored.encode("ascii"), digest.encode("ascii"))
    if key_row is None or not matches:
        raise AuthenticationError("invalid API key")
    return _principal(session, key_row)


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


def authenticate_engine(engine: Engine, raw_key: str | None, jwt_verifier=None) -> Principal:
    """`authenticate` in its own short read-only session."""
    with Session(engine) as session:
        return authenticate(session, raw_key, jwt_verifier)


def get_principal(request: Request) -> Principal:
    """FastAPI dependency (sync: runs in the threadpool). Uses the app services' DB engine
    (and JWT issuer when JWT mode is on) and leaves the result on ``request.state.principal``
    for logging and metrics. Failures are audited (no key inside)."""
    services: AppServices = request.app.state.services
    jwt = services.jwt
    try:
        principal = authenticate_engine(
            services.db_engine,
            extract_api_key(request.headers),
            jwt.verify if jwt is not None else None,
        )
    except AuthenticationError as exc:
        from gateway.accounts.audit import record_denied

        record_denied(request, None, exc.message)
        raise
    request.state.principal = principal
    return principal


PrincipalDep = Annotated[Principal, Depends(get_principal)]


def get_admin_principal(request: Request, principal: PrincipalDep) -> Principal:
    """FastAPI dependency: like `get_principal`, but the key must have scope "admin" (else 403)."""
    if not principal.is_admin:
        from gateway.accounts.audit import record_denied

        record_denied(request, principal, "admin scope required")
        raise PermissionDeniedError("this endpoint needs an admin API key")
    return principal


AdminPrincipalDep = Annotated[Principal, Depends(get_admin_principal)]


def get_key_principal(request: Request, principal: PrincipalDep) -> Principal:
    """FastAPI dependency for the routes that mint a credential (a JWT, an API key): the caller
    must present the API key itself, not a JWT minted from it (else 403), so a leaked JWT cannot
    buy a credential that outlives its ``exp``."""
    if principal.via_jwt:
        from gateway.accounts.audit import record_denied

        record_denied(request, principal, "a JWT may not mint credentials")
        raise PermissionDeniedError(
            "this endpoint needs the API key itself, not a JWT minted from it"
        )
    return principal


KeyPrincipalDep = Annotated[Principal, Depends(get_key_principal)]
