"""Twinkle engine: Ray Serve deployments that hold base models and many tenants' LoRA adapters.

Import direction: the gateway imports the engine, the engine imports its backends; never the
reverse.
"""
