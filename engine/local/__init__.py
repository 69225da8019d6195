"""The in-process training API that upstream Twinkle users know: `MultiLoraTransformersModel`
(`model`) over any `TrainingBackend`, with its per-adapter state (`adapter_state`), loss, optimizer
and LR-schedule settings (`training_config`) and input encoding (`inputs`). The native API serves
the same class remotely (engine/native); `twinkle_client.model` mirrors its signatures."""
