"""The gateway's only path to the engine.

`EngineClient` (transport.py) holds every base model's Trainer and Sampler replicas and hands out
typed facades (facades.py): ``engine.trainer(base).optim_step(model_id, seq_id=3, params=p)``,
``engine.sampler(base, affinity=...).sample(inp)``. The facades implement the deployments' method
sets (`engine.protocol.TrainerApi` / `SamplerApi`), so pyright checks every call the gateway makes;
no gateway module names an engine method as a string. A dead Trainer replica fails its models'
calls at once (replica_loss.py, private to this package).
"""

from gateway.engine_client.facades import EveryReplica, SamplerClient, TrainerClient
from gateway.engine_client.transport import EngineClient, pick_replica

__all__ = ["EngineClient", "EveryReplica", "SamplerClient", "TrainerClient", "pick_replica"]
