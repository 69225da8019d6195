"""The model's text side, served by the Sampler replica: the one source of tokenization and chat
templates for every dialect (the OpenAI routes and the native Twinkle routes alike).

Owns: `SamplerText`, the Sampler's tokenizer methods (encode a prompt or chat, decode, stream
pieces, the EOS token), `render_trajectory` (a native trajectory as input ids and labels, by the
model's own chat template) and the tokenizer files a client may download. The tokenizer lives with
the model, so the gateway never imports transformers nor reads the engine's model folders.
Tokenizing is cheap and keeps no state, so these run on the event loop, never queued behind a
generation on the sampling thread. Text is decoded without special tokens and without clean-up of
tokenization spaces.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from engine.config import ModelConfig
from engine.errors import BackendError, UserInputError
from engine.storage import SharedDirStorage

#: the label of a position that is not trained (Hugging Face's ignore index)
IGNORE_INDEX = -100
#: upstream Twinkle's image placeholder in a message's content (the message's ``images`` hold them)
IMAGE_PLACEHOLDER = "<image>"
#: the roles of upstream Twinkle's ``Message``
ROLES = ("assistant", "system", "tool", "user")
#: what stands in for each assistant content when the template is rendered a second time to find
#: where the contents are (upstream Twinkle's method: never in real text)
_CONTENT_MARK = "\x00twinkle-assistant-content\x00"
#: files a client may fetch to rebuild the tokenizer locally (config.json: AutoTokenizer reads it)
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "config.json",
    "generation_config.json",
    "preprocessor_config.json",  # a VL model's image processor: clients size image chunks by it
)


class SamplerText:
    """The Sampler's text methods (mixed into `engine.sampler.Sampler`): they read only
    ``self.backend.tokenizer``, a VL backend's ``image_token_id()`` and the model's folder."""

    model: ModelConfig
    backend: Any
    storage: SharedDirStorage

    async def _text_tokenizer(self):
        tok = self.backend.tokenizer
        if tok is None:
            raise BackendError(f"the sampler of {self.model.name} has no tokenizer")
        return tok

    async def _check_token_ids(self, tokens: list[int], field: str) -> list[int]:
        if not isinstance(tokens, (list, tuple)):
            raise UserInputError(f"{field}: must be a list of token ids")
        out: list[int] = []
        for j, t in enumerate(tokens):
            if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                raise UserInputError(
                    f"{field}: token id {t!r} at position {j} must be an integer >= 0"
                )
            out.append(int(t))
        return out

    async def encode_chat(
        self, messages: list[dict], add_generation_prompt: bool = True
    ) -> list[int]:
        """Token ids of ``messages`` ([{"role", "content"}, ...]) rendered by the tokenizer's chat
        template (plus the assistant prefix when ``add_generation_prompt``). A missing template or
        one that rejects the messages is a `UserInputError` naming ``messages``."""
        tok = await self._text_tokenizer()
        if not isinstance(messages, list) or not messages:
            raise UserInputError("messages: must be a non-empty list of {role, content} objects")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise UserInputError(f"messages[{i}]: must be an object with a string 'role'")
        if not getattr(tok, "chat_template", None):
            raise UserInputError(
                f"messages: model {self.model.name!r} has no chat template; send a plain prompt"
            )
        try:
            text = tok.apply_chat_template(
                messages, add_generation_prompt=add_generation_prompt, tokenize=False
            )
        except Exception as exc:  # noqa: BLE001 - jinja errors, template raise_exception(), ...
            detail = str(exc)[:300] or type(exc).__name__
            raise UserInputError(f"messages: the chat template rejected them: {detail}") from None
        if not isinstance(text, str):
            raise UserInputError("messages: the chat template did not render to text")
        # the template writes any BOS itself; adding special tokens again would double it
        return [int(t) for t in tok.encode(text, add_special_tokens=False)]

    async def encode_chat_images(
        self, messages: list[dict], image_fields: list[str], add_generation_prompt: bool = True
    ) -> tuple[list[int], list[int]]:
        """`encode_chat` of messages whose content lists hold ``{"type": "image"}`` parts, one per
        name in ``image_fields`` (the client's field of each image, in order; errors name them).
        Returns the text token ids and each image's position in them (`ImagePart.position`): the
        chat template renders an image as one image token (Qwen2-VL:
        ``<|vision_start|><|image_pad|><|vision_end|>``), which is taken out here; sampling puts
        the image's real tokens back there (engine/backends/vision.py). A text model (no image
        token: the backend's ``image_token_id()`` is None) is a `UserInputError`
        naming the first image, before its template sees the parts."""
        image_token = self.backend.image_token_id()
        where = image_fields[0] if image_fields else "messages"
        if image_token is None:
            raise UserInputError(
                f"{where}: model {self.model.name!r} is text-only; images need a "
                "vision-language model"
            )
        tokens = await self.encode_chat(messages, add_generation_prompt)
        text: list[int] = []
        positions: list[int] = []
        for t in tokens:
            if t == image_token:
                positions.append(len(text))
            else:
                text.append(t)
        if len(positions) != len(image_fields):
            raise UserInputError(
                f"messages: the chat template rendered {len(positions)} image tokens for "
                f"{len(image_fields)} images (is the image token typed in a text part?)"
            )
        return text, positions

    async def encode_text(self, text: str) -> list[int]:
        """Token ids of a plain prompt (with the tokenizer's usual special tokens, e.g. BOS)."""
        if not isinstance(text, str):
            raise UserInputError("prompt: must be a string")
        tok = await self._text_tokenizer()
        return [int(t) for t in tok.encode(text)]

    async def decode(self, tokens: list[int]) -> str:
        """The text of ``tokens`` (special tokens such as EOS are left out)."""
        ids = await self._check_token_ids(tokens, "tokens")
        tok = await self._text_tokenizer()
        return tok.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    async def decode_pieces(self, tokens: list[int]) -> list[str]:
        """The text each token adds, for streaming and per-token logprobs: one string per token,
        whose concatenation equals ``decode(tokens)``. A token that ends inside a multi-byte
        character (or a special token) adds "" and the character comes with a later token.
        Decoded with a few tokens of left context, so tokenizers that drop a leading space at the
        start of a decode (SentencePiece) still get it right."""
        ids = await self._check_token_ids(tokens, "tokens")
        tok = await self._text_tokenizer()

        def dec(part: list[int]) -> str:
            return tok.decode(part, skip_special_tokens=True, clean_up_tokenization_spaces=False)

        pieces: list[str] = []
        prefix_off = read_off = 0  # context window start; end of the tokens already emitted
        for i in range(len(ids)):
            prefix_text = dec(ids[prefix_off:read_off])
            new_text = dec(ids[prefix_off : i + 1])
            if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
                pieces.append(new_text[len(prefix_text) :])
                prefix_off, read_off = read_off, i + 1
            else:
                pieces.append("")
        if ids and read_off < len(ids):  # held-back bytes at the end: emit what they decode to
            pieces[-1] += dec(ids[prefix_off:])[len(dec(ids[prefix_off:read_off])) :]
        full = dec(ids)
        if "".join(pieces) != full:  # an exotic decoder: give the whole text with the last token
            pieces = [""] * (len(ids) - 1) + [full] if ids else []
        return pieces

    async def eos_token(self) -> str | None:
        """The tokenizer's end-of-sequence token as text (e.g. "<|im_end|>"), or None."""
        tok = await self._text_tokenizer()
        eos = getattr(tok, "eos_token", None)
        return eos if isinstance(eos, str) and eos else None

    async def image_token_id(self) -> int | None:
        """The token a VL model's chat template renders for one image; None for a text model."""
        return self.backend.image_token_id()

    async def encode_trajectory(
        self,
        messages: list[dict],
        *,
        add_generation_prompt: bool = False,
        options: Mapping[str, Any] | None = None,
        field: str = "inputs[0]",
    ) -> dict[str, list[int]]:
        """`render_trajectory` with this model's tokenizer (see there)."""
        tok = await self._text_tokenizer()
        return render_trajectory(
            tok,
            messages,
            image_token_id=self.backend.image_token_id(),
            add_generation_prompt=add_generation_prompt,
            options=options or {},
            field=field,
        )

    async def tokenizer_files(self) -> dict[str, int]:
        """The tokenizer files of this model a client may download, with their sizes in bytes."""
        folder = self.model.files_dir(self.storage.root)
        return {f: (folder / f).stat().st_size for f in TOKENIZER_FILES if (folder / f).is_file()}

    async def tokenizer_file(self, name: str) -> bytes:
        """The bytes of one of `tokenizer_files` (any other name is a `UserInputError`)."""
        path = self.model.files_dir(self.storage.root) / name
        if name not in TOKENIZER_FILES or not path.is_file():
            raise UserInputError(f"filename: {name!r} is not a tokenizer file of {self.model.name}")
        return path.read_bytes()


# -- native trajectories ------------------------------------------------------------------------


def render_trajectory(
    tok: Any,
    messages: Any,
    *,
    image_token_id: int | None,
    add_generation_prompt: bool,
    options: Mapping[str, Any],
    field: str,
) -> dict[str, list[int]]:
    """``{"input_ids", "labels"}`` of a native trajectory's ``messages``, rendered by the model's
    own chat template (``tok.apply_chat_template``) and tokenized as one text.

    Labels: each assistant turn is trained from its content through the end-of-turn token when
    that token is the tokenizer's EOS (what sampling stops at; ChatML's ``<|im_end|>``); the text
    the template adds around contents (role headers, the newline between turns, a reasoning
    block) and image tokens are `IGNORE_INDEX`. The contents are found as upstream Twinkle finds
    them: the template is rendered again with a marker for each assistant content, and the text
    between the markers is the template's. ``<image>`` in a content is one image (the message's
    ``images``; a VL template renders its image token there). ``options``: ``default_system``
    (prepended when the first message is not a system one), ``max_length`` with
    ``truncation_strategy`` right (default) or left, ``enable_thinking`` (a template variable).
    Errors are `UserInputError`s naming ``field``."""
    msgs = _template_messages(messages, options, image_token_id, field)
    extra = {"enable_thinking": options["enable_thinking"]} if "enable_thinking" in options else {}
    text = _render(tok, msgs, add_generation_prompt, extra)
    marked = [{**m, "content": _CONTENT_MARK} if m["role"] == "assistant" else m for m in msgs]
    spans = _content_spans(text, _render(tok, marked, add_generation_prompt, extra), tok, field)
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = [int(t) for t in enc["input_ids"]]
    never = {image_token_id, *tok.convert_tokens_to_ids(["<|vision_start|>", "<|vision_end|>"])}
    labels = [
        t if t not in never and any(a <= s and e <= b for a, b in spans) and e > s else IGNORE_INDEX
        for t, (s, e) in zip(ids, enc["offset_mapping"], strict=True)
    ]
    n_images = sum(str(m.get("content", "")).count(IMAGE_PLACEHOLDER) for m in messages)
    if image_token_id is not None and ids.count(image_token_id) != n_images:
        raise UserInputError(
            f"{field}.messages: the chat template rendered {ids.count(image_token_id)} image "
            f"tokens for {n_images} images (is the image token typed in a text part?)"
        )
    max_len = options.get("max_length")
    if max_len and len(ids) > max_len:
        if options.get("truncation_strategy", "right") == "left":
            ids, labels = ids[-max_len:], labels[-max_len:]
        else:
            ids, labels = ids[:max_len], labels[:max_len]
    return {"input_ids": ids, "labels": labels}


def _template_messages(
    messages: Any, options: Mapping[str, Any], image_token_id: int | None, field: str
) -> list[dict[str, Any]]:
    """The messages as a chat template takes them (checked; a content with images as a list of
    image and text parts), with ``default_system`` first when there is no system message."""
    if not isinstance(messages, list) or not messages:
        raise UserInputError(f"{field}.messages: must be a non-empty list of messages")
    out = []
    for j, m in enumerate(messages):
        where = f"{field}.messages[{j}]"
        if not isinstance(m, Mapping) or m.get("role") not in ROLES:
            raise UserInputError(f"{where}.role: must be one of {', '.join(ROLES)}")
        content = m.get("content")
        if not isinstance(content, str):
            raise UserInputError(f"{where}.content: must be a string")
        images = m.get("images") or []
        if not isinstance(images, list):
            raise UserInputError(f"{where}.images: must be a list")
        n = content.count(IMAGE_PLACEHOLDER)
        if (n or images) and image_token_id is None:
            raise UserInputError(
                f"{where}.images: this base model is text-only; images need a vision-language model"
            )
        if n != len(images):
            raise UserInputError(
                f"{where}.images: {len(images)} images for {n} {IMAGE_PLACEHOLDER} "
                "placeholders in its content"
            )
        out.append({"role": m["role"], "content": _parts(content) if n else content})
    system = options.get("default_system")
    if system and out[0]["role"] != "system":
        out.insert(0, {"role": "system", "content": str(system)})
    return out


def _parts(content: str) -> list[dict[str, str]]:
    """A content with ``<image>`` placeholders as chat-template parts, in order."""
    pieces = content.split(IMAGE_PLACEHOLDER)
    parts = [{"type": "text", "text": pieces[0]}] if pieces[0] else []
    for piece in pieces[1:]:
        parts.append({"type": "image"})
        if piece:
            parts.append({"type": "text", "text": piece})
    return parts


def _render(tok: Any, msgs: list[dict], add_generation_prompt: bool, extra: dict) -> str:
    if not getattr(tok, "chat_template", None):
        raise UserInputError("template: this base model has no chat template; send input_ids")
    try:
        text = tok.apply_chat_template(
            msgs, add_generation_prompt=add_generation_prompt, tokenize=False, **extra
        )
    except Exception as exc:  # noqa: BLE001 - jinja errors, template raise_exception(), ...
        detail = str(exc)[:300] or type(exc).__name__
        raise UserInputError(f"messages: the chat template rejected them: {detail}") from None
    if not isinstance(text, str):
        raise UserInputError("messages: the chat template did not render to text")
    return text


def _content_spans(text: str, marked: str, tok: Any, field: str) -> list[tuple[int, int]]:
    """Character spans of ``text`` to train: each assistant content (located by the template's
    own text around ``_CONTENT_MARK`` in ``marked``), plus the EOS token right after it."""
    frame = marked.split(_CONTENT_MARK)
    eos = getattr(tok, "eos_token", None) or None
    spans: list[tuple[int, int]] = []
    pos = len(frame[0])
    if not text.startswith(frame[0]):
        raise _inconsistent(field)
    for k, after in enumerate(frame[1:], start=1):
        last = k == len(frame) - 1
        end = len(text) - len(after) if last else text.find(after, pos) if after else -1
        if end < pos or (last and not text.endswith(after)):
            raise _inconsistent(field)
        stop = end + len(eos) if eos and text.startswith(eos, end) else end
        spans.append((pos, stop))
        pos = end + len(after)
    return spans


def _inconsistent(field: str) -> UserInputError:
    return UserInputError(
        f"{field}.messages: the chat template does not render this trajectory's assistant "
        "contents where it renders them alone; send input_ids"
    )
