"""Sampled text as it becomes final: the engine's token stream (or a finished sample) turned
into the text a client may be shown, cut at its stop strings. Shared by every dialect that
streams or stops on strings (OpenAI's SSE, the native ``sample_stream``).

Owns `Choice` and `finish` (one finished sequence: text cut at the first stop string, whose text
is never returned; tokens after the cut dropped; finish reason "stop" or "length"), and
`sample_events` / `open_stream` (the token stream as `TextEvent`s then one `FinishEvent` per
sequence). Text is sent only once it is final:

* the newest token is held back (its bytes may end inside a multi-byte character, whose text a
  later token completes);
* with stop strings, the last ``max(len(stop)) - 1`` characters are held back too, so a stop string
  that is still being generated is never sent;
* at the end, the rest comes from the same `finish` a non-streaming answer uses, so streamed text
  always equals non-streamed text.

The first engine event is awaited before an HTTP response starts (`open_stream`), so a request
the engine rejects still gets a plain 4xx JSON error, not a broken stream.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from engine.errors import EngineError
from engine.protocol import SampleDelta, SampleInput


@dataclass
class Choice:
    index: int
    text: str
    pieces: list[str]  # the text each kept token adds; "".join(pieces) == text
    logprobs: list[float]  # one per kept token
    finish_reason: str  # "stop" | "length"
    n_tokens: int  # every generated token, for usage (the stop text / EOS token included)


def finish(
    index: int, pieces: list[str], logprobs: list[float], stop_reason: str, stops: list[str]
) -> Choice:
    full = "".join(pieces)
    cuts = [i for s in stops if (i := full.find(s)) >= 0]
    text = full[: min(cuts)] if cuts else full
    reason = "stop" if cuts else ("length" if stop_reason == "length" else "stop")
    kept: list[str] = []
    kept_lps: list[float] = []
    off = 0
    for piece, lp in zip(pieces, logprobs, strict=False):
        if off >= len(text):  # tokens after the cut (and a trailing EOS, which adds no text)
            break
        kept.append(piece[: len(text) - off])
        kept_lps.append(float(lp))
        off += len(piece)
    return Choice(index, text, kept, kept_lps, reason, len(pieces))


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
    choice: Choice


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
                c = finish(t.index, pieces, list(seq.logprobs), seq.stop_reason, stops)
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
