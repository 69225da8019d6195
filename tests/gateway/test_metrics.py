"""GET /metrics on the real gateway (in-process engine on the tiny model, real SQLite): requests are
labelled by route template and status (never the raw path), quota denials by quota and level, no
raw key ever appears in the exposition; the endpoint can be switched off or put behind an admin
key."""

from __future__ import annotations

import re

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.gateway.harness import create_model, new_key, set_quota

ENGINE_BACKEND = "mock"  # HTTP semantics only (tests/gateway/conftest.py)


@pytest.fixture(scope="module")
def env(make_gateway):
    with make_gateway() as gw:
        yield gw.db_url, gw.client


def _samples(text: str) -> dict[tuple[str, frozenset], float]:
    """{(sample name, frozenset(labels.items())): value} of an exposition (parsed, not grepped,
    so the test also proves the output is valid Prometheus text)."""
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


def _count(samples, method: str, route: str, status: int) -> float:
    labels = frozenset({"method": method, "route": route, "status": str(status)}.items())
    return samples.get(("twinkle_http_requests_total", labels), 0.0)


def test_requests_are_labelled_by_route_template_and_status_and_keys_never_appear(env) -> None:
    db_url, c = env
    key = new_key(db_url, "mia", org="metrics-org")
    set_quota(db_url, "org", "metrics-org", "max_lora_rank", 8)
    run_id = "run-secret-id-1234"

    assert c.post("/api/v1/create_session", json={}, headers={"X-API-Key": key}).status_code == 200
    bearer = {"Authorization": f"Bearer {key}"}
    r = c.post("/api/v1/create_session", json={}, headers=bearer)
    assert r.status_code == 200
    sid = r.json()["session_id"]
    r = c.get(f"/api/v1/training_runs/{run_id}", headers=bearer)
    assert r.status_code == 404, r.text
    assert c.get(f"/no/such/path/{key}").status_code == 404
    r = c.post("/api/v1/create_session", json={}, headers={"X-API-Key": key + "x"})
    assert r.status_code == 401
    r = create_model(c, key, sid, 0, rank=16)  # over the org's max_lora_rank
    assert r.status_code == 403 and r.json()["quota"]["name"] == "max_lora_rank"

    r = c.get("/metrics")
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/plain")
    text = r.text
    samples = _samples(text)
    assert _count(samples, "POST", "/api/v1/create_session", 200) == 2
    assert _count(samples, "POST", "/api/v1/create_session", 401) == 1
    assert _count(samples, "GET", "/api/v1/training_runs/{run_id}", 404) == 1
    assert _count(samples, "GET", "unmatched", 404) == 1
    assert _count(samples, "POST", "/api/v1/create_model", 403) == 1
    latency = frozenset({"method": "POST", "route": "/api/v1/create_session"}.items())
    assert samples[("twinkle_http_request_seconds_count", latency)] == 3
    denial = frozenset({"quota": "max_lora_rank", "level": "org"}.items())
    assert samples[("twinkle_quota_denials_total", denial)] == 1
    assert ("twinkle_futures_pending", frozenset()) in samples
    # no raw key, no key body, no raw path id, no user or org name in any label or value
    for secret in (key, key[4:], key[10:], run_id, "mia", "metrics-org", sid):
        assert secret not in text
    routes = {dict(labels).get("route") for (_, labels) in samples} - {None}
    assert all(r == "unmatched" or r.startswith("/") for r in routes)
    assert not any(re.search(r"\{\w+:\w+\}", r) for r in routes)  # convertors stripped


def test_odd_methods_collapse_into_one_label(env) -> None:
    _, c = env
    c.request("BREW", "/api/v1/create_session")
    samples = _samples(c.get("/metrics").text)
    methods = {dict(labels).get("method") for (_, labels) in samples} - {None}
    assert "BREW" not in methods and "other" in methods


def test_metrics_can_be_switched_off(make_gateway) -> None:
    with make_gateway(gateway={"metrics_enabled": False}) as gw:
        assert gw.client.get("/metrics").status_code == 404


def test_metrics_can_require_an_admin_key(make_gateway) -> None:
    with make_gateway(gateway={"metrics_require_admin": True}) as gw:
        c = gw.client
        user = gw.key("ulla", org="acme")
        admin = gw.key("root", org="ops", scope="admin")
        assert c.get("/metrics").status_code == 401
        assert c.get("/metrics", headers={"X-API-Key": user}).status_code == 403
        r = c.get("/metrics", headers={"X-API-Key": admin})
        assert r.status_code == 200 and "twinkle_http_requests_total" in r.text
        assert admin not in r.text and user not in r.text


def test_storage_gauges_report_the_fullest_org_and_user(make_gateway) -> None:
    """Checkpoint rows in the real DB against max_checkpoint_bytes limits: the fill ratio is the
    fullest subject's per level (default user quota included); no subject is named."""
    import sqlalchemy as sa
    from sqlmodel import Session, select

    from gateway.db.tables import CheckpointRow, TrainingRunRow, UserRow
    from gateway.metrics_storage import fill_ratios

    quotas = {"max_checkpoint_bytes": 1000}
    with make_gateway(gateway={"default_user_quotas": quotas}) as gw:
        gw.key("stor-u1", org="stor-org")
        gw.key("stor-u2", org="stor-org")
        set_quota(gw.db_url, "org", "stor-org", "max_checkpoint_bytes", 4000)
        set_quota(gw.db_url, "user", "stor-u2", "max_checkpoint_bytes", 500)
        engine = sa.create_engine(gw.db_url)
        with Session(engine) as s:
            users = {u.name: u.id for u in s.exec(select(UserRow))}
            for name, size, eph in (
                ("stor-u1", 600, False),
                ("stor-u2", 400, False),
                ("stor-u2", 9999, True),
            ):
                run = TrainingRunRow(
                    id=f"run-{name}-{size}",
                    user_id=users[name],
                    session_id="no-session",
                    base_model="twinkle/tiny-chat",
                    lora_rank=4,
                )
                s.add(run)
                s.flush()
                s.add(
                    CheckpointRow(
                        run_id=run.id,
                        user_id=users[name],
                        kind="training",
                        name=f"c{size}",
                        tinker_path=f"tinker://{run.id}/c",
                        storage_dir="/x",
                        size_bytes=size,
                        ephemeral=eph,
                    )
                )
            s.commit()
            kept, ratios = fill_ratios(s, quotas["max_checkpoint_bytes"])
        assert kept == 1000  # the ephemeral checkpoint does not count
        assert ratios == {"org": 1000 / 4000, "user": 400 / 500}  # u2's own limit beats the default
        samples = _samples(gw.client.get("/metrics").text)
        assert samples[("twinkle_storage_quota_fill_ratio", frozenset({("level", "user")}))] == 0.8
        assert samples[("twinkle_checkpoint_bytes", frozenset())] == 1000
        assert samples[("twinkle_data_dir_free_bytes", frozenset())] > 0
