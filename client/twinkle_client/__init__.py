"""twinkle_client: the native client of a Twinkle server.

Light by design (httpx only, no torch), so it installs anywhere a training loop runs.
"""

from twinkle_client._client import TwinkleClient, TwinkleError, init_twinkle_client

__all__ = ["TwinkleClient", "TwinkleError", "init_twinkle_client"]
__version__ = "0.1.0"
