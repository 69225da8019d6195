"""Samplers: ``vLLMSampler`` and ``TorchSampler`` (upstream's names), served by whichever sampler
the server runs for the base model.

`sample` takes chat trajectories (``{"messages": [...]}``, encoded server-side with the template
set here, generation prompt appended) or encoded features (``{"input_ids": [...]}``), and returns
one `SampleResponse` per input with the sampled tokens, their log-probs, the decoded text and
``new_input_feature`` (prompt + completion, completion-only labels, aligned ``logprobs``) ready for
an RL step once ``advantages`` are added. ``adapter_uri`` picks a checkpoint saved by the model
(``save(..., is_sampler=True)``); without it the base model samples.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from twinkle_client._client import TwinkleClient, get_client
from twinkle_client._serialize import name_of, to_wire
from twinkle_client.model import strip_hub_prefix


@dataclass
class SampledSequence:
    stop_reason: str
    tokens: list[int]
    #: upstream layout: per token, ``[[token_id, logprob]]`` (so ``logprobs[i][0][1]``)
    logprobs: list[list[list[float]]]
    token_logprobs: list[float]
    decoded: str
    new_input_feature: dict[str, list]


@dataclass
class SampleResponse:
    sequences: list[SampledSequence]
    prompt_tokens: list[int] = field(default_factory=list)
    prompt_logprobs: list[float | None] | None = None


class vLLMSampler:
    """Sampling from ``model_id`` (a served base model) or one of its adapters."""

    def __init__(self, model_id: str, *, client: TwinkleClient | None = None, **_: Any) -> None:
        self.client = get_client(client)
        self.model_id = strip_hub_prefix(str(model_id))
        self._template: dict[str, Any] = {"name": "Template", "kwargs": {}}

    def set_template(self, template: Any, **kwargs: Any) -> None:
        """Chat template for trajectories (checked by the server now: unknown names fail here)."""
        spec = {"name": name_of(template, "template"), "kwargs": to_wire(kwargs)}
        self.client.post(
            "twinkle/sampler/set_template", {"base_model": self.model_id, "template": spec}
        )
        self._template = spec

    def sample(
        self,
        inputs: Any,
        sampling_params: dict[str, Any] | None = None,
        adapter_name: str = "",
        adapter_uri: str | None = None,
        num_samples: int | None = None,
    ) -> list[SampleResponse] | SampleResponse:
        """One `SampleResponse` per input (a single dict input gives a single response).
        ``sampling_params``: max_tokens, temperature, top_p, top_k, seed, stop, num_samples,
        logprobs, prompt_logprobs."""
        single = isinstance(inputs, dict)
        items = [inputs] if single else list(inputs)
        params = dict(sampling_params or {})
        if num_samples is not None:
            params["num_samples"] = num_samples
        body = {
            "base_model": self.model_id,
            "template": self._template,
            "inputs": to_wire(items),
            "sampling_params": to_wire(params),
            "adapter_uri": adapter_uri,
        }
        out = self.client.post("twinkle/sample", body)["samples"]
        responses = [
            SampleResponse(
                sequences=[SampledSequence(**s) for s in o["sequences"]],
                prompt_tokens=o["prompt_tokens"],
                prompt_logprobs=o["prompt_logprobs"],
            )
            for o in out
        ]
        return responses[0] if single else responses


class TorchSampler(vLLMSampler):
    """Same as `vLLMSampler`: the server decides which sampler backend runs."""
