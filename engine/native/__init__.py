"""Native Twinkle API models, hosted by the Trainer replica that holds their adapters.

`NativeModelHost` (host.py) keeps each native model's state (loss, optimizer, LR schedule and
template settings, accumulation counters, metrics: the engine's own `MultiLoraTransformersModel`)
keyed by model id; `SequencedTrainerBackend` (sequenced_backend.py) runs that class's compute
through the Trainer's ordering, fair scheduling and adapter pool. The gateway keeps only ownership.

The path of one native call is a loop back into the Trainer that hosts it::

    gateway ──native_call──▶ Trainer.native_call                 [Trainer event loop]
                               │
                               ▼
                             NativeModelHost.call ──run_in_executor──┐
                                                                     ▼
                             MultiLoraTransformersModel.<method>  [native-model worker thread]
                               │  (loss, accumulation, metrics: upstream's exact semantics)
                               ▼
                             SequencedTrainerBackend.forward_backward / optim_step / ...
                               │  run_coroutine_threadsafe(...).result()   (worker blocks)
                               ▼
                             Trainer.forward_backward(run id, next seq_id)  [event loop again]
                               │  Sequencer turn, FairScheduler, AdapterPool
                               ▼
                             TrainingBackend (torch)                  [compute thread]

Why a loop: the native API promises the in-process class's semantics to a remote script, so the
class itself runs here; and its compute must still queue fairly with every Tinker tenant's and
keep its adapters pooled, which only the Trainer's public coroutines do. Each call costs three
thread hops (loop → worker → loop → compute thread), small next to a forward pass.

Why it cannot deadlock: the event loop never waits for a worker (it awaits the executor future),
and a worker waits only for coroutines that the loop runs. The one way to deadlock is to make the
blocking call on the loop's own thread, so `SequencedTrainerBackend` refuses that
(`ReentrantCallError`) instead of hanging the replica. An import-linter contract cannot express
this loop (engine/trainer.py imports this package; the way back is a `TYPE_CHECKING` import), so
the run-time check is what holds it.
"""

from engine.native.host import NativeModelHost

__all__ = ["NativeModelHost"]
