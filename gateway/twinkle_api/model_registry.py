"""Who owns which native model: one record per model id in the shared KV store.

A native model (``POST /api/v1/model/<base>/twinkle/create``: one per session and base model) lives
in the Trainer replica that holds its adapters (engine/native/host.py: its loss, optimizer,
schedule, accumulation counters). The gateway keeps only ownership (user, session, base model), in
the KV store the futures use: Redis when configured, so every gateway replica checks ownership and
serves any native call; otherwise process memory, which is enough for the one replica that may run
without Redis (gateway/config.py refuses several replicas without it). Lookups filter by the
caller's user id and answer 404 otherwise, as every other ownership check does."""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from typing import Annotated

from fastapi import Depends, Request

from engine.rules import native_run_id
from gateway.context import services_of
from gateway.errors import NotFoundError
from gateway.futures.kv import KV

#: a record lives 7 days after its last refresh; each call refreshes it when it is over an hour
#: old, so a model in use never expires and an idle one costs one Redis write per hour at most
RECORD_TTL_S = 7 * 24 * 3600.0
REFRESH_AFTER_S = 3600.0


@dataclass(frozen=True)
class NativeModel:
    model_id: str
    user_id: int
    session_id: str
    base_model: str
    max_lora_rank: int
    written_at: float = 0.0

    @property
    def tenant(self) -> str:
        """The Trainer's fair-share tenant: the owner, as for the Tinker routes."""
        return str(self.user_id)

    def run_id(self, adapter_name: str) -> str:
        return native_run_id(self.model_id, adapter_name)


def not_found(model_id: str) -> NotFoundError:
    return NotFoundError(
        f"model_id: model {model_id!r} not found (the server may have restarted: create the "
        "model again and resume_from_checkpoint)"
    )


class NativeModels:
    def __init__(self, kv: KV) -> None:
        self._kv = kv

    @staticmethod
    def _key(model_id: str) -> str:
        return f"native-model:{model_id}"

    async def add(self, nm: NativeModel) -> NativeModel:
        nm = NativeModel(**{**asdict(nm), "written_at": time.time()})
        await self._kv.set(self._key(nm.model_id), json.dumps(asdict(nm)).encode(), RECORD_TTL_S)
        return nm

    async def owned(self, model_id: str, user_id: int) -> NativeModel:
        """The caller's model, or a 404 that says the same for a stranger's and a missing one."""
        raw = await self._kv.get(self._key(model_id))
        nm = NativeModel(**json.loads(raw)) if raw is not None else None
        if nm is None or nm.user_id != user_id:
            raise not_found(model_id)
        if time.time() - nm.written_at > REFRESH_AFTER_S:
            nm = await self.add(nm)
        return nm

    async def drop(self, model_id: str) -> None:
        await self._kv.delete(self._key(model_id))


def native_models(request: Request) -> NativeModels:
    return NativeModels(services_of(request.app).kv)


NativeModelsDep = Annotated[NativeModels, Depends(native_models)]
