"""Builds the hosted-service state of one gateway replica from the config: the quota service
(Redis-backed when ``gateway.redis_url`` is set, else in process) and the JWT issuer (when
``gateway.jwt_enabled``)."""

from __future__ import annotations

from sqlalchemy import Engine

from engine.config import ServerConfig
from engine.errors import ConfigError
from gateway.jwt_tokens import JwtIssuer, load_secret
from gateway.quotas import MemoryQuotaStore, Quotas, RedisQuotaStore
from gateway.quotas.limits import QUOTAS
from gateway.settings import Settings


def default_user_quotas(config: ServerConfig) -> dict[str, int]:
    defaults = dict(config.gateway.default_user_quotas)
    unknown = sorted(set(defaults) - set(QUOTAS))
    if unknown:
        raise ConfigError(
            f"gateway.default_user_quotas: unknown quota names {unknown}; known: {sorted(QUOTAS)}"
        )
    # The older top-level knob stays the per-user default for concurrent sampling requests.
    if config.max_concurrent_samples_per_user and "max_concurrent_samples" not in defaults:
        defaults["max_concurrent_samples"] = config.max_concurrent_samples_per_user
    return defaults


def build_quotas(
    settings: Settings, config: ServerConfig, db_engine: Engine, redis_url: str | None = None
) -> Quotas:
    """``redis_url``: the replica's effective Redis (TWINKLE_REDIS_URL or gateway.redis_url)."""
    redis_url = redis_url or settings.redis_url or config.gateway.redis_url
    store = RedisQuotaStore(redis_url) if redis_url else MemoryQuotaStore()
    return Quotas(store, db_engine, default_user_quotas=default_user_quotas(config))


def build_jwt(settings: Settings, config: ServerConfig) -> JwtIssuer | None:
    if not config.gateway.jwt_enabled:
        return None
    return JwtIssuer(load_secret(settings.data_dir), config.gateway.jwt_ttl_seconds)
