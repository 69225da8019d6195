"""`init_tinker_client()`: lets existing Tinker SDK code use a Twinkle server.

A small, idempotent patch of the installed ``tinker`` package (imported lazily: the native client
does not depend on it). After ``init_tinker_client()``:

1. ``ServiceClient()`` with no arguments talks to ``$TWINKLE_SERVER_URL`` with the key
   ``$TWINKLE_SERVER_TOKEN`` (exported as ``TINKER_BASE_URL`` / ``TINKER_API_KEY``, which the SDK
   reads; explicit arguments still win), or, with none of them set, to a local quick-start
   server (local_server.py);
2. ``twinkle://run/weights/name`` paths are accepted wherever the SDK parses checkpoint paths
   (they mean the same as ``tinker://``);
3. ``get_tokenizer()`` on training and sampling clients downloads the base model's tokenizer files
   from the server (``GET /api/v1/twinkle/tokenizer``, authenticated, cached under
   ``~/.cache/twinkle/tokenizers``) instead of asking a model hub; models the server does not
   serve fall back to the SDK's own loader.

Calling it again only refreshes the URL and key. The unpatched SDK already works with a ``tml-``
key and ``tinker://`` paths; this only removes the last hub dependency and the path spelling.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import httpx

from twinkle_client import local_server

_patched = False


def _cache_dir() -> Path:
    root = os.environ.get("TWINKLE_CACHE_DIR") or Path.home() / ".cache" / "twinkle"
    return Path(root) / "tokenizers"


def fetch_tokenizer(base_url: str, api_key: str, base_model: str, dest: Path | None = None) -> Path:
    """Download ``base_model``'s tokenizer files from the server into ``dest`` (default: the
    cache); raises ``httpx.HTTPStatusError`` when the server does not serve that model."""
    base = base_url.rstrip("/").removesuffix("/api/v1") + "/api/v1/twinkle/tokenizer"
    out = dest or _cache_dir() / re.sub(r"[^A-Za-z0-9._-]+", "__", base_model)
    headers = {"X-API-Key": api_key}
    with httpx.Client(timeout=120, headers=headers) as http:
        listing = http.get(base, params={"base_model": base_model})
        listing.raise_for_status()
        out.mkdir(parents=True, exist_ok=True)
        for f in listing.json()["files"]:
            resp = http.get(f"{base}/{f['name']}", params={"base_model": base_model})
            resp.raise_for_status()
            tmp = out / f".{f['name']}.tmp"
            tmp.write_bytes(resp.content)
            tmp.replace(out / f["name"])
    return out


def as_tinker_path(path):
    """``twinkle://x`` → ``tinker://x``; anything else unchanged."""
    if isinstance(path, str) and path.startswith("twinkle://"):
        return "tinker://" + path[len("twinkle://") :]
    return path


def _patch_paths() -> None:
    from tinker.lib.internal_client_holder import InternalClientHolder
    from tinker.types.checkpoint import ParsedCheckpointTinkerPath

    original = ParsedCheckpointTinkerPath.from_tinker_path.__func__

    def from_tinker_path(cls, tinker_path: str):
        return original(cls, as_tinker_path(tinker_path))

    # a deliberate monkeypatch of the SDK's classmethod (pyright: methods are read-only)
    patched = classmethod(from_tinker_path)
    ParsedCheckpointTinkerPath.from_tinker_path = patched  # pyright: ignore[reportAttributeAccessIssue]

    # create_sampling_client(model_path=...) checks the prefix before sending
    create = InternalClientHolder._create_sampling_session

    async def _create_sampling_session(self, model_path=None, base_model=None):
        return await create(self, as_tinker_path(model_path), base_model)

    InternalClientHolder._create_sampling_session = _create_sampling_session


def _patch_tokenizer() -> None:
    from tinker.lib.public_interfaces import sampling_client, training_client

    original = sampling_client._load_tokenizer_from_model_info
    loaded: dict[str, object] = {}

    def load(model_name: str, tokenizer_id: str | None = None):
        base = (tokenizer_id or model_name.split(":")[0]).strip()
        if base in loaded:
            return loaded[base]
        url = os.environ.get("TINKER_BASE_URL", "")
        key = os.environ.get("TINKER_API_KEY", "")
        try:
            local = fetch_tokenizer(url, key, base)
        except (httpx.HTTPError, KeyError, ValueError):
            return original(model_name, tokenizer_id)  # not ours to serve: the SDK's own way
        from transformers import AutoTokenizer

        loaded[base] = tok = AutoTokenizer.from_pretrained(str(local))
        return tok

    sampling_client._load_tokenizer_from_model_info = load
    training_client._load_tokenizer_from_model_info = load


def init_tinker_client(base_url: str | None = None, api_key: str | None = None) -> None:
    """Point the Tinker SDK at a Twinkle server (see module doc). Idempotent."""
    global _patched
    url, key = local_server.resolve(
        base_url or os.environ.get("TWINKLE_SERVER_URL") or os.environ.get("TINKER_BASE_URL"),
        api_key or os.environ.get("TWINKLE_SERVER_TOKEN") or os.environ.get("TINKER_API_KEY"),
    )
    if url:
        os.environ["TINKER_BASE_URL"] = url.rstrip("/")
    if key:
        os.environ["TINKER_API_KEY"] = key
    if _patched:
        return
    _patch_paths()
    _patch_tokenizer()
    _patched = True
