"""Server-side custom losses: ``create_custom_loss`` and the graph a ``loss_fn="custom"``
forward_backward runs with.

Owns the wire schema of an upload (the SDK's ``CreateCustomLossRequest``: a traced loss as
``{"format": 1, "nodes": [...]}``) with the bounds that keep an upload small before it travels
(node count, argument nesting), the route (the engine checks the graph, the allow-list of
operations included, and a refusal is a 400 naming the node; an accepted graph is stored per
session, `gateway.db.tables.CustomLossRow`, at most ``gateway.max_custom_losses`` per user in live
sessions: 403 beyond), and `attached_graph`: the stored graph of a
forward_backward's ``loss_fn_config.loss_id``, which must belong to the model's session.

Advertised to the SDK as ``custom_loss_server_side`` (``/client/config``) unless the server
config turns it off; the SDK then uploads each loss once and runs it with one forward_backward.
"""

from __future__ import annotations

from typing import Any, Literal

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy import func
from sqlmodel import col, select

from engine.protocol import CustomLossGraph
from engine.rules import CUSTOM_LOSS_FN, CUSTOM_LOSS_MAX_ARG_DEPTH, CUSTOM_LOSS_MAX_NODES
from gateway.context import ContextDep, RequestContext
from gateway.db.tables import CustomLossRow, SessionRow, TrainingRunRow
from gateway.deps import owned_session
from gateway.errors import InvalidRequestError, QuotaExceededError
from gateway.futures.store import fingerprint
from gateway.tinker_api.schemas import returns
from gateway.tinker_api.sequenced import Prepared, submit_once

router = APIRouter(prefix="/api/v1")
_INPUTS = 16  # the SDK's limit, logprobs included


class CustomLossInput(BaseModel):
    name: str = Field(min_length=1, max_length=64)
    rank: Literal[0, 1, 2]


class CustomLossNode(BaseModel):
    model_config = ConfigDict(extra="forbid")

    op: str = Field(max_length=32)
    name: str = Field(min_length=1, max_length=128)
    target: str = Field(max_length=128)
    args: list[Any] = []
    kwargs: dict[str, Any] = {}


class CustomLossGraphWire(BaseModel):
    format: Literal[1] = 1
    nodes: list[CustomLossNode] = Field(min_length=1, max_length=CUSTOM_LOSS_MAX_NODES)


class CreateCustomLossRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    session_id: str
    custom_loss_seq_id: int = Field(ge=0, lt=2**31)
    name: str = Field(min_length=1, max_length=128)
    inputs: list[CustomLossInput] = Field(min_length=1, max_length=_INPUTS)
    graph: CustomLossGraphWire


class CustomLossFutureResponse(BaseModel):
    """A submitted create_custom_loss future (SDK: UntypedAPIFuture); it resolves to
    ``{"loss_id", "type": "create_custom_loss"}``."""

    request_id: str


def _depth(value: Any, limit: int) -> int:
    """Nesting depth of a JSON value, without recursion (a hostile upload can nest deeply)."""
    deepest, stack = 0, [(value, 0)]
    while stack:
        v, d = stack.pop()
        deepest = max(deepest, d)
        if deepest > limit:
            return deepest
        if isinstance(v, dict):
            stack.extend((x, d + 1) for x in v.values())
        elif isinstance(v, list):
            stack.extend((x, d + 1) for x in v)
    return deepest


def _graph(req: CreateCustomLossRequest) -> CustomLossGraph:
    # two levels for an argument's own wrapping ({"tuple": [...]}, the args list)
    limit = 2 * CUSTOM_LOSS_MAX_ARG_DEPTH + 2
    for node in req.graph.nodes:
        if _depth([node.args, node.kwargs], limit) > limit:
            raise InvalidRequestError(
                f"graph.nodes: node {node.name!r} nests its arguments deeper than "
                f"{CUSTOM_LOSS_MAX_ARG_DEPTH} values"
            )
    return CustomLossGraph(
        name=req.name,
        inputs=tuple((i.name, i.rank) for i in req.inputs),
        nodes=tuple(n.model_dump() for n in req.graph.nodes),
    )


