"""What the ``modelscope/`` scripts share: they run against a hosted, multi-tenant Twinkle service
(one server operated for many users, with quotas), not a server of your own.

* `require_server`: the URL from ``TWINKLE_SERVER_URL`` and the key from ``TWINKLE_SERVER_TOKEN``,
  else ``MODELSCOPE_TOKEN``. Both are required: with one missing the script exits 2 with one line
  naming the variable. There is no quick-start-file or localhost fallback, so a hosted script never
  trains on some other server by accident.
* `load_sibling`: the ``self_host/`` script of the same name, as a module. The training loops are
  those scripts' ``main``; a hosted script adds the environment, publishing and quota handling.
* `PatientTransport`: the native client's HTTP transport for rate windows. The client itself
  retries a 429 eight times, sleeping at most 10 s each (about 80 s, just over a per-minute
  window); this waits out each 429 for its full ``retry-after``, logging every wait on stderr,
  for up to `PATIENCE_S` per request, so a run under a tight ``*_tokens_per_minute`` quota (or
  competing with the same user's other jobs) slows down instead of crashing. The Tinker SDK
  needs none of this: it waits out 429s by itself.
* `publish_native` / `publish_tinker`: make a saved checkpoint public on the server (every user
  of the service can then load it and sample from it) and return its ``twinkle://`` path.
* `run`: print the script's one JSON line; a hard quota cap (403: training clients, LoRA rank,
  checkpoints, or one request bigger than a rate limit) or a rate limit that outlasted the
  waiting becomes the one line ``quota <name> exhausted: <server message>`` and exit code 3,
  without a traceback; a refused key, one line and exit code 2.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import httpx

URL_VAR, KEY_VAR, MODELSCOPE_VAR = "TWINKLE_SERVER_URL", "TWINKLE_SERVER_TOKEN", "MODELSCOPE_TOKEN"
EXIT_SETUP, EXIT_QUOTA = 2, 3
#: longest a hosted script waits out one request's rate limiting (429s in a row)
PATIENCE_S = 300.0


def log(line: str) -> None:
    print(f"[hosted] {line}", file=sys.stderr, flush=True)


def fail(code: int, line: str) -> None:
    print(line, file=sys.stderr, flush=True)
    raise SystemExit(code)


def require_server() -> tuple[str, str]:
    """``(url, key)`` of the hosted service from the environment (exit 2 naming what is missing).
    The key is exported as ``TWINKLE_SERVER_TOKEN`` too: both clients read that one."""
    url = os.environ.get(URL_VAR, "").strip()
    key = (os.environ.get(KEY_VAR) or os.environ.get(MODELSCOPE_VAR) or "").strip()
    if not url:
        fail(EXIT_SETUP, f"{URL_VAR} is not set: export the hosted service's URL")
    if not key:
        fail(EXIT_SETUP, f"{KEY_VAR} (or {MODELSCOPE_VAR}) is not set: export your API key")
    os.environ[URL_VAR], os.environ[KEY_VAR] = url, key
    return url, key


def load_sibling(script: str, name: str | None = None) -> ModuleType:
    """``../self_host/<name>.py`` next to ``script``'s folder (default: the same file name), loaded
    as a module (its ``if __name__ == "__main__"`` part does not run)."""
    path = Path(script).resolve().parents[1] / "self_host" / f"{name or Path(script).stem}.py"
    spec = importlib.util.spec_from_file_location(f"self_host_{path.stem}", path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def as_twinkle_path(path: str) -> str:
    """``tinker://x`` → ``twinkle://x`` (the same checkpoint; the spelling these scripts print)."""
    return "twinkle://" + path.removeprefix("tinker://") if path.startswith("tinker://") else path


def _detail(resp: httpx.Response) -> str:
    try:
        return str(resp.json().get("detail") or resp.text)
    except (ValueError, AttributeError):
        return resp.text


def _retry_after(resp: httpx.Response) -> float:
    try:
        return max(0.5, float(resp.headers.get("retry-after", "1")))
    except ValueError:
        return 1.0


