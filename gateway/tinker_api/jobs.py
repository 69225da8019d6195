"""Jobs: the engine calls of training futures, described as JSON so another gateway replica can
run them again after the replica that accepted them died (gateway/futures/store.py, takeover).

A job is ``[name, params]``. `runner(engine, job)` returns the future's coroutine factory with the
job attached (``.job``), which the future store records. Running a job twice is safe: the Trainer
answers a repeated (model_id, seq_id) with its first result (engine/scheduling/exactly_once.py).
"""

from __future__ import annotations

import base64
from collections.abc import Awaitable, Callable
from dataclasses import asdict, replace
from typing import Any

from engine.errors import UserInputError
from engine.protocol import AdamParams, CustomLossGraph, LoraSpec
from gateway.engine_client import EngineClient
from gateway.tinker_api.proto_codec import decode_forward_backward, encode_forward_backward_output

Job = list  # [name, params]
Run = Callable[[], Awaitable[tuple[str, Any]]]


def create_adapter_job(base: str, model_id: str, spec: LoraSpec, tenant: str) -> Job:
    return [
        "create_adapter",
        {"base": base, "model_id": model_id, "spec": asdict(spec), "tenant": tenant},
    ]


def forward_backward_job(
    base: str, model_id: str, seq_id: int, body: bytes, custom_loss: dict | None = None
) -> Job:
    """``custom_loss``: the stored graph of a ``loss_fn="custom"`` request (JSON), attached to
    the engine input (gateway/tinker_api/custom_losses.py)."""
    params = {
        "base": base,
        "model_id": model_id,
        "seq_id": seq_id,
        "body": base64.b64encode(body).decode(),
    }
    if custom_loss is not None:
        params["custom_loss"] = custom_loss
    return ["forward_backward", params]


def _custom_graph(params: dict) -> CustomLossGraph:
    return CustomLossGraph(
        name=params["name"],
        inputs=tuple((str(n), int(r)) for n, r in params["inputs"]),
        nodes=tuple(params["nodes"]),
    )


def optim_step_job(base: str, model_id: str, seq_id: int, params: AdamParams) -> Job:
    return [
        "optim_step",
        {"base": base, "model_id": model_id, "seq_id": seq_id, "adam": asdict(params)},
    ]


def skip_job(base: str, model_id: str, seq_id: int, message: str) -> Job:
    return ["skip", {"base": base, "model_id": model_id, "seq_id": seq_id, "message": message}]


async def _run(engine: EngineClient, name: str, p: dict) -> tuple[str, Any]:
    base, model_id = p["base"], p["model_id"]
    if name == "create_adapter":
        await engine.trainer(base, "create_adapter", model_id, LoraSpec(**p["spec"]), p["tenant"])
        return "json", {"model_id": model_id, "type": "create_model"}
    if name == "forward_backward":
        _, seq_id, inp = decode_forward_backward(base64.b64decode(p["body"]))
        if p.get("custom_loss") is not None:
            inp = replace(inp, custom_loss=_custom_graph(p["custom_loss"]))
        out = await engine.trainer(base, "forward_backward", model_id, p["seq_id"], inp)
        return "proto", encode_forward_backward_output(out)
    if name == "optim_step":
        out = await engine.trainer(
            base, "optim_step", model_id, p["seq_id"], AdamParams(**p["adam"])
        )
        return "json", {"metrics": out.metrics, "type": "optim_step"}
    if name == "skip":
        await engine.trainer(base, "skip", model_id, p["seq_id"])
        raise UserInputError(p["message"])
    raise ValueError(f"unknown job {name!r}")


def runner(engine: EngineClient, job: Job) -> Run:
    """The coroutine factory of ``job``, carrying the job as ``.job``."""

    async def run() -> tuple[str, Any]:
        return await _run(engine, job[0], job[1])

    run.job = job  # type: ignore[attr-defined]
    return run
