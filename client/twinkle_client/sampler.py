"""Samplers: ``vLLMSampler`` and ``TorchSampler`` (upstream's names; the server runs whichever
sampler backend it has for the base model).

Upstream's protocol: ``POST /api/v1/sampler/<model_id>/twinkle/<method>`` with flat bodies.
`sample` takes chat trajectories (``{"messages": [...]}``, encoded on the server with the template
set here, generation prompt appended) or encoded features (``{"input_ids": [...]}``) and returns
one `SampleResponseModel` per input: ``.sequences[j]`` has ``tokens``, ``logprobs`` (per position
``[[token_id, logprob]]``, so ``logprobs[i][0][1]``), ``decoded``, ``stop_reason`` and
``new_input_feature`` (prompt + completion as a training row, ready for ``forward_backward``).
``adapter_uri`` picks a checkpoint saved by the model (``save(..., is_sampler=True)``).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from twinkle_client import types as t
from twinkle_client._client import TwinkleClient, get_client
from twinkle_client._serialize import lora_config_dict, name_of, to_wire
from twinkle_client.model import checkpoint_name, strip_hub_prefix


class vLLMSampler:
    """Sampling from ``model_id`` (a served base model) or one of its adapters."""

    def __init__(self, model_id: str, *, client: TwinkleClient | None = None, **kwargs: Any):
        self.client = get_client(client)
        self.model_id = strip_hub_prefix(str(model_id))
        self.adapter_name: str | None = None
        self.route = f"sampler/{self.model_id}/twinkle"
        self.client.post(f"{self.route}/create", to_wire(kwargs))

    @property
    def server_url(self) -> str:
        return f"{self.client.base_url}/{self.route}"

    def _post(self, method: str, body: dict[str, Any]) -> dict[str, Any]:
        return self.client.post(f"{self.route}/{method}", to_wire(body))

    def set_template(
        self, template_cls: Any, adapter_name: str = "", **kwargs: Any
    ) -> t.OkResponse:
        """Chat template for trajectories (``model_id=...`` and template options in kwargs)."""
        body = {
            "template_cls": name_of(template_cls, "template_cls"),
            "adapter_name": adapter_name,
            **kwargs,
        }
        return t.OkResponse(**self._post("set_template", body))

    def add_adapter_to_sampler(
        self, adapter_name: str, config: Any, **kwargs: Any
    ) -> t.AddAdapterResponse:
        body = {"adapter_name": adapter_name, "config": lora_config_dict(config), **kwargs}
        out = t.AddAdapterResponse(**self._post("add_adapter_to_sampler", body))
        self.adapter_name = adapter_name
        return out

    def apply_patch(self, patch_cls: Any, **kwargs: Any) -> None:
        body = {"patch_cls": name_of(patch_cls, "patch_cls"), "adapter_name": self.adapter_name}
        self._post("apply_patch", {**body, **kwargs})

    def _sample_body(
        self,
        inputs: Any,
        sampling_params: dict[str, Any] | None,
        adapter_name: str,
        adapter_uri: Any,
        num_samples: int,
    ) -> dict[str, Any]:
        items = [inputs] if isinstance(inputs, dict) else list(inputs)
        body: dict[str, Any] = {
            "inputs": items,
            "sampling_params": sampling_params,
            "adapter_name": adapter_name,
            "num_samples": num_samples,
        }
        if adapter_uri is not None:
            body["adapter_uri"] = checkpoint_name(adapter_uri)
        return body

    def sample(
        self,
        inputs: Any,
        sampling_params: dict[str, Any] | None = None,
        adapter_name: str = "",
        adapter_uri: Any = None,
        num_samples: int = 1,
    ) -> list[t.SampleResponseModel]:
        """One response per input (a single dict counts as a list of one). ``sampling_params``:
        max_tokens, temperature, top_p, top_k, seed, stop, num_samples (completions per input),
        logprobs, prompt_logprobs."""
        body = self._sample_body(inputs, sampling_params, adapter_name, adapter_uri, num_samples)
        out = self._post("sample", body)
        return [t.SampleResponseModel(**r) for r in out["samples"]]

    def sample_stream(
        self,
        inputs: Any,
        sampling_params: dict[str, Any] | None = None,
        adapter_name: str = "",
        adapter_uri: Any = None,
    ) -> Iterator[dict[str, Any]]:
        """Text deltas of one completion as they come: ``{"delta", "finish_reason"}`` dicts
        (upstream's newline-delimited JSON stream)."""
        body = to_wire(self._sample_body(inputs, sampling_params, adapter_name, adapter_uri, 1))
        resp = self.client.request("POST", f"{self.route}/sample_stream", json=body)
        for line in resp.text.splitlines():
            if line.strip():
                yield json.loads(line)


class TorchSampler(vLLMSampler):
    """Same as `vLLMSampler`: the server decides which sampler backend runs."""
