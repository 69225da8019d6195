"""The tiny vision-language model (`twinkle/tiny-vl`): deterministic build, loads with
transformers' own classes (model, image processor, tokenizer; not AutoProcessor), its chat
template renders image parts, the registry builds it on first use, and `twinkle models
build-tiny-vl` writes it."""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

import pytest

from engine.base_models import TINY_VL_MODEL_NAME, resolve_model_dir, tiny_vl

pytest.importorskip("PIL")


def _hashes(d: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir())}


def test_same_seed_gives_byte_identical_files(tiny_vl_model_dir: Path, tmp_path: Path) -> None:
    again = tiny_vl.build_tiny_vl(tmp_path / "again", seed=0)
    first = _hashes(tiny_vl_model_dir)
    files = {"config.json", "model.safetensors", "tokenizer.json", "preprocessor_config.json"}
    assert files <= set(first)
    assert _hashes(again) == first
    assert "transformers_version" not in (again / "config.json").read_text()
    other = _hashes(tiny_vl.build_tiny_vl(tmp_path / "s1", seed=1))
    assert other["model.safetensors"] != first["model.safetensors"]
    assert other["tokenizer.json"] == first["tokenizer.json"]


def test_loads_with_transformers_own_classes(tiny_vl_model_dir: Path) -> None:
    from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer

    model = AutoModelForImageTextToText.from_pretrained(tiny_vl_model_dir)
    assert type(model).__name__ == "Qwen2VLForConditionalGeneration"
    assert 200_000 < sum(p.numel() for p in model.parameters()) < 400_000
    proc = AutoImageProcessor.from_pretrained(tiny_vl_model_dir)
    assert (proc.patch_size, proc.merge_size) == (14, 2)
    tok = AutoTokenizer.from_pretrained(tiny_vl_model_dir)
    ids = tok.convert_tokens_to_ids(["<|vision_start|>", "<|vision_end|>", "<|image_pad|>"])
    cfg = model.config
    assert ids == [cfg.vision_start_token_id, cfg.vision_end_token_id, cfg.image_token_id]
    # the text model's tokenizer, plus the three vision tokens
    assert len(tok) == 2048
    text = tok.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "read"}]}],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert text == (
        "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>read<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_registry_builds_it_on_first_use(tmp_path: Path, monkeypatch) -> None:
    built: list[Path] = []

    def fake_build(out, seed=0):
        built.append(Path(out))
        Path(out).mkdir(parents=True)
        (Path(out) / "config.json").write_text("{}")
        return Path(out)

    monkeypatch.setattr(tiny_vl, "build_tiny_vl", fake_build)
    expected = tmp_path / "models" / "tiny-vl"
    assert resolve_model_dir(TINY_VL_MODEL_NAME, tmp_path) == expected
    assert resolve_model_dir(TINY_VL_MODEL_NAME, tmp_path) == expected
    assert built == [expected]


def test_cli_builds_it(tmp_path: Path) -> None:
    twinkle = Path(sys.executable).parent / "twinkle"
    out = subprocess.run(
        [str(twinkle), "models", "build-tiny-vl", "--out", str(tmp_path / "vl")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().endswith("vl")
    assert (tmp_path / "vl" / "preprocessor_config.json").is_file()