class PatientTransport(httpx.HTTPTransport):
    """Resends a request answered 429 after its ``retry-after`` (logged), until it passes or the
    caller's thread has been refused for `PATIENCE_S` in a row; a wait that would end beyond
    that returns the 429 at once (to the client's own retries, then a `RateLimitedError`).
    Safe to resend: a 429 means the server charged nothing and ran nothing."""

    def __init__(self, patience_s: float = PATIENCE_S, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.patience_s = patience_s
        self.waited_s = 0.0
        # per thread: the heartbeat thread's answers must not reset the training loop's streak
        self._streak = threading.local()

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        while True:
            resp = super().handle_request(request)
            if resp.status_code != 429:
                self._streak.since = None
                return resp
            now = time.monotonic()
            since = getattr(self._streak, "since", None) or now
            self._streak.since = since
            resp.read()
            wait = _retry_after(resp)
            if now + wait > since + self.patience_s:
                return resp
            log(f"429 {_detail(resp)} -- waiting {wait:.0f} s (retry-after)")
            resp.close()
            time.sleep(wait)
            self.waited_s += wait


def native_client():
    """The native client for the hosted service (`init_twinkle_client`, so models and datasets use
    it too) with the `PatientTransport`."""
    from twinkle_client import init_twinkle_client

    url, key = require_server()
    return init_twinkle_client(url, key, transport=PatientTransport())


def publish_native(client, path: str) -> str:
    """Make a native client's checkpoint public; its ``twinkle://`` path."""
    ckpt = client.publish_checkpoint(path)
    log(f"published {ckpt.twinkle_path} (public: {ckpt.public})")
    return ckpt.twinkle_path


def publish_tinker(path: str) -> str:
    """Make a Tinker SDK checkpoint (``tinker://`` or ``twinkle://``) public; its ``twinkle://``
    path."""
    import tinker

    tinker.RestClient().publish_checkpoint_from_tinker_path(path).result()
    log(f"published {as_twinkle_path(path)}")
    return as_twinkle_path(path)


_QUOTA_RE = re.compile(r"\b(?:quota|rate limit) ([a-z_]+)\b")


def _refusal(exc: BaseException) -> tuple[int, str, str | None] | None:
    """``(HTTP status, server message, quota name)`` when ``exc`` is the server refusing a request
    of either client (status 0: a Tinker future that failed with that message)."""
    from twinkle_client import TwinkleError

    if isinstance(exc, TwinkleError):
        msg = re.sub(r"^HTTP \d+: ", "", exc.message)
        return exc.status_code, msg, None
    tinker = sys.modules.get("tinker")
    if tinker is None:
        return None
    if isinstance(exc, tinker.APIStatusError):
        body = exc.body if isinstance(exc.body, dict) else {}
        quota = body.get("quota") if isinstance(body.get("quota"), dict) else {}
        return exc.status_code, str(body.get("detail") or exc.message), quota.get("name")
    if isinstance(exc, tinker.RequestFailedError):  # a refused request failed in order
        # the SDK wraps the server's message: "Request failed: <it> for self.request_id=..."
        msg = re.sub(r" for self\.request_id=.*$", "", exc.message, flags=re.S)
        return 0, msg.removeprefix("Request failed: "), None
    return None


def run(fn: Callable[[], dict]) -> None:
    """``fn()`` and its result as one JSON line on stdout; quota refusals exit 3, a refused key
    exits 2, each as one line on stderr (see the module doc); anything else propagates."""
    try:
        out = fn()
    except Exception as exc:
        got = _refusal(exc)
        if got is None:
            raise
        status, msg, quota = got
        if status == 401:
            fail(EXIT_SETUP, f"the server refused the API key: {msg}")
        m = _QUOTA_RE.search(msg)
        quota = quota or (m.group(1) if m else None)
        if quota is None or status not in (0, 403, 429):
            raise
        fail(EXIT_QUOTA, f"quota {quota} exhausted: {msg}")
    print(json.dumps(out), flush=True)
