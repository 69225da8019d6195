"""Request bodies of the OpenAI-compatible API (wire schemas; responses are built as dicts in
`gateway.openai_api.responses`).

Fields OpenAI defines that we do not implement are accepted only at their neutral value (checked in
`unsupported()`, a 400 naming the field otherwise); unknown fields are ignored, as OpenAI-compatible
servers usually do, so clients that send ``user`` or ``metadata`` keep working.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from gateway.deps import SEED_MAX, SEED_MIN

#: most choices per prompt (``n``) and most prompts per /v1/completions request
MAX_N = 16
MAX_PROMPTS = 32
MAX_STOP_STRINGS = 16


class _Req(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Req):
    include_usage: bool = False


class ImageURL(_Req):
    #: a ``data:image/png;base64,…`` / ``data:image/jpeg;base64,…`` URL (nothing is fetched)
    url: str
    detail: str | None = None  # OpenAI's low / high / auto: accepted and ignored


class ContentPart(_Req):
    """A part of a message's content: ``text`` (with ``text``) or ``image_url`` (VL models)."""

    type: str
    text: str | None = None
    image_url: ImageURL | None = None


class ChatMessage(_Req):
    role: str = Field(min_length=1, max_length=64)
    content: str | list[ContentPart] | None = None
    name: str | None = None


class _Common(_Req):
    model: str = Field(min_length=1, max_length=1024)
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=-1, description="extension (vLLM's): -1 = off")
    n: int = Field(default=1, ge=1, le=MAX_N)
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=SEED_MIN, le=SEED_MAX)
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, Any] | None = None

    def stop_strings(self) -> list[str]:
        from gateway.errors import InvalidRequestError

        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > MAX_STOP_STRINGS:
            raise InvalidRequestError(f"stop: at most {MAX_STOP_STRINGS} stop strings")
        if any(not s for s in stops):
            raise InvalidRequestError("stop: stop strings must be non-empty")
        return stops

    def unsupported(self) -> list[str]:
        """Names of fields set to values this server does not implement."""
        bad = []
        if self.presence_penalty:
            bad.append("presence_penalty")
        if self.frequency_penalty:
            bad.append("frequency_penalty")
        if self.logit_bias:
            bad.append("logit_bias")
        return bad


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    function_call: Any = None
    response_format: dict[str, Any] | None = None

    def unsupported(self) -> list[str]:
        bad = super().unsupported()
        if self.top_logprobs:
            bad.append("top_logprobs (only 0: the chosen tokens' logprobs are returned)")
        for name in ("tools", "functions"):
            if getattr(self, name):
                bad.append(name)
        for name in ("tool_choice", "function_call"):
            if getattr(self, name) not in (None, "none", "auto"):
                bad.append(name)
        if self.response_format and self.response_format.get("type", "text") != "text":
            bad.append("response_format")
        return bad


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0, le=5)
    echo: bool = False
    best_of: int | None = Field(default=None, ge=1)
    suffix: str | None = None

    def unsupported(self) -> list[str]:
        bad = super().unsupported()
        if self.logprobs is not None and self.logprobs > 1:
            bad.append("logprobs (at most 1: the chosen tokens' logprobs are returned)")
        if self.echo:
            bad.append("echo")
        if self.best_of is not None and self.best_of != self.n:
            bad.append("best_of")
        if self.suffix:
            bad.append("suffix")
        return bad
