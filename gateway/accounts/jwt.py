"""Short-lived JWTs for the Tinker SDK's own flow (``pjwt_auth_enabled``).

Owns minting (POST /api/v1/auth/token exchanges an API key for a JWT) and verification. Tokens
are HS256, signed with joserfc (authlib's JOSE implementation, which authlib 1.9 itself delegates
to). Claims: ``sub`` (``tml:user:<id>``), ``org_id`` (what the SDK's
``whoami`` turns into ``tml:organization:<org_id>``), ``kid`` (the API key's id), ``scope``,
``iat``, ``exp``, ``iss``. A JWT only names its key: every request re-reads the key row, so
revoking the key (or disabling its user or organization) revokes its JWTs at once.

The secret is loaded once per replica by `gateway.settings.Secrets`: ``TWINKLE_JWT_SECRET``
(required when replicas run on hosts that share no data dir), else a random one kept in
``<data_dir>/jwt_secret`` (mode 0600).
"""

from __future__ import annotations

import time

from joserfc import jwt
from joserfc.errors import JoseError
from joserfc.jwk import OctKey

from gateway.errors import InvalidTokenError

ISSUER = "twinkle"
ALGORITHM = "HS256"


class JwtIssuer:
    """Mints and verifies the gateway's JWTs; ``verify`` returns the API key id they carry."""

    def __init__(self, secret: bytes, ttl_seconds: int) -> None:
        if len(secret) < 32:
            raise ValueError("the JWT secret must be at least 32 bytes")
        self._key = OctKey.import_key(secret)
        self.ttl_seconds = ttl_seconds

    def mint(self, *, user_id: int, org_id: int | None, key_id: int, scope: str) -> str:
        now = int(time.time())
        claims = {
            "iss": ISSUER,
            "sub": f"tml:user:{user_id}",
            "org_id": str(org_id if org_id is not None else 0),
            "kid": key_id,
            "scope": scope,
            "iat": now,
            "exp": now + self.ttl_seconds,
        }
        return jwt.encode({"alg": ALGORITHM}, claims, self._key, algorithms=[ALGORITHM])

    def verify(self, token: str) -> int:
        """The key id of a valid, unexpired token, else `InvalidTokenError`."""
        try:
            decoded = jwt.decode(token, self._key, algorithms=[ALGORITHM])
            claims = decoded.claims
            jwt.JWTClaimsRegistry(
                iss={"essential": True, "value": ISSUER}, exp={"essential": True}
            ).validate(claims)
            key_id = int(claims["kid"])
        except (JoseError, ValueError, KeyError, TypeError):
            raise InvalidTokenError("invalid or expired token") from None
        return key_id


def build_jwt(secret: bytes, enabled: bool, ttl_seconds: int) -> JwtIssuer | None:
    """The replica's JWT issuer when ``gateway.jwt_enabled``, else None."""
    if not enabled:
        return None
    return JwtIssuer(secret, ttl_seconds)
