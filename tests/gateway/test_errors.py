"""The gateway's one error-to-HTTP mapping: JSON envelopes, status codes, retry headers, request
ids, validation errors naming each field (never an empty 400), engine errors, and 500s that leak
nothing."""

from __future__ import annotations

import logging
import pickle

import pytest
from fastapi import FastAPI, HTTPException
from fastapi.testclient import TestClient
from pydantic import BaseModel

from engine.errors import AdapterNotFoundError, BackendError, CheckpointError, UserInputError
from gateway.errors import (
    AuthenticationError,
    ConflictError,
    GatewayError,
    InvalidRequestError,
    NotFoundError,
    PermissionDeniedError,
    RateLimitedError,
    redact_paths,
    register_exception_handlers,
    without_server_paths,
)

ERRORS = [
    (AuthenticationError, 401, "unauthenticated"),
    (PermissionDeniedError, 403, "permission_denied"),
    (NotFoundError, 404, "not_found"),
    (ConflictError, 409, "conflict"),
    (InvalidRequestError, 400, "invalid_request"),
    (RateLimitedError, 429, "rate_limited"),
]


class CreateBody(BaseModel):
    base_model: str
    rank: int


@pytest.fixture
def client() -> TestClient:
    app = FastAPI()
    register_exception_handlers(app)
    by_name = {cls.__name__: cls for cls, _, _ in ERRORS}

    @app.post("/create")
    def create(body: CreateBody) -> dict:
        return {"rank": body.rank}

    @app.get("/raise/{name}")
    def raise_gateway(name: str) -> None:
        raise by_name[name](f"{name} happened")

    @app.get("/engine/{kind}")
    def raise_engine(kind: str) -> None:
        raise {
            "user": UserInputError("lora_rank must be <= 64"),
            "ckpt": CheckpointError("checkpoint shape mismatch"),
            "adapter": AdapterNotFoundError("adapter s1:train:0 not found"),
            "backend": BackendError("CUDA OOM at /srv/secret/path"),
        }[kind]

    @app.get("/boom")
    def boom() -> None:
        raise RuntimeError("db password is hunter2 at /srv/secret")

    @app.get("/http")
    def http() -> None:
        raise HTTPException(status_code=409, detail="already exists")

    return TestClient(app, raise_server_exceptions=False)


def test_invalid_body_is_400_json_naming_each_field(client: TestClient) -> None:
    resp = client.post("/create", json={"rank": "abc"})
    assert resp.status_code == 400
    assert resp.content and resp.headers["content-type"].startswith("application/json")
    body = resp.json()
    msg = body["error"]["message"]
    assert body["error"]["code"] == "invalid_request" and body["detail"] == msg
    assert "body.rank: Input should be a valid integer" in msg
    assert "body.base_model: Field required" in msg
    assert {tuple(e["loc"]) for e in body["errors"]} == {("body", "rank"), ("body", "base_model")}
    assert resp.headers["x-should-retry"] == "false"


def test_unparseable_body_is_400_not_empty(client: TestClient) -> None:
    headers = {"content-type": "application/json"}
    resp = client.post("/create", content=b"{not json", headers=headers)
    assert resp.status_code == 400 and resp.json()["error"]["message"]


@pytest.mark.parametrize("cls,status,code", ERRORS)
def test_gateway_errors_map_to_status_and_code(
    client: TestClient, cls: type[GatewayError], status: int, code: str
) -> None:
    resp = client.get(f"/raise/{cls.__name__}", headers={"X-Request-Id": "req-123"})
    assert resp.status_code == status
    body = resp.json()
    assert body == {
        "error": {"code": code, "message": f"{cls.__name__} happened"},
        "detail": f"{cls.__name__} happened",
        "request_id": "req-123",
    }
    assert resp.headers["x-request-id"] == "req-123"
    if status == 429:
        assert "x-should-retry" not in resp.headers and int(resp.headers["retry-after"]) >= 1
    else:
        assert resp.headers["x-should-retry"] == "false"
    if status == 401:
        assert resp.headers["www-authenticate"].startswith("Bearer")


