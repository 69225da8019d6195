"""OpenAI response bodies and stream chunks, built from finished engine samples.

`finish()` (`gateway.training.text_stream`) turns one sampled sequence into a `Choice`: text cut
at the first stop string (OpenAI semantics: the stop string is not returned), finish reason
"stop" or "length". The builders below render choices as OpenAI's JSON shapes; streaming (SSE
chunks as tokens are generated) is `streaming`, which ends with the same `finish`.
"""

from __future__ import annotations

import json
import time
import uuid

from gateway.training.text_stream import Choice


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, choices: list[Choice]) -> dict:
    completion = sum(c.n_tokens for c in choices)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": prompt_tokens + completion,
    }


def sse(obj: dict | str) -> bytes:
    data = obj if isinstance(obj, str) else json.dumps(obj, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


# ----------------------------------------------------------------------------------------- chat


def _chat_token_logprob(piece: str, lp: float) -> dict:
    return {"token": piece, "logprob": lp, "bytes": list(piece.encode("utf-8")), "top_logprobs": []}


def chat_logprobs(c: Choice, lo: int = 0, hi: int | None = None) -> dict:
    hi = len(c.pieces) if hi is None else hi
    content = [_chat_token_logprob(c.pieces[i], c.logprobs[i]) for i in range(lo, hi)]
    return {"content": content, "refusal": None}


def chat_completion(
    rid: str, model: str, created: int, choices: list[Choice], prompt_tokens: int, logprobs: bool
) -> dict:
    return {
        "id": rid,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "system_fingerprint": None,
        "choices": [
            {
                "index": c.index,
                "message": {"role": "assistant", "content": c.text, "refusal": None},
                "logprobs": chat_logprobs(c) if logprobs else None,
                "finish_reason": c.finish_reason,
            }
            for c in choices
        ],
        "usage": usage(prompt_tokens, choices),
    }


# ---------------------------------------------------------------------------------- completions


def completion_logprobs(c: Choice, lo: int = 0, hi: int | None = None) -> dict:
    """Legacy shape; ``text_offset`` counts characters from the start of the completion text."""
    hi = len(c.pieces) if hi is None else hi
    offsets, off = [], 0
    for i in range(hi):
        if i >= lo:
            offsets.append(off)
        off += len(c.pieces[i])
    return {
        "tokens": c.pieces[lo:hi],
        "token_logprobs": c.logprobs[lo:hi],
        "top_logprobs": None,
        "text_offset": offsets,
    }


def completion(
    rid: str, model: str, created: int, choices: list[Choice], prompt_tokens: int, logprobs: bool
) -> dict:
    return {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "system_fingerprint": None,
        "choices": [
            {
                "index": c.index,
                "text": c.text,
                "logprobs": completion_logprobs(c) if logprobs else None,
                "finish_reason": c.finish_reason,
            }
            for c in choices
        ],
        "usage": usage(prompt_tokens, choices),
    }


def now() -> int:
    return int(time.time())
