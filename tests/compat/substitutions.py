"""The marked changes the harness makes to each of upstream's cookbook scripts before running it.

Each `Sub` is one change with the reason for it. The runner applies them in order to the script
text (read from an upstream checkout at test time; upstream's code is never stored in this repo),
prints each one it applied, and fails if one matches a different number of times than `count`:
a substitution that silently stopped matching would mean the script changed under us.

Placeholders in `new`, filled in by the runner:
  @@DATA@@          tests/compat/data (our own small jsonl files)
  @@ADAPTER@@       a `twinkle://.../weights/<name>` LoRA checkpoint the harness saved on the server
  @@SAMPLER_PATH@@  a `twinkle://.../sampler_weights/<name>` checkpoint the harness saved

What needs no substitution (set up by the runner instead, through mechanisms upstream honours):
  * the model: TWINKLE_MODEL_ID=twinkle/tiny-chat, so the scripts build the server URLs
    `/api/v1/model/twinkle/tiny-chat/twinkle/...` exactly as they would for a hub model;
  * the tokenizer for `ms://twinkle/tiny-chat` / `twinkle/tiny-chat` in upstream's client-side
    `Template` / `dataset.set_template(...)`: TWINKLE_MODEL_ID_ALIASES (upstream's
    `twinkle.hub.model_alias`, consulted by `HubOperation.download_model`) maps both ids to the
    local tiny-model folder;
  * `AutoTokenizer.from_pretrained('twinkle/tiny-chat')` (transformers in twinkle/sample.py,
    modelscope in tinker/lora.py): the script runs with a working directory that holds
    `twinkle/tiny-chat/` (a link to the tiny-model folder), and both libraries take an existing
    local path before any hub;
  * `import swanlab` (only used when USE_SWANLAB, which the scripts leave False): installed in the
    compat venv.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Sub:
    why: str
    old: str  # a regular expression (re.MULTILINE) unless literal
    new: str  # a replacement (re.sub syntax: \\1 etc.) unless literal
    count: int = 1  # how many matches there must be
    literal: bool = False


# Reasons shared by several scripts.
_WHY_DATA = "offline (no dataset hub): our own small local jsonl with the same columns"
_WHY_TEMPLATE = (
    "client-side Qwen3_5Template needs a Qwen3.5(-VL) config (its position ids call the model's "
    "get_rope_index; the tiny model is Qwen2 + a ChatML template): use upstream's base Template"
)
_WHY_CAP = "cap the run for CPU and the tiny model"
_WHY_REWARD = (
    "the tiny random model never writes \\boxed{}/####, so every reward is 0 and every step is "
    "skipped as 'All advantages are zero': add a small completion-length term so the GRPO "
    "training step (forward_backward + optimizer step) runs"
)


def _dataset(old_id: str, new_file: str) -> Sub:
    return Sub(_WHY_DATA, f"'{old_id}'", f"'@@DATA@@/{new_file}'", literal=True)


def _set_template(count: int = 1) -> Sub:
    return Sub(
        _WHY_TEMPLATE,
        r"dataset\.set_template\('Qwen3_5Template'",
        "dataset.set_template('Template'",
        count=count,
    )


def _reward_length_term(traj_name: str) -> Sub:
    return Sub(
        _WHY_REWARD,
        r"total_rewards = \[a \+ b for a, b in zip\(accuracy_rewards, brevity_rewards\)\]",
        (
            "total_rewards = [a + b + 1e-3 * len(str(([m for m in t.get('messages') or [] "
            "if m.get('role') == 'assistant'] or [{}])[-1].get('content') or '')) "
            f"for a, b, t in zip(accuracy_rewards, brevity_rewards, {traj_name})]"
        ),
    )


SCRIPTS: dict[str, list[Sub]] = {
    # ---------------------------------------------------------------- twinkle-native client
    "twinkle/self_cognition": [
        _dataset("ms://swift/self-cognition", "self_cognition.jsonl"),
        Sub(
            _WHY_CAP + " (8 rows; 2 batches of 4 a epoch, 3 epochs, a save each)",
            r"data_slice=range\(500\)",
            "data_slice=range(8)",
        ),
        _set_template(),
    ],
    "twinkle/dpo": [
        _dataset("ms://hjh0119/shareAI-Llama3-DPO-zh-en-emoji", "dpo_pairs.jsonl"),
        Sub(
            _WHY_CAP + " (8 pairs: 2 batches of 4)",
            r"data_slice=range\(100\)",
            "data_slice=range(8)",
        ),
        _set_template(),
    ],
    "twinkle/short_math_grpo": [
        _dataset("ms://modelscope/gsm8k", "gsm8k_mini.jsonl"),
        Sub(_WHY_CAP, r"^DATA_NUM = 2000\b", "DATA_NUM = 4"),
        Sub(_WHY_CAP, r"^MAX_STEPS = 100\b", "MAX_STEPS = 2"),
        Sub(_WHY_CAP, r"^MAX_NEW_TOKENS = 1024\b", "MAX_NEW_TOKENS = 16"),
        _set_template(),
        _reward_length_term("trajectories"),
    ],
    "twinkle/sample": [
        Sub(
            "a LoRA checkpoint that exists on this server (saved by the harness before the run)",
            r"^ADAPTER_URI = 'twinkle://[^']*'",
            "ADAPTER_URI = '@@ADAPTER@@'",
        ),
        Sub(_WHY_CAP, r"'max_tokens': 128,", "'max_tokens': 16,"),
    ],
    "twinkle/embedding": [
        Sub(
            _WHY_TEMPLATE + " (its tokenizer builds the rows)",
            r"^from twinkle\.template import Qwen3_5Template$",
            "from twinkle.template import Template as Qwen3_5Template",
        ),
        Sub(_WHY_CAP, r"^MAX_STEPS = 10\b", "MAX_STEPS = 3"),
    ],
    # ---------------------------------------------------------------- Tinker client (patched)
    "tinker/self_cognition": [
        _dataset("ms://swift/self-cognition", "self_cognition.jsonl"),
        Sub(
            _WHY_CAP + " (8 rows: 1 batch of 8 a epoch, 3 epochs, a save each)",
            r"data_slice=range\(500\)",
            "data_slice=range(8)",
        ),
        _set_template(),
    ],
    "tinker/lora": [],  # runs as is (tokenizer: see the module docstring)
    "tinker/dpo": [
        _dataset("ms://hjh0119/shareAI-Llama3-DPO-zh-en-emoji", "dpo_pairs.jsonl"),
        Sub(
            _WHY_CAP + " (8 pairs: 2 batches of 4)",
            r"data_slice=range\(5000\)",
            "data_slice=range(8)",
        ),
        _set_template(),
    ],
    "tinker/short_math_grpo": [
        _dataset("ms://modelscope/gsm8k", "gsm8k_mini.jsonl"),
        Sub(_WHY_CAP, r"^DATA_NUM = 2000\b", "DATA_NUM = 4"),
        Sub(_WHY_CAP, r"^MAX_STEPS = 1000\b", "MAX_STEPS = 2"),
        Sub(_WHY_CAP, r"^MAX_NEW_TOKENS = 4096\b", "MAX_NEW_TOKENS = 16"),
        _set_template(),
        Sub(
            _WHY_TEMPLATE + " (the script's own decode template)",
            r"^from twinkle\.template import Qwen3_5Template$",
            "from twinkle.template import Template as Qwen3_5Template",
        ),
        _reward_length_term("trajectories"),
    ],
    "tinker/sample": [
        Sub(
            "a sampler checkpoint that exists on this server (saved by the harness before the run)",
            r"model_path='twinkle://[^']*'",
            "model_path='@@SAMPLER_PATH@@'",
        ),
        Sub(_WHY_TEMPLATE, r"^template = Qwen3_5Template\(", "template = Template("),
        Sub(_WHY_CAP, r"max_tokens=128,", "max_tokens=16,"),
    ],
}

# Scripts whose substituted text needs a checkpoint made by the harness first.
NEEDS_CHECKPOINT = {"twinkle/sample", "tinker/sample"}
