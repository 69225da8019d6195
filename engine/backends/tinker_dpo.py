"""Upstream Twinkle's Tinker DPO convention (its cookbook tinker/dpo.py, run by upstream's server
with its DPOLoss): ``forward_backward(data, "importance_sampling", loss_fn_config={"dpo_beta",
"dpo_sft_weight", "dpo_loss_type"})`` with reference log-probs in ``loss_fn_inputs["ref_logps"]``
is DPO, with upstream's mean reduction. Without ``dpo_*`` keys importance_sampling is Tinker's.
"""

from __future__ import annotations

from dataclasses import replace

from engine.backends.losses import MEAN_REDUCTION
from engine.errors import UserInputError
from engine.protocol import DatumInput, ForwardBackwardInput

#: upstream's Tinker DPO keys → dpo's loss_fn_config keys (None: checked, not passed on)
TINKER_DPO_KEYS = {"dpo_beta": "beta", "dpo_sft_weight": "sft_weight", "dpo_loss_type": None}


def tinker_dpo(inp: ForwardBackwardInput) -> ForwardBackwardInput:
    """``inp`` rewritten as ``dpo`` when it follows upstream's Tinker DPO convention (module doc);
    unchanged otherwise."""
    raw = dict(inp.loss_fn_config or {})
    keys = sorted(k for k in raw if k.startswith("dpo_"))
    if inp.loss_fn != "importance_sampling" or not keys:
        return inp
    for k in keys:
        if k not in TINKER_DPO_KEYS:
            raise UserInputError(
                f"loss_fn_config.{k}: unknown key; DPO through importance_sampling accepts "
                f"{', '.join(TINKER_DPO_KEYS)}"
            )
    for i, d in enumerate(inp.data):
        if (d.loss_fn_inputs or {}).get("ref_logps") is None:
            raise UserInputError(
                f"loss_fn_config.{keys[0]}: DPO through importance_sampling needs "
                f"loss_fn_inputs.ref_logps (reference log-probs) on every datum; data[{i}] has none"
            )
    loss_type = raw.pop("dpo_loss_type", "sigmoid")
    if loss_type != "sigmoid":
        raise UserInputError(
            f"loss_fn_config.dpo_loss_type: {loss_type!r} is not supported; accepted: sigmoid"
        )
    config = {MEAN_REDUCTION: 1.0, **{TINKER_DPO_KEYS.get(k) or k: v for k, v in raw.items()}}
    data = [
        DatumInput(
            d.tokens, {**d.loss_fn_inputs, "ref_logprobs": d.loss_fn_inputs["ref_logps"]}, d.images
        )
        for d in inp.data
    ]
    return replace(inp, data=data, loss_fn="dpo", loss_fn_config=config)
