"""Per-adapter state of `engine.local.model.MultiLoraTransformersModel`: configuration, the
accumulation window, metric accumulators, checkpoint paths, and the
training-config file `save` writes next to the PEFT files."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from engine.errors import CheckpointError, UserInputError
from engine.local.inputs import Batch
from engine.local.training_config import (
    UPSTREAM_MEAN,
    LrSchedule,
    OptimizerConfig,
    is_upstream_mean,
    make_schedule,
)
from engine.protocol import LoraSpec
from engine.rules import spec_target_modules

#: written next to the PEFT files by `save` (not part of the backend's manifest)
TRAIN_CONFIG_FILE = "twinkle_train_config.json"
TRAIN_CONFIG_FORMAT = 1


@dataclass
class MetricAcc:
    """Sums since the last calculate_metric."""

    loss_sum: float = 0.0
    num_tokens: float = 0.0
    num_sequences: int = 0
    num_batches: int = 0
    loss_values: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)

    def record(self, res: dict, n_seq: int) -> None:
        self.loss_sum += res["loss_sum"]
        self.num_tokens += res["num_tokens"]
        self.num_sequences += n_seq
        self.num_batches += 1
        self.loss_values.append(res["loss"])

    def summary(self, token_mean: bool) -> dict[str, Any]:
        if token_mean and self.num_tokens > 0:
            loss = self.loss_sum / self.num_tokens
        else:
            loss = sum(self.loss_values) / len(self.loss_values) if self.loss_values else None
        norms = self.grad_norms
        return {
            "loss": loss,
            "loss_sum": self.loss_sum,
            "num_tokens": self.num_tokens,
            "num_sequences": self.num_sequences,
            "num_batches": self.num_batches,
            "grad_norm": sum(norms) / len(norms) if norms else None,
        }


@dataclass
class AdapterTraining:
    """How one adapter of the in-process API trains: its loss, optimizer and schedule settings,
    the accumulation window and the metrics gathered since they were last read."""

    spec: LoraSpec
    gas: int = 1
    loss: tuple[str, str, dict] = ("cross_entropy", "cross_entropy", {})  # name, loss_fn, config
    optim: OptimizerConfig = field(default_factory=OptimizerConfig)
    schedule: LrSchedule | None = None
    sched_t: int = 0  # lr_step() calls that advanced the schedule
    micro: int = 0  # step() calls in the current accumulation window
    pending_grad: bool = False
    clip: float = 0.0  # grad_clip_norm of the next applied step
    opt_steps: int = 0
    consumed_train_samples: int = 0  # as last given to save(), for resume_from_checkpoint
    template: Any = None
    processor: Any = None
    cached: tuple[Batch, dict] | None = None  # forward's converted inputs, for backward
    last: dict | None = None  # result of the last pass, for calculate_loss
    train: MetricAcc = field(default_factory=MetricAcc)
    eval: MetricAcc = field(default_factory=MetricAcc)
    #: add_metric's metrics for training / evaluation passes (engine.local.metrics)
    train_metrics: list[Any] = field(default_factory=list)
    eval_metrics: list[Any] = field(default_factory=list)

    def lr(self) -> float:
        base = self.optim.lr
        return base * self.schedule.multiplier(self.sched_t, base) if self.schedule else base

    def reset_window(self) -> None:
        self.micro, self.pending_grad, self.clip, self.cached = 0, False, 0.0, None

    def describe(self, adapter_name: str) -> dict[str, Any]:
        """get_train_configs' body."""
        s = self.spec
        lora = {"r": s.rank, "lora_alpha": s.alpha, "seed": s.seed}
        return {
            "adapter_name": adapter_name,
            "lora": {**lora, "target_modules": spec_target_modules(s)},
            "gradient_accumulation_steps": self.gas,
            "loss": {"name": self.loss[0], "loss_fn": self.loss[1], "config": dict(self.loss[2])},
            "optimizer": asdict(self.optim),
            "lr_scheduler": self.schedule.describe() if self.schedule else None,
            "lr_scheduler_position": self.sched_t,
            "current_lr": self.lr(),
            "optimizer_steps": self.opt_steps,
            "template": repr(self.template) if self.template is not None else None,
            "processor": repr(self.processor) if self.processor is not None else None,
        }

    def train_config(self) -> dict[str, Any]:
        """JSON body of TRAIN_CONFIG_FILE."""
        return {
            "format": TRAIN_CONFIG_FORMAT,
            "gradient_accumulation_steps": self.gas,
            "loss": {"name": self.loss[0], "loss_fn": self.loss[1], "config": self.loss[2]},
            "optimizer": asdict(self.optim),
            "lr_scheduler": self.schedule.describe() if self.schedule else None,
            "lr_scheduler_position": self.sched_t,
            "optimizer_steps": self.opt_steps,
            "consumed_train_samples": self.consumed_train_samples,
        }

    def restore_train_config(self, cfg: dict[str, Any]) -> None:
        """Inverse of train_config (KeyError/TypeError/ValueError on a malformed body). A callable
        schedule is not serialisable: the current schedule is kept then."""
        gas = int(cfg["gradient_accumulation_steps"])
        loss = cfg["loss"]
        o = cfg["optimizer"]
        optim = OptimizerConfig(
            float(o["lr"]),
            (float(o["betas"][0]), float(o["betas"][1])),
            float(o["eps"]),
            float(o["weight_decay"]),
            str(o.get("name", "AdamW")),
        )
        sched = cfg.get("lr_scheduler")
        schedule = self.schedule
        if sched and sched["name"] != "callable":
            schedule = make_schedule(sched["name"], {k: v for k, v in sched.items() if k != "name"})
        self.gas, self.optim, self.schedule = gas, optim, schedule
        self.loss = (str(loss["name"]), str(loss["loss_fn"]), dict(loss["config"]))
        if is_upstream_mean(self.loss[0]):  # written before upstream_mean existed: the default
            self.loss[2].setdefault(UPSTREAM_MEAN, 1.0)
        self.sched_t = int(cfg["lr_scheduler_position"])
        self.opt_steps = int(cfg["optimizer_steps"])
        self.consumed_train_samples = int(cfg.get("consumed_train_samples", 0))

    def write_train_config(self, directory: Path) -> None:
        body = json.dumps(self.train_config(), indent=2, sort_keys=True) + "\n"
        (directory / TRAIN_CONFIG_FILE).write_text(body)

    def read_train_config(self, directory: Path) -> None:
        """Restore from ``directory``'s TRAIN_CONFIG_FILE; no-op if it has none (server saves)."""
        path = directory / TRAIN_CONFIG_FILE
        if not path.is_file():
            return
        try:
            self.restore_train_config(json.loads(path.read_text()))
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"checkpoint {directory}: bad {TRAIN_CONFIG_FILE}: {e}") from None


def check_count(value: Any, field: str = "consumed_train_samples") -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise UserInputError(f"{field} {value!r} must be an integer >= 0")
    return value


def checkpoint_dir(
    data_dir: Path,
    name: str | os.PathLike,
    output_dir: str | os.PathLike | None,
    adapter_name: str,
    loading: bool = False,
) -> Path:
    """``output_dir/name``; else ``name`` if it is an absolute path (or, when loading, an existing
    directory); else ``<data_dir>/local_checkpoints/<adapter_name>/<name>``."""
    if output_dir is not None:
        return Path(output_dir).expanduser() / name
    p = Path(name).expanduser()
    if p.is_absolute() or (loading and p.is_dir()):
        return p
    name = str(name)
    if p.name != name or name in (".", ".."):
        raise UserInputError(f"checkpoint name {name!r} must be a plain name (no path)")
    return data_dir / "local_checkpoints" / adapter_name / name
