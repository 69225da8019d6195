"""`MultiLoraTransformersModel`: upstream Twinkle's client class, on this server.

Same methods, arguments, request bodies and return types as ``twinkle_client.model`` of
twinkle-kit 0.5.1, so upstream's cookbook scripts run unchanged. Each call is one synchronous
``POST /api/v1/model/<model_id>/twinkle/<method>`` with a flat JSON body ``{adapter_name,
<arguments>...}``; ``adapter_name`` is the adapter added last by `add_adapter_to_model` unless the
call names another (``adapter_name=`` in its keyword arguments wins).

Returns: ``forward`` / ``forward_only`` / ``forward_backward`` / ``calculate_metric`` /
``get_train_configs`` / ``clip_grad_norm`` an object with ``.result`` (also indexable, see
`twinkle_client.types`); ``save`` a `SaveResponse` (``.twinkle_path``); ``resume_from_checkpoint``
the progress dict; the rest None. Checkpoints live on the server: names or ``twinkle://`` paths
(a `SaveResponse` is accepted wherever a path is). Losses, optimizers, schedulers, templates,
processors and metrics travel by name (a class or instance is sent as its class name).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from twinkle_client import types as t
from twinkle_client._client import InvalidRequestError, TwinkleClient, TwinkleError, get_client
from twinkle_client._serialize import lora_config_json, name_of, to_wire


def strip_hub_prefix(model_id: str) -> str:
    """``ms://org/name`` / ``hf://org/name`` → ``org/name`` (as upstream: after ``://``)."""
    return model_id.split("://", 1)[1] if "://" in model_id else model_id


def checkpoint_name(name: Any) -> Any:
    """A checkpoint argument: a `SaveResponse` (or anything with ``twinkle_path``) → its path."""
    return getattr(name, "twinkle_path", name)


