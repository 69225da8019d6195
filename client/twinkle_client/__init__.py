"""twinkle_client: the native client of a Twinkle server.

Light by design (httpx and numpy, no torch), so it installs anywhere a training loop runs.
``from twinkle_client.model import MultiLoraTransformersModel`` mirrors the engine's in-process
class; ``twinkle_client.sampler`` samples; ``twinkle_client.dataset`` / ``dataloader`` /
``template`` / ``preprocessor`` prepare data; `init_tinker_client` points the Tinker SDK here.
"""

from twinkle_client._client import (
    AuthenticationError,
    InvalidRequestError,
    NotFoundError,
    RateLimitedError,
    ServerError,
    TwinkleClient,
    TwinkleError,
    get_client,
    init_twinkle_client,
)
from twinkle_client._version import __version__
from twinkle_client.tinker_compat import init_tinker_client

__all__ = [
    "AuthenticationError",
    "InvalidRequestError",
    "NotFoundError",
    "RateLimitedError",
    "ServerError",
    "TwinkleClient",
    "TwinkleError",
    "__version__",
    "get_client",
    "init_tinker_client",
    "init_twinkle_client",
]
