"""Scheduling inside a Trainer replica: per-model seq_id ordering (`sequencer`), fair
cross-tenant picks by deficit round robin over tokens (`fair`), slicing of big requests
(`slicing`), exactly-once execution of a repeated (model_id, seq_id) (`exactly_once`), adapters
resident vs offloaded (`adapter_pool`), and the start-up measurement that picks fused or sequential
execution (`execution_probe`)."""
