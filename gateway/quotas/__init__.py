"""Quotas: limits by name (`limits`), their atomic store (`store`), the `Quotas` service and its
FastAPI dependency (`service`), concurrent-sampling slots
(`concurrency`). This module only re-exports what routes use."""

from gateway.quotas.service import (
    MemoryQuotaStore,
    Quotas,
    QuotasDep,
    RedisQuotaStore,
    build_quotas,
    get_quotas,
)

__all__ = [
    "MemoryQuotaStore",
    "Quotas",
    "QuotasDep",
    "RedisQuotaStore",
    "build_quotas",
    "get_quotas",
]