class MultiLoraTransformersModel:
    """LoRA adapters on the server's copy of ``model_id`` (a served base model; ``ms://`` /
    ``hf://`` prefixes are dropped). ``client``: a `TwinkleClient` (default: the current one)."""

    def __init__(self, model_id: str, *, client: TwinkleClient | None = None, **kwargs: Any):
        self.client = get_client(client)
        self.model_id = strip_hub_prefix(str(model_id))
        self.adapter_name: str | None = None
        self._added: list[str] = []
        self.route = f"model/{self.model_id}/twinkle"
        self.client.post(f"{self.route}/create", to_wire(kwargs))

    @property
    def server_url(self) -> str:
        return f"{self.client.base_url}/{self.route}"

    def _post(self, method: str, body: dict[str, Any]) -> dict[str, Any]:
        return self.client.post(f"{self.route}/{method}", to_wire(body))

    def _call(self, method: str, **fields: Any) -> dict[str, Any]:
        """``{adapter_name: <current>, **fields}`` (a field ``adapter_name`` overrides)."""
        return self._post(method, {"adapter_name": self.adapter_name, **fields})

    # -- adapters ------------------------------------------------------------------------------
    def add_adapter_to_model(self, adapter_name: str, config: Any = None, **kwargs: Any) -> None:
        """Add an adapter from a `peft.LoraConfig` or dict (sent as a JSON string; None: full
        parameter training where the server allows it). ``kwargs``: gradient_accumulation_steps,
        save_dir, ..."""
        if kwargs.get("save_dir"):
            kwargs["save_dir"] = Path(kwargs["save_dir"]).expanduser().resolve().as_posix()
        body = {"adapter_name": adapter_name, "config": lora_config_json(config), **kwargs}
        self._post("add_adapter_to_model", body)
        self.adapter_name = adapter_name
        if adapter_name not in self._added:
            self._added.append(adapter_name)

    def remove_adapter(self, adapter_name: str | None = None) -> None:
        """Free an adapter on the server (default: the current one). Not upstream's."""
        name = adapter_name or self.adapter_name
        self._post("remove_adapter", {"adapter_name": name})
        if name in self._added:
            self._added.remove(name)
        if name == self.adapter_name:
            self.adapter_name = self._added[-1] if self._added else None

    def set_template(self, template_cls: Any, **kwargs: Any) -> None:
        fields = {"model_id": self.model_id, **kwargs}  # as upstream: a given model_id wins
        self._call("set_template", template_cls=name_of(template_cls, "template_cls"), **fields)

    def set_processor(self, processor_cls: Any, **kwargs: Any) -> None:
        self._call("set_processor", processor_cls=name_of(processor_cls, "processor_cls"), **kwargs)

    def set_loss(self, loss_cls: Any, **kwargs: Any) -> None:
        self._call("set_loss", loss_cls=name_of(loss_cls, "loss_cls"), **kwargs)

    def set_optimizer(self, optimizer_cls: Any = "AdamW", **kwargs: Any) -> None:
        self._call("set_optimizer", optimizer_cls=name_of(optimizer_cls, "optimizer_cls"), **kwargs)

    def set_lr_scheduler(self, scheduler_cls: Any, **kwargs: Any) -> None:
        if callable(scheduler_cls) and not isinstance(scheduler_cls, type):
            raise InvalidRequestError(
                "scheduler_cls: a callable schedule cannot be sent to the server; give a name"
            )
        self._call(
            "set_lr_scheduler", scheduler_cls=name_of(scheduler_cls, "scheduler_cls"), **kwargs
        )

    def add_metric(self, metric_cls: Any, is_training: bool | None = None, **kwargs: Any) -> None:
        self._call(
            "add_metric",
            metric_cls=name_of(metric_cls, "metric_cls"),
            is_training=is_training,
            **kwargs,
        )

    def apply_patch(self, patch_cls: Any, **kwargs: Any) -> None:
        self._call("apply_patch", patch_cls=name_of(patch_cls, "patch_cls"), **kwargs)

    def get_train_configs(self, **kwargs: Any) -> t.GetTrainConfigsResponse:
        return t.GetTrainConfigsResponse(**self._call("get_train_configs", **kwargs))

    # -- passes --------------------------------------------------------------------------------
    def forward(self, inputs: Any, **kwargs: Any) -> t.ForwardResponse:
        return t.ForwardResponse(**self._call("forward", inputs=inputs, **kwargs))

    def forward_only(self, inputs: Any, **kwargs: Any) -> t.ForwardResponse:
        """A pass without gradients (``disable_lora=True``: the base model, e.g. DPO's
        reference)."""
        return t.ForwardResponse(**self._call("forward_only", inputs=inputs, **kwargs))

    def forward_backward(self, inputs: Any, **kwargs: Any) -> t.ForwardBackwardResponse:
        """A training pass. ``kwargs`` reach the loss: ``ref_outputs`` (DPO: a `forward_only`
        result), ``advantages`` / ``old_logps`` (GRPO), ``task``, ..."""
        return t.ForwardBackwardResponse(**self._call("forward_backward", inputs=inputs, **kwargs))

    def calculate_loss(self, **kwargs: Any) -> t.CalculateLossResponse:
        return t.CalculateLossResponse(**self._call("calculate_loss", **kwargs))

    def backward(self, **kwargs: Any) -> None:
        self._call("backward", **kwargs)

    # -- optimizer -----------------------------------------------------------------------------
    def clip_grad_norm(
        self, max_grad_norm: float = 1.0, norm_type: int = 2, **kwargs: Any
    ) -> t.ClipGradNormResponse:
        out = self._call(
            "clip_grad_norm", max_grad_norm=max_grad_norm, norm_type=norm_type, **kwargs
        )
        return t.ClipGradNormResponse(**out)

    def step(self, **kwargs: Any) -> None:
        self._call("step", **kwargs)

    def zero_grad(self, **kwargs: Any) -> None:
        self._call("zero_grad", **kwargs)

    def lr_step(self, **kwargs: Any) -> None:
        self._call("lr_step", **kwargs)

    def clip_grad_and_step(
        self, max_grad_norm: float = 1.0, norm_type: int = 2, **kwargs: Any
    ) -> None:
        """clip_grad_norm + step + zero_grad + lr_step in one call."""
        self._call("clip_grad_and_step", max_grad_norm=max_grad_norm, norm_type=norm_type, **kwargs)

    def calculate_metric(
        self, is_training: bool = True, **kwargs: Any
    ) -> t.CalculateMetricResponse:
        return t.CalculateMetricResponse(
            **self._call("calculate_metric", is_training=is_training, **kwargs)
        )

    def get_state_dict(self, **kwargs: Any) -> t.GetStateDictResponse:
        return t.GetStateDictResponse(**self._call("get_state_dict", **kwargs))

    # -- checkpoints ---------------------------------------------------------------------------
    def save(self, name: str, **kwargs: Any) -> t.SaveResponse:
        """Save on the server (``save_optimizer``, ``is_sampler``, ``consumed_train_samples``);
        ``.twinkle_path`` names the checkpoint."""
        return t.SaveResponse(**self._call("save", name=name, **kwargs))

    def load(self, name: Any, **kwargs: Any) -> None:
        """Load a checkpoint (name or ``twinkle://`` path; ``load_optimizer``)."""
        self._call("load", name=checkpoint_name(name), **kwargs)

    def resume_from_checkpoint(
        self, name: Any, *, resume_only_model: bool = False, **kwargs: Any
    ) -> dict[str, Any]:
        """Load weights and optimizer; returns ``{cur_step, consumed_train_samples, ...}``."""
        out = self._call(
            "resume_from_checkpoint",
            name=checkpoint_name(name),
            resume_only_model=resume_only_model,
            **kwargs,
        )
        return t.TrainingProgressResponse(**out).result

    def upload_to_hub(
        self,
        checkpoint_dir: Any,
        hub_model_id: str,
        hub_token: str | None = None,
        async_upload: bool = True,
        poll_interval: float = 5.0,
    ) -> None:
        """Asks the server; this server has no hub upload and answers so (raises)."""
        body = {
            "checkpoint_dir": checkpoint_name(checkpoint_dir),
            "hub_model_id": hub_model_id,
            "hub_token": hub_token,
        }
        try:
            out = self._post("upload_to_hub", body)
        except TwinkleError as exc:
            if exc.status_code in (404, 405, 501):
                raise TwinkleError(
                    "upload_to_hub is not available on this server: download the checkpoint "
                    f"({checkpoint_name(checkpoint_dir)}) and upload it yourself ({exc})",
                    exc.status_code,
                ) from None
            raise
        request_id = out.get("request_id")
        while request_id:
            status = self.client.get(f"{self.route}/upload_status/{request_id}")
            if status.get("status") == "completed":
                return
            if status.get("status") == "failed":
                raise TwinkleError(f"upload_to_hub failed: {status.get('error')}")
            time.sleep(poll_interval)

    # -- lifetime (not upstream's; optional) ---------------------------------------------------
    def close(self) -> None:
        """Free the adapters this object added (`remove_adapter` each; runs and checkpoints
        stay). Optional: the server frees a session's adapters when the session ends."""
        for name in list(self._added):
            self.remove_adapter(name)
