"""Chat templates on the client: a name the server knows plus options, and encoding through the
server (``POST /api/v1/twinkle/encode``), so the client needs neither a tokenizer library nor a
model hub. `Template` is the generic one (the base model's ChatML); the family classes are
upstream's names for the same renderer. ``model.set_template(t)`` and ``sampler.set_template(t)``
accept an instance (its name and options are sent).

Encoding a trajectory ``{"messages": [{"role", "content"}, ...]}`` gives ``{"input_ids",
"labels", ...}`` with upstream's ROLLED labels (``labels[i]`` is the target of ``input_ids[i]``, the
last is -100; only assistant turns are trained, the rest is -100); the trajectory's own keys
(``messages`` included) are kept next to them, as upstream's Template does.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from twinkle_client._client import TwinkleClient, get_client
from twinkle_client._serialize import to_wire
from twinkle_client.model import strip_hub_prefix

_BATCH = 256


def template_class(name: Any) -> type[Template]:
    """The client class for a template name (unknown names: the generic class with that name,
    which the server checks)."""
    if isinstance(name, type) and issubclass(name, Template):
        return name
    key = name if isinstance(name, str) else getattr(name, "__name__", type(name).__name__)
    found = TEMPLATES.get(key)
    return found if found is not None else type(key, (Template,), {"template_name": key})


class Template:
    template_name = "Template"

    def __init__(
        self,
        model_id: str,
        *,
        max_length: int | None = None,
        truncation_strategy: str = "right",
        default_system: str | None = None,
        client: TwinkleClient | None = None,
        **options: Any,
    ) -> None:
        """``options``: further template options the server knows (e.g. ``enable_thinking``)."""
        self.model_id = strip_hub_prefix(str(model_id))
        self.client = get_client(client)
        self.options: dict[str, Any] = {"truncation_strategy": truncation_strategy}
        if max_length is not None:
            self.options["max_length"] = max_length
        if default_system is not None:
            self.options["default_system"] = default_system
        self.options.update({k: to_wire(v) for k, v in options.items() if v is not None})

    def batch_encode(
        self, trajectories: Iterable[Mapping[str, Any]], add_generation_prompt: bool = False
    ) -> list[dict[str, Any]]:
        items = [dict(t) for t in trajectories]
        out: list[dict[str, Any]] = []
        for k in range(0, len(items), _BATCH):
            chunk = items[k : k + _BATCH]
            body = {
                "base_model": self.model_id,
                "template": {"name": self.template_name, "kwargs": self.options},
                "inputs": [{"messages": to_wire(t["messages"])} for t in chunk],
                "add_generation_prompt": add_generation_prompt,
            }
            feats = self.client.post("twinkle/encode", body)["features"]
            for t, f in zip(chunk, feats, strict=True):
                out.append({**t, **f})
        return out

    def encode(
        self, trajectory: Mapping[str, Any], add_generation_prompt: bool = False
    ) -> dict[str, Any]:
        return self.batch_encode([trajectory], add_generation_prompt)[0]


class ChatMLTemplate(Template):
    template_name = "ChatMLTemplate"


class Qwen2Template(Template):
    template_name = "Qwen2Template"


class Qwen3Template(Template):
    template_name = "Qwen3Template"


class Qwen3_5Template(Template):
    template_name = "Qwen3_5Template"


class SmolLMTemplate(Template):
    template_name = "SmolLMTemplate"


TEMPLATES: dict[str, type[Template]] = {
    c.template_name: c
    for c in (
        Template,
        ChatMLTemplate,
        Qwen2Template,
        Qwen3Template,
        Qwen3_5Template,
        SmolLMTemplate,
    )
}