def test_request_id_is_generated_when_absent_or_odd(client: TestClient) -> None:
    a = client.get("/raise/NotFoundError").json()["request_id"]
    b = client.get("/raise/NotFoundError", headers={"X-Request-Id": "bad id\twith spaces"}).json()
    assert len(a) == 32 and b["request_id"] != "bad id\twith spaces" and b["request_id"] != a


@pytest.mark.parametrize(
    "kind,status,code,message",
    [
        ("user", 400, "invalid_request", "lora_rank must be <= 64"),
        ("ckpt", 400, "invalid_request", "checkpoint shape mismatch"),
        ("adapter", 404, "not_found", "adapter s1:train:0 not found"),
        ("backend", 500, "internal", "internal server error"),
    ],
)
def test_engine_errors(client: TestClient, kind: str, status: int, code: str, message: str) -> None:
    resp = client.get(f"/engine/{kind}")
    assert resp.status_code == status
    assert resp.json()["error"] == {"code": code, "message": message}
    assert "/srv/secret" not in resp.text


def test_unhandled_exception_is_generic_500_and_logged(
    client: TestClient, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.ERROR, logger="gateway.errors")
    resp = client.get("/boom")
    assert resp.status_code == 500
    body = resp.json()
    assert body["error"] == {"code": "internal", "message": "internal server error"}
    assert body["request_id"] and "hunter2" not in resp.text and "secret" not in resp.text
    assert "x-should-retry" not in resp.headers
    assert any(r.exc_info and "hunter2" in str(r.exc_info[1]) for r in caplog.records)


def test_http_exceptions_use_the_same_envelope(client: TestClient) -> None:
    resp = client.get("/http")
    assert resp.status_code == 409
    assert resp.json()["error"] == {"code": "conflict", "message": "already exists"}
    missing = client.get("/no/such/route")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"


@pytest.mark.parametrize("cls,status,code", ERRORS)
def test_errors_pickle(cls: type[GatewayError], status: int, code: str) -> None:
    err = pickle.loads(pickle.dumps(cls("why")))
    assert type(err) is cls and err.message == "why" and str(err) == "why"
    assert (err.status_code, err.code) == (status, code)
    assert cls().message  # a default message exists


def test_rate_limited_retry_after() -> None:
    err = pickle.loads(pickle.dumps(RateLimitedError("slow down", 2.5)))
    assert err.retry_after_s == 2.5 and err.headers()["retry-after"] == "3"
    assert RateLimitedError("x").headers()["retry-after"] == "1"


@pytest.mark.parametrize(
    "text,public",
    [
        ("checkpoint /data/checkpoints/1/run/weights/st-2a: bad", "checkpoint …/st-2a: bad"),
        (
            "cannot read /a/b.json: No such file: '/a/b.json'",
            "cannot read …/b.json: No such file: '…/b.json'",
        ),
        (
            "no space left on the disk of /mnt/ckpt/3 while",
            "no space left on the disk of …/3 while",
        ),
        ("at file:///srv/x/y.bin", "at file://…/y.bin"),
        ("checkpoint /x/sess-a:train:0/w missing", "checkpoint …/w missing"),
        # not server paths: kept as they are
        ("tinker://sess-x:train:0/weights/a not found", None),
        ("see https://host/a/b and Qwen/Qwen2-0.5B", None),
        ("ratio 1/2/3, route /single", None),
    ],
)
def test_redact_paths(text: str, public: str | None) -> None:
    assert redact_paths(text) == (text if public is None else public)


def test_without_server_paths_keeps_the_error_but_not_the_path() -> None:
    from engine.errors import ReplicaLostError, StorageFullError

    plain = CheckpointError("checkpoint shape mismatch")
    assert without_server_paths(plain) is plain
    full = without_server_paths(StorageFullError("disk of /srv/data/ckpt is full"))
    assert type(full) is StorageFullError and str(full) == "disk of …/ckpt is full"
    lost = ReplicaLostError("replica at /srv/x/y died")
    lost.died = "actor-1"
    clean = pickle.loads(pickle.dumps(without_server_paths(lost)))
    assert str(clean) == "replica at …/y died" and clean.died == "actor-1"