def _check_room(t: RequestContext) -> None:
    """403 when the caller keeps ``gateway.max_custom_losses`` losses in live sessions (an ended
    session's are deleted by the sweep, gateway/runs/retention.py, and never count here)."""
    cap = t.config.gateway.max_custom_losses
    live = t.db.exec(
        select(func.count())
        .select_from(CustomLossRow)
        .join(SessionRow, col(SessionRow.id) == CustomLossRow.session_id)
        .where(CustomLossRow.user_id == t.who.user_id, col(SessionRow.finished_at).is_(None))
    ).one()
    if live >= cap:
        raise QuotaExceededError(
            f"custom losses: {live} are stored for your sessions that have not ended, the "
            f"server keeps at most {cap} (gateway.max_custom_losses); finish sessions you no "
            "longer use, which deletes their losses",
            "max_custom_losses",
            cap,
            live,
        )


@router.post("/create_custom_loss", **returns(CustomLossFutureResponse))
async def create_custom_loss(req: CreateCustomLossRequest, t: ContextDep) -> dict:
    """Check a traced loss (400 naming the node when refused) and keep it for this session;
    the future resolves to its ``loss_id``."""
    if not t.config.custom_loss_server_side:
        raise InvalidRequestError(
            "create_custom_loss: server-side custom losses are off on this server "
            "(custom_loss_server_side: false); the SDK runs custom losses client-side"
        )
    session = owned_session(t.db, t.who, req.session_id)
    graph = _graph(req)
    fp = fingerprint(req.model_dump(mode="json")) or ""
    loss_id = f"{session.id}:loss:{req.custom_loss_seq_id}"

    async def prepare() -> Prepared:
        row = t.db.get(CustomLossRow, loss_id)
        if row is not None and row.fingerprint != fp:
            raise InvalidRequestError(
                f"custom_loss_seq_id: {req.custom_loss_seq_id} already names another loss in "
                "this session"
            )
        if row is None:
            _check_room(t)
            # Any Trainer checks it: the check needs torch, not a model.
            await t.engine.trainer(t.engine.base_models[0]).check_custom_loss(graph)
            t.db.add(
                CustomLossRow(
                    id=loss_id,
                    session_id=session.id,
                    user_id=t.who.user_id,
                    name=req.name,
                    inputs=[list(i) for i in graph.inputs],
                    nodes=list(graph.nodes),
                    fingerprint=fp,
                )
            )
            t.db.commit()
        result = {"loss_id": loss_id, "type": "create_custom_loss"}

        async def run() -> tuple[str, object]:
            return "json", result

        return run, {}

    rec = await submit_once(t, (loss_id, 0), fp, "create_custom_loss", prepare)
    return {"request_id": rec.request_id}


def attached_graph(t: RequestContext, run: TrainingRunRow, config: dict) -> dict | None:
    """The stored graph (JSON, for the job) of a ``custom`` forward_backward of ``run``; None
    for other losses. An unknown loss_id, or another session's, is an InvalidRequestError."""
    if not t.config.custom_loss_server_side:
        raise InvalidRequestError(
            f"loss_fn: {CUSTOM_LOSS_FN!r} is off on this server (custom_loss_server_side: false)"
        )
    loss_id = config.get("loss_id")
    if not isinstance(loss_id, str):
        raise InvalidRequestError(
            f"loss_fn_config.loss_id: loss_fn {CUSTOM_LOSS_FN!r} needs the loss_id that "
            "create_custom_loss returned"
        )
    row = t.db.get(CustomLossRow, loss_id)
    if row is None or row.session_id != run.session_id or row.user_id != t.who.user_id:
        raise InvalidRequestError(
            f"loss_fn_config.loss_id: custom loss {loss_id!r} not found in this model's "
            "session (a loss is used by the session that created it)"
        )
    return {"name": row.name, "inputs": row.inputs, "nodes": row.nodes}
