"""Incremental SSE streaming for the OpenAI-compatible API.

Owns turning the engine's token stream (`Sampler.sample_stream`: token deltas per sample, then the
whole output) into OpenAI stream chunks as the tokens are generated, not after the end. Text is
sent only once it is final:

* the newest token is held back (its bytes may end inside a multi-byte character, whose text a
  later token completes);
* with stop strings, the last ``max(len(stop)) - 1`` characters are held back too, so a stop string
  that is still being generated is never sent (OpenAI semantics: the stop text is not returned);
* at the end, the rest comes from the same `responses.finish` the non-streaming path uses, so the
  streamed text always equals the non-streamed text.

The first engine event is awaited before the HTTP response starts (`open_stream`), so a request
the engine rejects still gets a plain 4xx JSON error, not a broken stream.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

from engine.errors import EngineError
from engine.protocol import SampleDelta, SampleInput
from gateway.openai_api import responses as R


@dataclass
class TextEvent:
    """New text of choice ``index``, with the tokens (text pieces and logprobs) it came from."""

    index: int
    pieces: list[str]
    logprobs: list[float]

    @property
    def text(self) -> str:
        return "".join(self.pieces)


@dataclass
class FinishEvent:
    index: int
    choice: R.Choice


@dataclass
class _Track:
    index: int
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    sent_tokens: int = 0
    sent_chars: int = 0


def _sendable(pieces: list[str], sent: int, limit: int) -> int:
    """How many tokens (counted from the start) may be sent: those from ``sent`` on that lie
    wholly within the first ``limit`` characters, minus trailing tokens that add no text yet
    (they ride with the token that completes their character)."""
    chars = sum(len(p) for p in pieces[:sent])
    end = sent
    for i in range(sent, len(pieces)):
        chars += len(pieces[i])
        if chars > limit:
            break
        if pieces[i]:
            end = i + 1
    return end


async def sample_events(
    engine,
    base_model: str,
    inp: SampleInput,
    stops: list[str],
    first_index: int,
) -> AsyncIterator[TextEvent | FinishEvent]:
    """Stream one engine request (``inp.num_samples`` choices numbered from ``first_index``)."""
    tracks = [_Track(first_index + s) for s in range(inp.num_samples)]
    hold = max((len(s) for s in stops), default=1) - 1
    decode = engine.sampler(base_model).decode_pieces
    stream = engine.sampler(base_model, affinity=inp.adapter_dir).sample_stream(inp)
    async for delta in stream:
        delta: SampleDelta
        if delta.final is not None:
            for s, seq in enumerate(delta.final.sequences):
                t = tracks[s]
                pieces = await decode(list(seq.tokens))
                c = R.finish(t.index, pieces, list(seq.logprobs), seq.stop_reason, stops)
                rest_pieces = c.pieces[t.sent_tokens :]
                rest_text = c.text[t.sent_chars :]
                if rest_text or rest_pieces:
                    # normally rest_text == "".join(rest_pieces); for a decoder whose pieces are
                    # not prefix-stable the text wins, so the stream still equals the whole text
                    if "".join(rest_pieces) != rest_text:
                        rest_pieces = [rest_text] + [""] * max(0, len(rest_pieces) - 1)
                    yield TextEvent(t.index, rest_pieces, c.logprobs[t.sent_tokens :])
                yield FinishEvent(t.index, c)
            return
        for s, toks in delta.tokens.items():
            t = tracks[s]
            t.tokens += toks
            t.logprobs += delta.logprobs.get(s, [])
            if len(t.tokens) < 2:
                continue
            pieces = (await decode(t.tokens))[:-1]
            text = "".join(pieces)
            limit = len(text) - hold
            cuts = [i for st in stops if (i := text.find(st)) >= 0]
            if cuts:
                limit = min(limit, min(cuts))
            end = _sendable(pieces, t.sent_tokens, limit)
            if end > t.sent_tokens:
                ev = TextEvent(
                    t.index, pieces[t.sent_tokens : end], t.logprobs[t.sent_tokens : end]
                )
                t.sent_tokens = end
                t.sent_chars += len(ev.text)
                yield ev


async def open_stream(
    events: AsyncIterator[TextEvent | FinishEvent],
    on_error: Callable[[EngineError], Exception],
) -> AsyncIterator[TextEvent | FinishEvent]:
    """Await the first event now (engine errors become ``on_error(exc)``, raised before any byte
    is sent), and return an iterator that replays it, then the rest."""
    try:
        first = await anext(events)
    except StopAsyncIteration:
        first = None
    except EngineError as exc:
        raise on_error(exc) from None

    async def replay() -> AsyncIterator[TextEvent | FinishEvent]:
        if first is not None:
            yield first
        async for ev in events:
            yield ev

    return replay()


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
