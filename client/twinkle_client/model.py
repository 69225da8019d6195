"""`MultiLoraTransformersModel`: the engine's in-process training class, served remotely.

Same methods, arguments and return values as ``engine.local.model.MultiLoraTransformersModel``, so a
script switches between local and remote by changing its import. Each call is one synchronous
request to ``/api/v1/twinkle/model/<method>``; the server runs that very class against the shared
multi-tenant Trainer. Differences, all about where things live:

* `save` returns a ``twinkle://`` path (locally: a directory); `load` / `resume_from_checkpoint`
  take a checkpoint name of the adapter or a ``twinkle://`` path. ``output_dir`` is refused.
* Losses, optimizers, schedulers and templates are sent by name (a class or instance is sent as
  its class name); callables cannot be sent.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from twinkle_client._client import InvalidRequestError, TwinkleClient, get_client
from twinkle_client._serialize import lora_config_dict, name_of, to_wire

DEFAULT_ADAPTER = "default"
_ARRAY_KEYS = ("logprobs", "elementwise_loss")


def strip_hub_prefix(model_id: str) -> str:
    for prefix in ("ms://", "hf://"):
        if model_id.startswith(prefix):
            return model_id[len(prefix) :]
    return model_id


def _call_kwargs(label_format, advantages, old_logps, ref_outputs, task) -> dict[str, Any]:
    """The per-call pass arguments that differ from their defaults (older servers lack them)."""
    given = {
        "advantages": advantages,
        "old_logps": old_logps,
        "ref_outputs": ref_outputs,
        "task": task,
    }
    out = {k: v for k, v in given.items() if v is not None}
    if label_format != "rolled":
        out["label_format"] = label_format
    return out


class MultiLoraTransformersModel:
    """Many LoRA adapters on the server's copy of ``model_id`` (a served base model name;
    ``ms://`` / ``hf://`` prefixes are dropped)."""

    def __init__(self, model_id: str, *, client: TwinkleClient | None = None, **_: Any) -> None:
        self.client = get_client(client)
        self.model_id = strip_hub_prefix(str(model_id))
        out = self.client.post(
            "twinkle/model/create",
            {"session_id": self.client.session_id, "base_model": self.model_id},
        )
        self.remote_id: str = out["model_id"]
        self.max_lora_rank: int = out["max_lora_rank"]

    def _call(self, method: str, adapter_name: str, **kwargs: Any) -> Any:
        body = {"model_id": self.remote_id, "adapter_name": adapter_name, "kwargs": to_wire(kwargs)}
        return self.client.post(f"twinkle/model/{method}", body)["result"]

    @staticmethod
    def _pass_result(res: dict) -> dict:
        for key in _ARRAY_KEYS:
            if key in res:
                res[key] = [None if x is None else np.asarray(x, np.float32) for x in res[key]]
        return res

    # -- adapters ------------------------------------------------------------------------------
    def add_adapter_to_model(
        self, adapter_name: str, config: Any, gradient_accumulation_steps: int = 1
    ) -> None:
        """A fresh adapter from a `peft.LoraConfig` or dict, or a checkpoint (twinkle:// path)."""
        self._call(
            "add_adapter_to_model",
            adapter_name,
            config=lora_config_dict(config),
            gradient_accumulation_steps=gradient_accumulation_steps,
        )

    def remove_adapter(self, adapter_name: str = DEFAULT_ADAPTER) -> None:
        self._call("remove_adapter", adapter_name)

    def set_template(self, template: Any, *, adapter_name: str = DEFAULT_ADAPTER, **kwargs) -> None:
        self._call("set_template", adapter_name, template=name_of(template, "template"), **kwargs)

    def set_processor(
        self, processor: Any, *, adapter_name: str = DEFAULT_ADAPTER, **kwargs
    ) -> None:
        self._call(
            "set_processor", adapter_name, processor=name_of(processor, "processor"), **kwargs
        )

    # -- configuration -------------------------------------------------------------------------
    def set_loss(self, loss: Any, *, adapter_name: str = DEFAULT_ADAPTER, **kwargs) -> None:
        self._call("set_loss", adapter_name, loss=name_of(loss, "loss"), **kwargs)

    def set_optimizer(
        self,
        optimizer: Any = "AdamW",
        *,
        adapter_name: str = DEFAULT_ADAPTER,
        lr: float | None = None,
        betas: tuple[float, float] | None = None,
        eps: float | None = None,
        weight_decay: float | None = None,
        **kwargs,
    ) -> None:
        given = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay}
        given = {k: v for k, v in given.items() if v is not None}
        self._call(
            "set_optimizer",
            adapter_name,
            optimizer=name_of(optimizer, "optimizer"),
            **given,
            **kwargs,
        )

    def set_lr_scheduler(
        self, scheduler: Any, *, adapter_name: str = DEFAULT_ADAPTER, **kwargs
    ) -> None:
        if callable(scheduler) and not isinstance(scheduler, type):
            raise InvalidRequestError(
                "scheduler: a callable schedule cannot be sent to the server; use 'constant', "
                "'linear' or 'cosine' with warmup_steps / total_steps"
            )
        self._call(
            "set_lr_scheduler", adapter_name, scheduler=name_of(scheduler, "scheduler"), **kwargs
        )

    def get_train_configs(self, *, adapter_name: str = DEFAULT_ADAPTER) -> dict[str, Any]:
        return self._call("get_train_configs", adapter_name)

    # -- passes --------------------------------------------------------------------------------
    def forward_backward(
        self,
        inputs: Any,
        *,
        adapter_name: str = DEFAULT_ADAPTER,
        label_format: str = "rolled",
        advantages: Any = None,
        old_logps: Any = None,
        ref_outputs: Any = None,
        task: str | None = None,
        **loss_kwargs,
    ) -> dict[str, Any]:
        call = _call_kwargs(label_format, advantages, old_logps, ref_outputs, task)
        return self._pass_result(
            self._call("forward_backward", adapter_name, inputs=inputs, **call, **loss_kwargs)
        )

    def forward_only(
        self,
        inputs: Any,
        *,
        adapter_name: str = DEFAULT_ADAPTER,
        label_format: str = "rolled",
        advantages: Any = None,
        old_logps: Any = None,
        ref_outputs: Any = None,
        task: str | None = None,
        disable_lora: bool = False,
        **loss_kwargs,
    ) -> dict[str, Any]:
        call = _call_kwargs(label_format, advantages, old_logps, ref_outputs, task)
        if disable_lora:
            call["disable_lora"] = True
        return self._pass_result(
            self._call("forward_only", adapter_name, inputs=inputs, **call, **loss_kwargs)
        )

    def forward(
        self,
        inputs: Any,
        *,
        adapter_name: str = DEFAULT_ADAPTER,
        label_format: str = "rolled",
        advantages: Any = None,
        old_logps: Any = None,
        ref_outputs: Any = None,
        task: str | None = None,
        **loss_kwargs,
    ) -> dict[str, Any]:
        call = _call_kwargs(label_format, advantages, old_logps, ref_outputs, task)
        return self._pass_result(
            self._call("forward", adapter_name, inputs=inputs, **call, **loss_kwargs)
        )

    def calculate_loss(self, *, adapter_name: str = DEFAULT_ADAPTER) -> float:
        return float(self._call("calculate_loss", adapter_name))

    def backward(self, *, adapter_name: str = DEFAULT_ADAPTER) -> dict[str, Any]:
        return self._pass_result(self._call("backward", adapter_name))

    # -- optimizer -----------------------------------------------------------------------------
    def clip_grad_norm(
        self,
        max_grad_norm: float = 1.0,
        norm_type: float = 2,
        *,
        adapter_name: str = DEFAULT_ADAPTER,
    ) -> float | None:
        return self._call(
            "clip_grad_norm", adapter_name, max_grad_norm=max_grad_norm, norm_type=norm_type
        )

    def step(self, *, adapter_name: str = DEFAULT_ADAPTER) -> dict[str, float] | None:
        return self._call("step", adapter_name)

    def zero_grad(self, *, adapter_name: str = DEFAULT_ADAPTER) -> None:
        self._call("zero_grad", adapter_name)

    def lr_step(self, *, adapter_name: str = DEFAULT_ADAPTER) -> None:
        self._call("lr_step", adapter_name)

    def clip_grad_and_step(
        self,
        max_grad_norm: float = 1.0,
        norm_type: float = 2,
        *,
        adapter_name: str = DEFAULT_ADAPTER,
    ) -> float | None:
        return self._call(
            "clip_grad_and_step", adapter_name, max_grad_norm=max_grad_norm, norm_type=norm_type
        )

    def calculate_metric(
        self, is_training: bool = True, *, adapter_name: str = DEFAULT_ADAPTER
    ) -> dict[str, float | None]:
        return self._call("calculate_metric", adapter_name, is_training=is_training)

    def add_metric(
        self,
        metric_cls: Any,
        *,
        adapter_name: str = DEFAULT_ADAPTER,
        is_training: bool | None = None,
        **kwargs,
    ) -> None:
        name = name_of(metric_cls, "metric_cls")
        self._call("add_metric", adapter_name, metric_cls=name, is_training=is_training, **kwargs)

    # -- checkpoints ---------------------------------------------------------------------------
    @staticmethod
    def _no_output_dir(output_dir: Any) -> None:
        if output_dir is not None:
            raise InvalidRequestError(
                "output_dir: checkpoints live on the server; pass a name (or a twinkle:// path)"
            )

    def save(
        self,
        name: str,
        output_dir: Any = None,
        *,
        adapter_name: str = DEFAULT_ADAPTER,
        save_optimizer: bool = False,
        consumed_train_samples: int | None = None,
        is_sampler: bool = False,
    ) -> str:
        """Save on the server; returns the checkpoint's ``twinkle://`` path."""
        self._no_output_dir(output_dir)
        out = self._call(
            "save",
            adapter_name,
            name=name,
            save_optimizer=save_optimizer,
            consumed_train_samples=consumed_train_samples,
            is_sampler=is_sampler,
        )
        return out["twinkle_path"]

    def load(
        self,
        name: str,
        output_dir: Any = None,
        *,
        adapter_name: str = DEFAULT_ADAPTER,
        load_optimizer: bool = False,
    ) -> str:
        self._no_output_dir(output_dir)
        return self._call("load", adapter_name, name=name, load_optimizer=load_optimizer)

    def resume_from_checkpoint(
        self,
        name: str,
        output_dir: Any = None,
        *,
        adapter_name: str = DEFAULT_ADAPTER,
        resume_only_model: bool = False,
    ) -> dict[str, Any]:
        self._no_output_dir(output_dir)
        return self._call(
            "resume_from_checkpoint", adapter_name, name=name, resume_only_model=resume_only_model
        )

    # -- lifetime ------------------------------------------------------------------------------
    def close(self) -> None:
        """Free this model's adapters on the server (its runs and checkpoints stay). Not part of
        the engine's class; optional (idle adapters are offloaded by the server anyway)."""
        self.client.post("twinkle/model/close", {"model_id": self.remote_id})
