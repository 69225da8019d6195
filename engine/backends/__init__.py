"""Compute backends. They never import the gateway, FastAPI, the DB or Ray Serve.

`base` holds the contracts (`TrainingBackend`, `SamplingBackend`) and `registry` builds them by
name; training: `train_transformers` (+ `train_batching`, `losses`, `lora`, `checkpoint_io`);
sampling: `sample_torch` (+ `sample_decode`), `sample_vllm`, both with `sample_checks` and
`adapter_cache`; `mock` is the torch-free pair for routing tests.
"""
