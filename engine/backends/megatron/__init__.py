"""The Megatron-Core training backend (``use_megatron: true``): many tenants' LoRA adapters on one
frozen megatron-core GPTModel, with tensor and pipeline parallelism inside one Trainer replica.

Modules: `arch` (torch-free: which HF configs are supported, read from config.json), `compat`
(CPU shims, process groups, version gate), `mapping` (HF ↔ Megatron weights, per rank),
`model` (building and loading the frozen base), `multi_lora` (adapters as forward hooks, routed
by batch segments), `worker` (one rank: passes, optimizer; SPMD), `checkpoints` (its PEFT
save/load, gathered from the shards), `backend` (`MegatronTrainingBackend`: the driver the
Trainer talks to; in-process or Ray actors).
Nothing here is imported unless a model names the backend (engine/backends/registry.py).
"""
