"""The gateway's config: `ServerConfig` (the engine's `EngineConfig` plus the HTTP, Redis, JWT,
quota, metrics and Tinker API sections), validated strictly like the engine's part.

Owns every knob only the gateway reads. The engine never imports this module; it receives an
`EngineConfig` (this class is one). `effective_redis_url` is the one place that decides which
Redis a replica uses (the ``TWINKLE_REDIS_URL`` variable wins over ``gateway.redis_url``);
`check_profile` what the ``production`` profile requires (Postgres and Redis, checked before
anything starts).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from engine.config import EngineConfig, _Strict
from engine.errors import ConfigError

__all__ = [
    "GatewayConfig",
    "ServerConfig",
    "check_profile",
    "check_replicas_share_state",
    "effective_redis_url",
]


class GatewayConfig(_Strict):
    """The gateway's own section (read by the gateway; the engine ignores it)."""

    num_replicas: int = Field(default=1, ge=1, description="Gateway (HTTP ingress) replicas")
    ingress: Literal["auto", "direct", "serve_proxy"] = Field(
        default="auto",
        description="direct: each gateway replica listens on the port itself (SO_REUSEPORT, "
        "all on the head node); serve_proxy: Ray Serve's proxy listens and forwards every "
        "request to a replica (one more process hop per request); auto: direct with one "
        "gateway replica, serve_proxy with several",
    )

    def direct_ingress(self) -> bool:
        """Whether the gateway replicas listen themselves. ``auto`` keeps Serve's proxy for
        several replicas: it routes every request anew, whereas a client's kept-alive
        connection sticks to one replica, and a retrieve_future poll that sticks to a replica
        that never sees its future finish (the owner's last write to Redis lost while Redis
        restarted) waited forever in the fault tests."""
        if self.ingress == "auto":
            return self.num_replicas == 1
        return self.ingress == "direct"

    redis_url: str | None = Field(
        default=None, description="Redis for quota and rate-limit state; required with >1 replica"
    )
    jwt_enabled: bool = Field(
        default=False,
        description="Tinker SDK JWT mode: clients exchange their key at /api/v1/auth/token",
    )
    jwt_ttl_seconds: int = Field(
        default=900, ge=60, le=86400, description="Lifetime of a minted JWT"
    )
    audit_denied_retention_days: float = Field(
        default=30.0,
        gt=0,
        description="access_denied audit events (bad keys, missing scope) older than this are "
        "deleted by the expiry sweep; admin events are kept",
    )
    audit_denied_max_rows: int = Field(
        default=100_000,
        ge=1,
        description="At most this many access_denied audit events are kept (the oldest go "
        "first); with rows under ~1 KiB each, about 100 MiB of database",
    )
    default_user_quotas: dict[str, int] = Field(
        default_factory=dict,
        description="Per-user quota limits applied when a user has no "
        "override (names as in the admin API, e.g. max_training_clients)",
    )
    metrics_enabled: bool = Field(
        default=True, description="Serve Prometheus metrics at GET /metrics (off: no endpoint, 404)"
    )
    metrics_require_admin: bool = Field(
        default=False,
        description="GET /metrics needs an admin-scope API key (default: no key needed)",
    )
    max_request_body_mb: int = Field(
        default=64,
        ge=1,
        description="Largest request body accepted (MiB; the Tinker SDK sends ~5 MB chunks); "
        "a larger one is refused with 413 before it is read",
    )
    max_datums_per_request: int = Field(
        default=4096,
        ge=1,
        description="Most datums in one forward / forward_backward request; more are a 413 "
        "naming this limit (the seq_id still passes, in order), before any compute",
    )
    max_decoded_request_mb: int = Field(
        default=256,
        ge=1,
        description="Most memory one forward / forward_backward request may decode to (MiB): "
        "tokens, the loss_fn_inputs its loss reads (sparse tensors at their dense shape) and "
        "images, summed over the request and checked before anything is expanded; also bounds "
        "the Python objects of a JSON body. More is a 413 naming the largest field (the seq_id "
        "still passes, in order). The SDK's chunks are ~5 MB",
    )
    max_held_mb_per_user: int = Field(
        default=1024,
        ge=1,
        description="Most decoded input (MiB) one user's unfinished forward / forward_backward "
        "requests may hold in a gateway replica (e.g. waiting behind a seq_id gap, up to the "
        "Trainer's 120 s gap timeout); more get 429 + retry-after, except the request its model "
        "runs next, which is always admitted",
    )
    max_pending_sequenced_per_user: int = Field(
        default=1024,
        ge=1,
        description="Most unfinished sequenced requests (forward_backward, optim_step, saves, "
        "...) one user may have in a gateway replica; more get 429 + retry-after, except the "
        "request its model runs next",
    )
    max_sequences_per_sample_request: int = Field(
        default=256,
        ge=1,
        description="Most sequences one sampling request may ask for (prompts x samples: "
        "native inputs x num_samples, OpenAI prompts x n, Tinker num_samples); more are a 413",
    )
    max_sample_tokens_per_request: int = Field(
        default=2**21,
        ge=1,
        description="Most tokens one sampling request may cost: its prompts plus sequences x "
        "max_tokens (what it holds a concurrency slot for); more are a 413",
    )
    max_ephemeral_saves: int = Field(
        default=8,
        ge=1,
        description="Ephemeral sampler saves (Tinker save_weights_for_sampler without a name) "
        "kept per user; recording a newer one deletes the oldest (its sampling session then "
        "answers 404). Named saves are under max_checkpoints instead",
    )
    max_live_sessions_per_user: int = Field(
        default=512,
        ge=1,
        description="Sessions (a Tinker ServiceClient, a native twinkle_client session) one user "
        "may have open at once; one more is a 403. A session ends when it is closed or expires "
        "(no heartbeat for session_timeout_seconds)",
    )
    max_sampling_sessions_per_session: int = Field(
        default=1024,
        ge=1,
        description="Tinker sampling sessions (create_sampling_session) one session may create; "
        "one more is a 403",
    )
    max_custom_losses: int = Field(
        default=256,
        ge=1,
        description="Custom-loss graphs (create_custom_loss) one user may keep in sessions that "
        "have not ended; one more is a 403. An ended session's losses are deleted by the sweep",
    )
    trace_retention_seconds: float = Field(
        default=7 * 86400.0,
        gt=0,
        description="How long per-request session trace rows are kept (the sweep deletes older)",
    )
    max_trace_rows_per_user: int = Field(
        default=200_000,
        ge=1,
        description="Session trace rows kept per user, the newest (the sweep deletes the rest)",
    )
    stability_ttl_seconds: float = Field(
        default=86400.0,
        gt=0,
        description="How long a sequence sampled with record_stability_info stays usable by "
        "stable_reinforce training requests; each training request that names it restarts the "
        "period (Tinker's one day). The sweep deletes expired records",
    )
    max_stability_records_per_session: int = Field(
        default=32768,
        ge=1,
        description="Sequences recorded with record_stability_info kept per client session; past "
        "it the session's oldest are evicted (a training request naming one is then a 400). "
        "32768 is 16 RL steps of 128 prompts x 16 samples",
    )


