"""Submitting Tinker requests as futures exactly once: the service layer under the Tinker routes.

Owns: `touch`, `in_order_rejection`, `submit_once` and `submit_sequenced`, on the request's
`gateway.context.RequestContext`.

`submit_sequenced` is the one path of a request in a model's seq_id order (forward,
forward_backward, optim_step, in-place load_weights, the saves and exports):

1. ownership: the route has resolved the run (`owned_run`: 404 for another tenant's);
2. claim (model_id, seq_id) in the future store (`FutureStore.claim`: atomic in this replica and,
   with Redis, across replicas by SET NX). A retry gets the first future (same payload) or a 409
   (another payload); a retry that arrives while the first is between claim and submit waits for
   the first one's future id instead of racing it;
3. touch the run (its last request time) and admit the request to its user's share of what
   unfinished requests may hold in this replica (`gateway.futures.held`: a 429 over it), given
   back when its future finishes;
4. prepare: validation and quota charges, returning the engine coroutine. A user error
   (`InvalidRequestError`, `QuotaExceededError`, `PayloadTooLargeError`) becomes a future that
   fails once its seq_id's turn has passed in the Trainer, so later requests of the model are not
   held up; a request over a size limit is also answered 413 at once (a retry of its seq_id gets
   the failed future). Any other error (a 429 rate limit: the SDK resends the same seq_id)
   releases the claim and propagates;
5. submit under the claim.

`submit_once` is steps 2, 4 and 5 for requests outside a model's order (create_model, load_weights
into a new model, asample with a seq_id).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from sqlmodel import Session

from gateway.context import RequestContext
from gateway.db.tables import TrainingRunRow, utcnow
from gateway.engine_client import EngineClient
from gateway.errors import InvalidRequestError, PayloadTooLargeError, QuotaExceededError
from gateway.futures.store import FutureRecord, ReplayJob, Result, Run
from gateway.runs.request_log import trace_tag
from gateway.tinker_api import jobs

#: what `submit_once`'s prepare step returns: the engine coroutine and the record's extra fields
Prepared = tuple[Run, dict[str, Any]]


#: `touch` writes a run's last request time at most this often: it is shown to the second-ish
#: by get_training_run, and a DB commit per request was ~1-3 ms of every training step's
#: submission on SQLite (two per step)
TOUCH_EVERY_S = 5.0


def touch(db: Session, run: TrainingRunRow) -> None:
    """Record that ``run`` was used now (shown by get_training_run; at most every
    `TOUCH_EVERY_S` seconds)."""
    now = utcnow()
    last = run.last_request_time
    if last is not None and (now - last).total_seconds() < TOUCH_EVERY_S:
        return
    run.last_request_time = now
    db.add(run)
    db.commit()


def in_order_rejection(engine: EngineClient, run: TrainingRunRow, seq_id: int, message: str) -> Run:
    """The coroutine of a refused request: it lets ``seq_id`` pass the model's ordering in the
    Trainer, then fails with ``message`` (a user error)."""
    return jobs.runner(engine, jobs.skip_job(run.base_model, run.id, seq_id, message))


async def submit_once(
    t: RequestContext,
    key: tuple[str, int] | None,
    fp: str | None,
    kind: str,
    prepare: Callable[[], Awaitable[Prepared]],
) -> FutureRecord:
    """The one future of idempotency ``key``: claim it, ``prepare``, submit. An existing future
    under ``key`` is returned as is (nothing is charged); if ``prepare`` raises, the claim is
    released and the error propagates. Without a key, prepare and submit."""
    if key is None:
        run, extra = await prepare()
        return await t.futures.submit(
            user_id=t.who.user_id, kind=kind, run=run, job=_job(run), extra=extra, fp=fp
        )
    got = await t.futures.claim(key, fp)
    if isinstance(got, FutureRecord):
        return got
    try:
        run, extra = await prepare()
    except BaseException:
        await t.futures.release(got)
        raise
    return await t.futures.submit(
        user_id=t.who.user_id, kind=kind, run=run, job=_job(run), extra=extra, claim=got
    )


def _job(run: Run) -> ReplayJob | None:
    """The job another replica re-runs ``run`` from, if it has one (training steps do; samples
    and saves expire with their replica)."""
    return run.job if isinstance(run, jobs.ReplayableRun) else None


async def submit_sequenced(
    t: RequestContext,
    run: TrainingRunRow,
    seq_id: int,
    fp: str | None,
    kind: str,
    prepare: Callable[[], Awaitable[Run]],
    held_bytes: int = 0,
) -> FutureRecord:
    """The future of request ``seq_id`` of model ``run`` (see the module docstring's steps).
    ``held_bytes``: what the request's decoded input holds until its future finishes."""
    too_large: list[PayloadTooLargeError] = []

    async def touch_and_prepare() -> Prepared:
        touch(t.db, run)
        held = t.services.held
        hold = held.admit(t.who.user_id, run.id, seq_id, held_bytes)
        try:
            job = await prepare()
        except (InvalidRequestError, QuotaExceededError, PayloadTooLargeError) as exc:
            if isinstance(exc, PayloadTooLargeError):
                too_large.append(exc)
            job = in_order_rejection(t.engine, run, seq_id, str(exc))
        except BaseException:
            held.finish(hold)
            raise
        extra = {"base_model": run.base_model, "trace": trace_tag(run.session_id, run.id)}
        return _releasing(job, lambda: held.finish(hold)), extra

    rec = await submit_once(t, (run.id, seq_id), fp, kind, touch_and_prepare)
    if too_large:  # its seq_id passes in order all the same: later requests do not wait for it
        raise too_large[0]
    return rec


def _releasing(run: Run, release: Callable[[], None]) -> Run:
    """``run``, calling ``release`` once it ends however it ends (keeps a replayable run's job)."""

    async def run_() -> Result:
        try:
            return await run()
        finally:
            release()

    return jobs.ReplayableRun(run.job, run_) if isinstance(run, jobs.ReplayableRun) else run_


def future_json(rec: FutureRecord, model_id: str | None = None) -> dict[str, Any]:
    """The wire form of a submitted future: ``{"request_id", "model_id"?}``."""
    out: dict[str, Any] = {"request_id": rec.request_id}
    if model_id is not None:
        out["model_id"] = model_id
    return out
