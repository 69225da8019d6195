"""Building the frozen megatron-core GPTModel of one rank and loading its HF weights.

Owns the TransformerConfig for an `Arch` (float32 on CPU; no fusions, which need CUDA kernels),
the layer spec (megatron's local spec on CPU; on a GPU the same names, so the mapping and the
LoRA hooks do not change), and `load_base`: build this rank's stage, stream its weight slices in,
freeze it and put it in eval mode (dropout 0). Keep GPTModel construction here: megatron-core
0.19 deprecates GPTModel for HybridModel, and this is the one place to switch.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from engine.backends.megatron.arch import Arch
from engine.backends.megatron.mapping import TensorReader, hf_to_mcore, load_into


def transformer_config(
    arch: Arch, tp: int, pp: int, *, dtype: torch.dtype = torch.float32, recompute: str = "none"
):
    from megatron.core.transformer.transformer_config import TransformerConfig

    # "selective" recomputes core attention only, which holds no LoRA hook; "full" would re-run
    # the hooked linears outside their routing context (engine/config refuses it).
    return TransformerConfig(
        recompute_granularity="selective" if recompute == "selective" else None,
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        num_attention_heads=arch.num_heads,
        num_query_groups=arch.num_kv_groups,
        ffn_hidden_size=arch.ffn_hidden_size,
        kv_channels=arch.head_dim,
        gated_linear_unit=True,  # SwiGLU: linear_fc1 = [gate; up]
        activation_func=F.silu,
        normalization="RMSNorm",
        layernorm_epsilon=arch.rms_eps,
        qk_layernorm=arch.qk_norm,
        add_bias_linear=False,
        add_qkv_bias=arch.qkv_bias,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        use_cpu_initialization=True,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        apply_rope_fusion=False,
        batch_p2p_comm=False,  # the batched path calls torch.cuda.synchronize (CPU: no CUDA)
        calculate_per_token_loss=True,  # the schedule must not average: Tinker losses are sums
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
    )


def build_gpt(
    arch: Arch, tp: int, pp: int, *, dtype: torch.dtype = torch.float32, recompute: str = "none"
):
    """This rank's stage of the GPTModel (random weights). Tied embeddings are built untied when
    PP > 1 (megatron ties across stages with a ``.cuda()`` call); the loader then copies the
    embedding into the output layer, which is exact for a frozen base."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    cfg = transformer_config(arch, tp, pp, dtype=dtype, recompute=recompute)
    spec = get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=arch.qk_norm)
    extra = {}
    if arch.rope_scaling_factor is not None:
        extra = {"rope_scaling": True, "rope_scaling_factor": arch.rope_scaling_factor}
    return GPTModel(
        config=cfg,
        transformer_layer_spec=spec,
        vocab_size=arch.vocab_size,
        max_sequence_length=arch.max_positions,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=arch.tied and pp == 1,
        position_embedding_type="rope",
        rotary_base=_rotary_base(arch.rope_theta),  # pyright: ignore[reportArgumentType]
        **extra,
    )


def _rotary_base(theta: float) -> int | float:
    return int(theta) if float(theta).is_integer() else theta


def load_base(
    source: str | Path | TensorReader,
    arch: Arch,
    *,
    dtype: torch.dtype = torch.float32,
    recompute: str = "none",
):
    """This rank's frozen, eval-mode GPTModel with the HF weights of ``source`` (a model folder
    or a `TensorReader`); the process groups must be initialised (compat.init_parallel)."""
    from megatron.core import parallel_state as ps

    tp, pp = ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size()
    reader = source if isinstance(source, TensorReader) else TensorReader.from_dir(source)
    model = build_gpt(arch, tp, pp, dtype=dtype, recompute=recompute)
    state = hf_to_mcore(
        reader,
        arch,
        tp_rank=ps.get_tensor_model_parallel_rank(),
        tp=tp,
        pp_rank=ps.get_pipeline_model_parallel_rank(),
        pp=pp,
    )
    load_into(model, {k: v.to(dtype) for k, v in state.items()})
    model.requires_grad_(False)
    model.eval()
    if not torch.cuda.is_available():
        return model
    return model.cuda()


def causal_mask(length: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Megatron's attention mask for right-padded rows: True = masked, [1, 1, T, T]. (None would
    make megatron build one with device='cuda'.) Padding needs no mask of its own: causal
    attention never lets a real token see a later pad."""
    return torch.triu(torch.ones(length, length, dtype=torch.bool, device=device), 1)[None, None]
