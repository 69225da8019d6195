"""FastAPI dependencies of upstream Twinkle's native protocol (model_routes.py,
sampler_routes.py): the served base model a URL names, the caller's session from
``X-Twinkle-Session-Id``, and the caller's model in that session. Upstream's client names no model
id: a model is one session on one base model, so owning the session is owning the model.
"""

from __future__ import annotations

import hashlib
from typing import Annotated

from fastapi import Depends, Request

from engine.rules import native_model_id
from gateway.db.tables import SessionRow
from gateway.deps import ConfigDep, DbDep, PrincipalDep, owned_session
from gateway.errors import InvalidRequestError, NotFoundError
from gateway.twinkle_api.model_registry import NativeModel, NativeModelsDep

SESSION_HEADER = "x-twinkle-session-id"


def served_base_model(base_model: str, config: ConfigDep) -> str:
    """The served model a URL names: upstream strips ``ms://`` / ``hf://`` client-side, but a
    hand-written URL may keep it."""
    name = base_model.split("://", 1)[-1].strip("/")
    if config.model(name) is None:
        raise NotFoundError(
            f"base_model: {name!r} is not served here; available: "
            f"{', '.join(m.name for m in config.models)}"
        )
    return name


def native_session(request: Request, who: PrincipalDep, db: DbDep) -> SessionRow:
    """The caller's session named by ``X-Twinkle-Session-Id`` (another user's: 404)."""
    sid = request.headers.get(SESSION_HEADER)
    if not sid:
        raise InvalidRequestError(
            "X-Twinkle-Session-Id: header required (init_twinkle_client creates the session "
            "and sends it with every call)"
        )
    return owned_session(db, who, sid)


BaseModelDep = Annotated[str, Depends(served_base_model)]
NativeSessionDep = Annotated[SessionRow, Depends(native_session)]


def session_model_id(session_id: str, base_model: str) -> str:
    """The native model of one session on one base model."""
    return native_model_id(session_id, hashlib.sha256(base_model.encode()).hexdigest()[:8])


async def owned_model(
    name: BaseModelDep, session: NativeSessionDep, who: PrincipalDep, models: NativeModelsDep
) -> NativeModel:
    try:
        return await models.owned(session_model_id(session.id, name), who.user_id)
    except NotFoundError:
        raise NotFoundError(
            f"model: no model for {name!r} in session {session.id} (the client's constructor "
            "calls create; after a server restart create it again and resume_from_checkpoint)"
        ) from None


OwnedModelDep = Annotated[NativeModel, Depends(owned_model)]
