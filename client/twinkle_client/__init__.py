"""twinkle_client: the native client of a Twinkle server.

Light by design (httpx, numpy and pydantic, no torch), so it installs anywhere a training loop
runs. It speaks upstream Twinkle's native protocol (twinkle-kit 0.5.1) with upstream's public API:
``from twinkle_client.model import MultiLoraTransformersModel`` and
``from twinkle_client.sampler import vLLMSampler`` behave as upstream's; ``twinkle_client.types``
holds the response objects; ``twinkle_client.dataset`` / ``dataloader`` / ``template`` /
``preprocessor`` prepare data; `init_tinker_client` points the Tinker SDK here.
"""

from twinkle_client._client import (
    AuthenticationError,
    InvalidRequestError,
    NotFoundError,
    RateLimitedError,
    ServerError,
    TwinkleClient,
    TwinkleClientError,
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
    "TwinkleClientError",
    "TwinkleError",
    "__version__",
    "get_client",
    "init_tinker_client",
    "init_twinkle_client",
]
