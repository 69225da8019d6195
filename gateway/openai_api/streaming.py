"""Incremental SSE streaming for the OpenAI-compatible API: the final-text events of
`gateway.training.text_stream` as OpenAI stream chunks, sent as the tokens are generated, not
after the end. Text is sent only once it is final:

* the newest token is held back (its bytes may end inside a multi-byte character, whose text a
  later token completes);
* with stop strings, the last ``max(len(stop)) - 1`` characters are held back too, so a stop string
  that is still being generated is never sent (OpenAI semantics: the stop text is not returned);
* at the end, the rest comes from the same `text_stream.finish` the non-streaming path uses, so the
  streamed text always equals the non-streamed text.

The first engine event is awaited before the HTTP response starts (`open_stream`), so a request
the engine rejects still gets a plain 4xx JSON error, not a broken stream.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable

from engine.errors import EngineError
from gateway.openai_api import responses as R
from gateway.training.text_stream import FinishEvent, TextEvent


def _error_chunk(exc: Exception) -> bytes:
    return R.sse({"error": {"message": str(exc), "type": type(exc).__name__}})


class _Sse:
    """One SSE response: the chunk envelope (id, object, created, model) and the tail every
    stream shares (optional usage, ``[DONE]``, then ``finish``)."""

    def __init__(self, rid: str, obj: str, created: int, model: str, include_usage: bool):
        self.head = {
            "id": rid,
            "object": obj,
            "created": created,
            "model": model,
            "system_fingerprint": None,
        }
        self.include_usage = include_usage

    def chunk(self, choice: dict) -> bytes:
        body = {**self.head, "choices": [choice]}
        if self.include_usage:
            body["usage"] = None
        return R.sse(body)

    def finish_chunk(self, ev: FinishEvent) -> bytes:
        """The chunk that ends one choice; each stream kind renders its own."""
        raise NotImplementedError

    async def run(
        self,
        first: list[bytes],
        events: AsyncIterator[TextEvent | FinishEvent],
        text: Callable[[TextEvent], bytes],
        prompt_tokens: int,
        finish: Callable[[list[R.Choice] | None], Awaitable[None]],
    ) -> AsyncIterator[bytes]:
        finished: list[R.Choice] = []
        complete = False
        try:
            for b in first:
                yield b
            try:
                async for ev in events:
                    if isinstance(ev, TextEvent):
                        yield text(ev)
                    else:
                        finished.append(ev.choice)
                        yield self.finish_chunk(ev)
            except EngineError as exc:
                yield _error_chunk(exc)
                return
            if self.include_usage:
                usage = R.usage(prompt_tokens, finished)
                yield R.sse({**self.head, "choices": [], "usage": usage})
            yield R.sse("[DONE]")
            complete = True
        finally:
            # ``finish`` gets the choices only for a stream that ran to the end (usage is
            # charged for what was generated); a failed or abandoned stream refunds its budget
            await finish(finished if complete else None)


class _ChatSse(_Sse):
    def finish_chunk(self, ev: FinishEvent) -> bytes:
        return self.chunk(
            {
                "index": ev.index,
                "delta": {},
                "logprobs": None,
                "finish_reason": ev.choice.finish_reason,
            }
        )


class _CompletionSse(_Sse):
    def finish_chunk(self, ev: FinishEvent) -> bytes:
        return self.chunk(
            {
                "index": ev.index,
                "text": "",
                "logprobs": None,
                "finish_reason": ev.choice.finish_reason,
            }
        )


def chat_sse(
    rid: str,
    model: str,
    created: int,
    n: int,
    events: AsyncIterator[TextEvent | FinishEvent],
    prompt_tokens: int,
    logprobs: bool,
    include_usage: bool,
    finish: Callable[[list[R.Choice] | None], Awaitable[None]],
) -> AsyncIterator[bytes]:
    """chat.completion.chunk events: a role delta per choice, content deltas as text becomes
    final, a finish_reason delta per choice, optional usage, then ``[DONE]``."""
    sse = _ChatSse(rid, "chat.completion.chunk", created, model, include_usage)

    def text(ev: TextEvent) -> bytes:
        lps = None
        if logprobs:
            content = [
                R._chat_token_logprob(p, lp) for p, lp in zip(ev.pieces, ev.logprobs, strict=False)
            ]
            lps = {"content": content, "refusal": None}
        delta = {"content": ev.text}
        return sse.chunk(
            {"index": ev.index, "delta": delta, "logprobs": lps, "finish_reason": None}
        )

    role = [
        sse.chunk(
            {
                "index": i,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
        )
        for i in range(n)
    ]
    return sse.run(role, events, text, prompt_tokens, finish)


def completion_sse(
    rid: str,
    model: str,
    created: int,
    events: AsyncIterator[TextEvent | FinishEvent],
    prompt_tokens: int,
    logprobs: bool,
    include_usage: bool,
    finish: Callable[[list[R.Choice] | None], Awaitable[None]],
) -> AsyncIterator[bytes]:
    """text_completion stream chunks: text as it becomes final, a finish_reason chunk per choice,
    optional usage, then ``[DONE]``."""
    sse = _CompletionSse(rid, "text_completion", created, model, include_usage)
    offsets: dict[int, int] = {}  # characters sent so far per choice, for text_offset

    def text(ev: TextEvent) -> bytes:
        lps = None
        off = offsets.get(ev.index, 0)
        if logprobs:
            starts = []
            for piece in ev.pieces:
                starts.append(off)
                off += len(piece)
            lps = {
                "tokens": ev.pieces,
                "token_logprobs": ev.logprobs,
                "top_logprobs": None,
                "text_offset": starts,
            }
        offsets[ev.index] = offsets.get(ev.index, 0) + len(ev.text)
        return sse.chunk(
            {"index": ev.index, "text": ev.text, "logprobs": lps, "finish_reason": None}
        )

    return sse.run([], events, text, prompt_tokens, finish)