class ServerConfig(EngineConfig):
    """The whole server config: the engine's part plus the gateway's sections."""

    profile: Literal["development", "production"] = Field(
        default="development",
        description="production: Postgres (TWINKLE_DATABASE_URL) and Redis (gateway.redis_url or "
        "TWINKLE_REDIS_URL) are required, and `twinkle serve` does not migrate the database: "
        "it refuses to start unless `twinkle migrate` brought it to the head revision",
    )
    drain_timeout_seconds: float = Field(
        default=60.0,
        ge=0,
        description="On SIGTERM, how long `twinkle serve` waits for in-flight requests (futures) "
        "to finish before it stops; meanwhile new requests get 503 with Retry-After",
    )
    drain_retry_after_seconds: int = Field(
        default=30, ge=1, description="Retry-After of the 503 answered while draining"
    )
    host: str = Field(default="127.0.0.1", description="HTTP bind address")
    port: int = Field(default=8000, ge=1, le=65535, description="HTTP port")
    gateway: GatewayConfig = Field(default_factory=GatewayConfig)
    long_poll_seconds: float = Field(
        default=25.0,
        gt=0,
        le=40,
        description="How long retrieve_future holds a request (SDK timeout 45 s)",
    )
    # -- the Tinker API surface --
    future_ttl_seconds: float = Field(
        default=3600.0,
        gt=0,
        description="How long a finished future's result is kept for retrieval; "
        "afterwards retrieve_future answers 410 (for a day)",
    )
    metadata_only_min_bytes: int = Field(
        default=1 << 20,
        ge=0,
        description="A finished protobuf result this large is first announced as "
        "complete_metadata when the SDK allows it (it reserves its byte budget first)",
    )
    session_timeout_seconds: float = Field(
        default=600.0,
        gt=0,
        description="A session with no heartbeat for this long expires: its "
        "adapters are released (saved checkpoints stay) and its clients get 410",
    )
    session_sweep_seconds: float = Field(
        default=30.0, gt=0, description="How often expired sessions and checkpoints are swept"
    )
    custom_loss_server_side: bool = Field(
        default=True,
        description="Run the SDK's traced custom losses on the server (create_custom_loss, "
        "loss_fn='custom': one forward_backward); off, the SDK runs them client-side",
    )
    download_url_ttl_seconds: float = Field(
        default=3600.0, gt=0, description="Lifetime of signed external-weights download URLs"
    )
    sdk_deprecated_below: str = Field(
        default="0.38.0",
        description="Tinker SDK versions below this get x-deprecation-level: warning",
    )
    sdk_unsupported_below: str = Field(
        default="0.16.0",
        description="Tinker SDK versions below this get x-deprecation-level: error",
    )
    max_concurrent_samples_per_user: int = Field(
        default=64,
        ge=0,
        description="Sampling requests (Tinker asample, OpenAI completions) one user may "
        "have in flight at once; more get 429 with retry-after. 0 = no limit",
    )

    @model_validator(mode="after")
    def _quota_names(self) -> ServerConfig:
        from gateway.quotas.limits import QUOTAS  # light module: names and defaults only

        unknown = sorted(set(self.gateway.default_user_quotas) - set(QUOTAS))
        if unknown:
            raise ValueError(
                f"gateway.default_user_quotas: unknown quota names {unknown}; known: "
                f"{sorted(QUOTAS)}"
            )
        return self


