"""Builder of the offline "tiny chat" model (``twinkle/tiny-chat``).

Owns the recipe of shared/docs/environment.md §2: a byte-level BPE tokenizer trained on the corpus
shipped next to this file (``tiny_corpus.txt``, the source of truth: nothing is read from the
interpreter's installation, so every machine builds the same tokenizer) and a randomly
initialised 2-layer Qwen2 model. The build is deterministic (same seed → byte-identical files) and
atomic (written to a sibling temp dir, then renamed into place), so concurrent builders never see
a half-built folder.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

CORPUS_PATH = Path(__file__).with_name("tiny_corpus.txt")

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>"]
BPE_VOCAB_SIZE = 2048
MAX_POSITIONS = 512
# Copied from transformers.models.qwen2.tokenization_qwen2.PRETOKENIZE_REGEX (see _train_tokenizer).
QWEN2_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"""
    r"""\s*[\r\n]+|\s+(?!\S)|\s+"""
)

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Keys whose values depend on the installed library version rather than on the recipe; dropping them
# keeps the files byte-identical across machines (transformers does not need them to load).
_VOLATILE_JSON_KEYS = ("transformers_version",)


def _train_tokenizer(special_tokens: list[str] = SPECIAL_TOKENS, extra: dict | None = None):
    """The tiny models' tokenizer; ``special_tokens`` are ids 0.. in order, ``extra`` goes to
    PreTrainedTokenizerFast (the vision model's named special tokens)."""
    from tokenizers import (
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
        trainers,
    )
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    # AutoTokenizer maps model_type "qwen2" to Qwen2Tokenizer, which rebuilds the pipeline from the
    # vocab/merges with an NFC normalizer and Qwen's split regex in front of a regex-less ByteLevel.
    # Training with exactly that pipeline keeps tokenizer.json, AutoTokenizer and the raw
    # `tokenizers` library in agreement (a plain ByteLevel pre-tokenizer would not: Qwen's regex
    # splits digits one by one).
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=BPE_VOCAB_SIZE,
        min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=special_tokens,
        show_progress=False,
    )
    lines = CORPUS_PATH.read_text(encoding="utf-8").splitlines()
    tok.train_from_iterator(lines, trainer=trainer, length=len(lines))
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|endoftext|>",
        eos_token="<|im_end|>",
        pad_token="<|pad|>",
        model_max_length=MAX_POSITIONS,
        **(extra or {}),
    )
    hf_tok.chat_template = CHAT_TEMPLATE
    return hf_tok


def _build_model(tokenizer, seed: int):
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    # Round up to a multiple of 64 so the embedding matrix has a friendly shape; ids past the
    # tokenizer's range are never produced by it but stay valid model inputs.
    vocab_size = -(-len(tokenizer) // 64) * 64
    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=MAX_POSITIONS,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype="float32",
    )
    # fork_rng: seeding must neither depend on nor disturb the caller's global RNG state.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        # transformers declares PreTrainedModel.to with @wraps(nn.Module.to), which gives pyright
        # the unbound signature (self first), so it reads the dtype as ``self``
        model = Qwen2ForCausalLM(config).to(torch.float32)  # pyright: ignore[reportArgumentType]
    return model.eval()


def _scrub_json(directory: Path) -> None:
    for path in sorted(directory.glob("*.json")):
        data = json.loads(path.read_text(encoding="utf-8"))
        if isinstance(data, dict) and any(k in data for k in _VOLATILE_JSON_KEYS):
            for k in _VOLATILE_JSON_KEYS:
                data.pop(k, None)
            path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def build_tiny(out_dir: str | Path, seed: int = 0) -> Path:
    """Build the tiny chat model (tokenizer + safetensors weights) into ``out_dir`` and return it.

    If ``out_dir`` already holds a model (e.g. another process finished first) it is left as is.
    """

    def fill(tmp: Path) -> None:
        tokenizer = _train_tokenizer()
        model = _build_model(tokenizer, seed)
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)

    return build_atomically(out_dir, fill)


def build_atomically(out_dir: str | Path, fill) -> Path:
    """Run ``fill(tmp)`` in a sibling temp dir, scrub version keys, rename it to ``out_dir``."""
    out_dir = Path(out_dir)
    if (out_dir / "config.json").is_file():
        return out_dir
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        fill(tmp)
        _scrub_json(tmp)
        os.chmod(tmp, 0o755)  # mkdtemp makes it private; the model is a shared, read-only asset
        try:
            # Atomic; replaces an empty out_dir, fails if another builder got there first.
            os.rename(tmp, out_dir)
        except OSError:
            if not (out_dir / "config.json").is_file():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out_dir
