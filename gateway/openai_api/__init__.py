"""OpenAI-compatible API (/v1/models, /v1/chat/completions, /v1/completions) over the engine's
Sampler, behind the same API keys as the Tinker API. See `router`."""

from gateway.openai_api.router import router

__all__ = ["router"]