def effective_redis_url(settings_redis_url: str | None, config: ServerConfig) -> str | None:
    """The Redis a gateway replica uses: ``TWINKLE_REDIS_URL`` (already in `Settings`) wins over
    ``gateway.redis_url``; None means in-process stores (one replica only)."""
    return settings_redis_url or config.gateway.redis_url


def check_replicas_share_state(settings_redis_url: str | None, config: ServerConfig) -> None:
    """Several gateway replicas must share futures, idempotency keys and quota state: refuse to
    start them without a Redis (from either source)."""
    if config.gateway.num_replicas > 1 and not effective_redis_url(settings_redis_url, config):
        raise ConfigError(
            f"gateway.num_replicas is {config.gateway.num_replicas} but no Redis is set: quota "
            "and rate-limit state must be shared between gateway replicas (set gateway.redis_url "
            "or TWINKLE_REDIS_URL)"
        )


def check_profile(database_url: str, settings_redis_url: str | None, config: ServerConfig) -> None:
    """The ``production`` profile needs the shared services a multi-replica deploy relies on:
    Postgres (SQLite is one file on one host) and Redis (futures, idempotency keys and quotas
    shared by gateway replicas). A ConfigError names the missing key."""
    if config.profile != "production":
        return
    from sqlalchemy.engine import make_url

    missing = []
    try:
        backend = make_url(database_url).get_backend_name()
    except Exception:  # an unparsable URL is as wrong as a SQLite one here
        backend = "?"
    if backend != "postgresql":
        missing.append(
            f"TWINKLE_DATABASE_URL must name a Postgres database (postgresql://...), got "
            f"{backend!r}"
        )
    if not effective_redis_url(settings_redis_url, config):
        missing.append("gateway.redis_url (or TWINKLE_REDIS_URL) must name a Redis")
    if missing:
        raise ConfigError("profile: production needs " + "; ".join(missing))
