"""The tiny offline model: deterministic, atomic build; loads with the Auto classes; registry."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from engine.base_models import TINY_MODEL_NAME, resolve_model_dir, tiny
from engine.errors import ConfigError


def _hashes(d: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir())}


def test_same_seed_gives_byte_identical_files(tiny_model_dir: Path, tmp_path: Path) -> None:
    again = tiny.build_tiny(tmp_path / "again", seed=0)
    first = _hashes(tiny_model_dir)
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= set(
        first
    )
    assert _hashes(again) == first
    # nothing version- or time-dependent is written
    assert "transformers_version" not in (again / "config.json").read_text()
    assert not list(tmp_path.glob(".*tmp*")), "temp build dir left behind"


def test_other_seed_changes_weights_not_tokenizer(tiny_model_dir: Path, tmp_path: Path) -> None:
    other = _hashes(tiny.build_tiny(tmp_path / "s1", seed=1))
    base = _hashes(tiny_model_dir)
    assert other["model.safetensors"] != base["model.safetensors"]
    assert other["tokenizer.json"] == base["tokenizer.json"]


def test_loads_with_auto_classes(tiny_model_dir: Path) -> None:
    import torch
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    cfg = model.config
    assert model.dtype == torch.float32
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers) == (64, 128, 2)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.max_position_embeddings) == (
        4,
        2,
        512,
    )
    assert cfg.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert len(tok) == 2048 and cfg.vocab_size >= len(tok)
    ids = tok.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>"])
    assert ids == [tok.bos_token_id, ids[1], tok.eos_token_id, tok.pad_token_id]
    assert (cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id) == (ids[0], ids[2], ids[3])

    text = tok.apply_chat_template(
        [{"role": "user", "content": "what is 1 plus 2?"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert text == "<|im_start|>user\nwhat is 1 plus 2?<|im_end|>\n<|im_start|>assistant\n"

    # AutoTokenizer (Qwen2Tokenizer for model_type qwen2) and the raw tokenizer.json agree
    raw = Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))
    sample = tiny.CORPUS_PATH.read_text()[:20000] + " café ﬁ 12345  \t\n<|im_start|>x<|im_end|>"
    enc = tok(sample)["input_ids"]
    assert enc == raw.encode(sample).ids
    assert tok.decode(enc) == sample
    assert tok("<|im_end|>")["input_ids"] == [tok.eos_token_id]  # no BOS/EOS added implicitly

    out = model.generate(torch.tensor([tok(text)["input_ids"]]), max_new_tokens=3, do_sample=False)
    assert out.shape[1] >= len(tok(text)["input_ids"]) + 1


def test_corpus_is_shipped_and_small() -> None:
    data = tiny.CORPUS_PATH.read_bytes()
    assert 100_000 < len(data) < 420_000
    assert b"User: what is 41 plus 42? Assistant: 83." in data


def test_existing_model_dir_is_left_alone(tmp_path: Path) -> None:
    out = tmp_path / "m"
    out.mkdir()
    (out / "config.json").write_text("{}")
    assert tiny.build_tiny(out) == out
    assert (out / "config.json").read_text() == "{}"


def test_losing_a_build_race_discards_own_copy(tmp_path: Path, monkeypatch) -> None:
    out = tmp_path / "m"
    real_rename = tiny.os.rename

    def racing_rename(src, dst):  # another builder finishes just before us
        Path(dst).mkdir()
        (Path(dst) / "config.json").write_text('{"winner": true}')
        return real_rename(src, dst)

    monkeypatch.setattr(tiny.os, "rename", racing_rename)
    assert tiny.build_tiny(out) == out
    assert (out / "config.json").read_text() == '{"winner": true}'
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]


def test_registry(tiny_model_dir: Path, tmp_path: Path, monkeypatch) -> None:
    assert resolve_model_dir("anything", tmp_path, str(tiny_model_dir)) == tiny_model_dir
    with pytest.raises(ConfigError, match="does not exist"):
        resolve_model_dir("x", tmp_path, str(tmp_path / "missing"))
    with pytest.raises(ConfigError, match=TINY_MODEL_NAME):  # the error lists the known names
        resolve_model_dir("unknown", tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # a hub id: looked up in the HF cache only
    with pytest.raises(ConfigError, match="'org/unknown' is not in the local Hugging Face cache"):
        resolve_model_dir("org/unknown", tmp_path)

    built: list[Path] = []

    def fake_build(out, seed=0):
        built.append(Path(out))
        Path(out).mkdir(parents=True)
        (Path(out) / "config.json").write_text("{}")
        return Path(out)

    monkeypatch.setattr(tiny, "build_tiny", fake_build)
    expected = tmp_path / "models" / "tiny-chat"
    assert resolve_model_dir(TINY_MODEL_NAME, tmp_path) == expected
    assert resolve_model_dir(TINY_MODEL_NAME, tmp_path) == expected
    assert built == [expected]  # built once, then found
