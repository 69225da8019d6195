"""Native Twinkle API models, hosted by the Trainer replica that holds their adapters.

`NativeModelHost` (host.py) keeps each native model's state (loss, optimizer, LR schedule and
template settings, accumulation counters, metrics: the engine's own `MultiLoraTransformersModel`)
keyed by model id; `TrainerBackend` (trainer_backend.py) runs that class's compute through the
Trainer's ordering, fair scheduling and adapter pool. The gateway keeps only ownership.
"""

from engine.native.host import NativeModelHost

__all__ = ["NativeModelHost"]
