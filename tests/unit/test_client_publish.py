"""`TwinkleClient.publish_checkpoint` (ours, not upstream's): the request it sends, on a recording
`httpx.MockTransport`. Against the real server: tests/e2e/test_cookbook_hosted.py (another user
reads a published checkpoint)."""

from __future__ import annotations

import httpx
import pytest

from twinkle_client import InvalidRequestError, TwinkleClient
from twinkle_client.types import SaveResponse

RUN = "sess-0123456789abcdef:tw-0a1b2c3d:default"


class Recorder:
    """Answers create_session, the publish endpoint and GET checkpoint; records the rest."""

    def __init__(self) -> None:
        self.seen: list[httpx.Request] = []
        self.public = False

    def __call__(self, req: httpx.Request) -> httpx.Response:
        self.seen.append(req)
        path = req.url.path
        if path.endswith("/twinkle/create_session"):
            return httpx.Response(200, json={"session_id": "sess-1"})
        if req.method == "POST" and path.endswith("/publish"):
            self.public = True
            return httpx.Response(200, json={})
        if path.endswith("/twinkle/checkpoint"):
            p = req.url.params["path"]
            body = {
                "checkpoint_id": p.split("/", 3)[3],
                "checkpoint_type": "training",
                "time": "2026-12-03T10:00:00Z",
                "twinkle_path": p,
                "public": self.public,
            }
            return httpx.Response(200, json=body)
        return httpx.Response(404, json={"detail": f"no route {path}"})


@pytest.fixture
def rec_client():
    rec = Recorder()
    client = TwinkleClient(
        "http://srv.test",
        "tml-key",
        session_heartbeat_interval=None,
        transport=httpx.MockTransport(rec),
    )
    yield rec, client
    client.close()


@pytest.mark.parametrize("scheme", ["twinkle://", "tinker://"])
def test_publish_posts_the_tinker_endpoint_and_returns_the_public_checkpoint(rec_client, scheme):
    rec, client = rec_client
    ckpt = client.publish_checkpoint(f"{scheme}{RUN}/weights/dpo-final")
    post = next(r for r in rec.seen if r.method == "POST" and r.url.path.endswith("/publish"))
    # the run id's ':' stay literal; the checkpoint id keeps its '/'
    assert post.url.path == f"/api/v1/training_runs/{RUN}/checkpoints/weights/dpo-final/publish"
    assert post.headers["authorization"] == "Bearer tml-key"
    assert ckpt.public and ckpt.twinkle_path == f"{scheme}{RUN}/weights/dpo-final"


def test_publish_takes_a_save_response(rec_client):
    rec, client = rec_client
    saved = SaveResponse(twinkle_path=f"twinkle://{RUN}/sampler_weights/s1")
    assert client.publish_checkpoint(saved).public
    get = rec.seen[-1]
    assert dict(get.url.params) == {"path": saved.twinkle_path}


@pytest.mark.parametrize("bad", ["/tmp/ckpt", "twinkle://", "twinkle://run-only", "dpo-final"])
def test_publish_refuses_what_is_not_a_checkpoint_path(rec_client, bad):
    rec, client = rec_client
    n = len(rec.seen)
    with pytest.raises(InvalidRequestError, match="twinkle_path"):
        client.publish_checkpoint(bad)
    assert len(rec.seen) == n  # nothing sent
