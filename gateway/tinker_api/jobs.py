"""Jobs: the engine calls of training futures, described as JSON so another gateway replica can
run them again after the replica that accepted them died (gateway/futures/store.py, takeover).

A job is a `ReplayJob` (name and JSON params). `runner(engine, job)` returns a `ReplayableRun`: the
future's coroutine factory together with its job, which `submit_once` hands to the future store.
Running a job twice is safe: the Trainer answers a repeated (model_id, seq_id) with its first
result (engine/scheduling/exactly_once.py).
"""

from __future__ import annotations

import base64
from collections.abc import Awaitable
from dataclasses import asdict, dataclass, replace

from engine.errors import UserInputError
from engine.protocol import AdamParams, CustomLossGraph, ForwardBackwardInput, LoraSpec
from engine.rules import loss_fn_input_names
from gateway.engine_client import EngineClient
from gateway.futures.store import ReplayJob, Result, Run
from gateway.tinker_api.proto_codec import (
    decode_forward_backward,
    encode_forward_backward_output,
    parse_forward_backward,
)


@dataclass(frozen=True)
class ReplayableRun:
    """A future's coroutine factory (``run``) and the job that re-creates it on another replica:
    callable like any `Run`, and `submit_once` passes ``job`` to the store."""

    job: ReplayJob
    run: Run

    def __call__(self) -> Awaitable[Result]:
        return self.run()


def create_adapter_job(base: str, model_id: str, spec: LoraSpec, tenant: str) -> ReplayJob:
    return ReplayJob(
        "create_adapter",
        {"base": base, "model_id": model_id, "spec": asdict(spec), "tenant": tenant},
    )


def forward_backward_job(
    base: str, model_id: str, seq_id: int, body: bytes, custom_loss: dict | None = None
) -> ReplayJob:
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
    return ReplayJob("forward_backward", params)


def _custom_graph(params: dict) -> CustomLossGraph:
    return CustomLossGraph(
        name=params["name"],
        inputs=tuple((str(n), int(r)) for n, r in params["inputs"]),
        nodes=tuple(params["nodes"]),
    )


def _redecoded(params: dict) -> ForwardBackwardInput:
    """A taken-over job's input, decoded again from its body as the route decoded it: only the
    loss_fn_inputs its loss reads (the body passed the size budget when it was accepted)."""
    msg = parse_forward_backward(base64.b64decode(params["body"]))
    graph = params.get("custom_loss")
    keep = loss_fn_input_names(msg.loss_fn or "cross_entropy", graph["inputs"] if graph else None)
    return decode_forward_backward(msg, keep)[2]


def optim_step_job(base: str, model_id: str, seq_id: int, params: AdamParams) -> ReplayJob:
    return ReplayJob(
        "optim_step",
        {"base": base, "model_id": model_id, "seq_id": seq_id, "adam": asdict(params)},
    )


def skip_job(base: str, model_id: str, seq_id: int, message: str) -> ReplayJob:
    return ReplayJob(
        "skip", {"base": base, "model_id": model_id, "seq_id": seq_id, "message": message}
    )


async def _run(
    engine: EngineClient, job: ReplayJob, decoded: ForwardBackwardInput | None = None
) -> Result:
    p = job.params
    trainer, model_id = engine.trainer(p["base"]), p["model_id"]
    if job.name == "create_adapter":
        await trainer.create_adapter(model_id, spec=LoraSpec(**p["spec"]), tenant=p["tenant"])
        return "json", {"model_id": model_id, "type": "create_model"}
    if job.name == "forward_backward":
        # the replica that accepted the request runs the input it already decoded; only a
        # replica taking the job over parses the body again
        inp = decoded or _redecoded(p)
        if p.get("custom_loss") is not None:
            inp = replace(inp, custom_loss=_custom_graph(p["custom_loss"]))
        out = await trainer.forward_backward(model_id, seq_id=p["seq_id"], inp=inp)
        return "proto", encode_forward_backward_output(out)
    if job.name == "optim_step":
        params = AdamParams(**p["adam"])
        out = await trainer.optim_step(model_id, seq_id=p["seq_id"], params=params)
        return "json", {"metrics": out.metrics, "type": "optim_step"}
    if job.name == "skip":
        await trainer.skip(model_id, seq_id=p["seq_id"])
        raise UserInputError(p["message"])
    raise ValueError(f"unknown job {job.name!r}")


def runner(
    engine: EngineClient, job: ReplayJob, decoded: ForwardBackwardInput | None = None
) -> ReplayableRun:
    """The coroutine factory of ``job``, with the job. ``decoded``: a forward_backward job's
    input as the route already parsed it from the job's body (saves a second parse)."""

    async def run() -> Result:
        return await _run(engine, job, decoded)

    return ReplayableRun(job, run)
