"""The cookbook's ``modelscope/`` scripts against `twinkle serve` in a hosted configuration: two
gateway replicas sharing a real Redis, a fresh database on a real Postgres, JWT mode for the Tinker
SDK and per-user default quotas; users, keys and quotas made with the real ``twinkle keys`` /
``twinkle quotas`` commands.

Each script runs as a user of the service runs it: its own process with only
``TWINKLE_SERVER_URL`` and ``MODELSCOPE_TOKEN`` set (no ``TWINKLE_SERVER_TOKEN``), in a directory
holding a local quick-start file that must be ignored. Checked: each script's outcome (losses
fall, samples come back, every path is ``twinkle://``, what it saved is public: another user reads
it and samples it); a missing variable exits 2 naming it; a run under a ``train_tokens_per_minute``
quota smaller than its tokens waits out the window and finishes; a hard cap exits 3 naming the
quota, without a traceback.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import tinker
from tinker import types

from tests.e2e.conftest import TWINKLE, Server
from tests.e2e.hosted_profile import set_quotas
from tests.e2e.test_serve_lifecycle import _listener_commands

pytestmark = pytest.mark.e2e
BASE = "twinkle/tiny-chat"
CLIENT = Path(__file__).resolve().parents[2] / "cookbook" / "client"
SCRIPTS = [
    "twinkle/modelscope/dpo.py",
    "twinkle/modelscope/self_cognition.py",
    "twinkle/modelscope/multi_modal.py",
    "tinker/modelscope/dpo.py",
    "tinker/modelscope/sample.py",
    "tinker/modelscope/self_cognition.py",
    "tinker/modelscope/short_math_grpo.py",
]
#: the throttled run: twinkle/modelscope/self_cognition.py --max-steps 8 sends 8 passes of 70-95
#: tokens (~690 in all; the data and the loader's seed are fixed). A sliding minute of 400 admits
#: about half of them, so the run must wait for its first tokens to leave the window (~60 s) once,
#: and every single pass fits (a pass over the limit would be a 403 instead).
THROTTLE_TOKENS_PER_MINUTE = 400
THROTTLE_STEPS = 8


@dataclass
class Run:
    rc: int
    out: dict | None  # the final JSON line, if any
    stdout: str
    stderr: str
    wall_s: float


class Started:
    """A script's process, collected by a thread: its wall time is its own, whenever the test
    looks at it."""

    def __init__(self, cmd: list[str], env: dict[str, str], cwd: Path) -> None:
        self.t0 = time.monotonic()
        self.proc = subprocess.Popen(
            cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        self.output: tuple[str, str] = ("", "")
        self.wall_s = 0.0
        self._thread = threading.Thread(target=self._collect, daemon=True)
        self._thread.start()

    def _collect(self) -> None:
        self.output = self.proc.communicate()
        self.wall_s = time.monotonic() - self.t0

    def finish(self, timeout: float = 300) -> Run:
        self._thread.join(timeout)
        assert not self._thread.is_alive(), f"{self.proc.args} still running after {timeout} s"
        stdout, stderr = self.output
        lines = stdout.strip().splitlines()
        out = json.loads(lines[-1]) if lines and lines[-1].startswith("{") else None
        return Run(self.proc.returncode, out, stdout, stderr, self.wall_s)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self._thread.join(30)


class Hosted:
    """The hosted server, its users, and the scripts' shell."""

    def __init__(self, server: Server, home: Path) -> None:
        self.server, self.home = server, home
        self.work = home / "work"  # the users' directory: it holds a quick-start file to ignore
        (self.work / ".twinkle").mkdir(parents=True)
        self.quick_key = ""  # the quick-start file's key (valid)
        self.throttled: Started | None = None  # the throttled run

    def user(self, name: str, **quotas: int) -> str:
        """A new user's API key, with ``quotas`` overriding the defaults for them."""
        key = self.server.create_key(name)
        if quotas:
            set_quotas(self.server, name, **quotas)
        return key

    def env(self, key: str | None, url: str | None = None) -> dict[str, str]:
        """A user's shell: the two hosted variables (the key as MODELSCOPE_TOKEN) and nothing of
        Twinkle's or Tinker's besides."""
        env = {
            "PATH": os.environ["PATH"],
            "HOME": str(self.home),
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "TINKER_TELEMETRY": "0",
            # a crash in native code shows its stack, and glibc's abort message goes to stderr
            # rather than a terminal the test does not have
            "PYTHONFAULTHANDLER": "1",
            "LIBC_FATAL_STDERR_": "1",
        }
        if url is not None:
            env["TWINKLE_SERVER_URL"] = url
        if key is not None:
            env["MODELSCOPE_TOKEN"] = key
        return env

    def start(self, script: str, *args: str, key: str | None, url: str | None = None) -> Started:
        cmd = [sys.executable, str(CLIENT / script), *args]
        return Started(cmd, self.env(key, url), self.work)

    def run(self, script: str, *args: str, key: str | None, url: str | None = None) -> Run:
        return self.start(script, *args, key=key, url=url).finish()

    def ok(self, script: str, *args: str, key: str) -> Run:
        r = self.run(script, *args, key=key, url=self.server.url)
        if r.rc < 0 and r.out is not None:
            # killed by a signal after printing its whole result: the client process crashed in
            # interpreter teardown (the SDK's daemon thread against native libraries' exit), not
            # in anything the server answered. Run it once more; the stack stays in the log.
            print(f"[hosted] {script} died by signal {-r.rc} after its result:\n{r.stderr[-3000:]}")
            r = self.run(script, *args, key=key, url=self.server.url)
        assert r.rc == 0 and r.out is not None, r.stderr[-3000:]
        return r

    def checkpoint_as(self, key: str, path: str) -> httpx.Response:
        """GET the checkpoint at ``path`` with another user's key (the native management route)."""
        return httpx.get(
            f"{self.server.url}/api/v1/twinkle/checkpoint",
            params={"path": path},
            headers={"X-API-Key": key},
            timeout=30,
        )


@pytest.fixture(scope="module")
def hosted(tmp_path_factory, pool, start_hosted):
    server = pool.get("hosted", start_hosted)
    h = Hosted(server, tmp_path_factory.mktemp("hosted-home"))
    # a quick-start file pointing at this very server, with a valid key: a hosted script must not
    # fall back to it when a variable is missing
    h.quick_key = h.user("quickstart-owner")
    quick = {"url": server.url, "key": h.quick_key}
    (h.work / ".twinkle" / "quickstart.json").write_text(json.dumps(quick))
    # The throttled run starts first: its minute of waiting overlaps the other tests (its user's
    # token window is its own). test_a_tight_token_quota_waits_and_finishes collects it.
    key = h.user("throttled", train_tokens_per_minute=THROTTLE_TOKENS_PER_MINUTE)
    h.throttled = h.start(
        "twinkle/modelscope/self_cognition.py",
        *("--max-steps", str(THROTTLE_STEPS)),
        key=key,
        url=server.url,
    )
    try:
        yield h
    finally:
        if h.throttled is not None:
            h.throttled.kill()


def test_the_server_is_the_hosted_configuration(hosted):
    """JWT mode is on (the Tinker SDK exchanges its key for a token), quotas are set."""
    url, key = hosted.server.url, hosted.user("probe")
    token = httpx.post(f"{url}/api/v1/auth/token", headers={"X-API-Key": key}, timeout=30)
    assert token.status_code == 200, token.text
    caps = httpx.get(
        f"{url}/api/v1/get_server_capabilities",
        headers={"X-API-Key": token.json()["jwt"]},
        timeout=30,
    )
    assert caps.status_code == 200 and BASE in caps.text
    shown = subprocess.run(
        [TWINKLE, "quotas", "show", "--user", "throttled"],
        env=hosted.server.env,
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    assert f"train_tokens_per_minute={THROTTLE_TOKENS_PER_MINUTE}" in shown.stdout


@pytest.mark.skipif(shutil.which("ss") is None, reason="needs ss (iproute2)")
def test_serve_proxy_ingress_still_serves_the_sdk(hosted):
    """Two gateway replicas (``gateway.ingress: auto``) mean ``serve_proxy``: Ray Serve's proxy
    listens (not a gateway replica) and the unmodified Tinker SDK trains through it."""
    port = int(hosted.server.url.rsplit(":", 1)[1])
    assert _listener_commands(port) == ["ray::ProxyActor"]
    sc = tinker.ServiceClient(base_url=hosted.server.url, api_key=hosted.user("proxy-user"))
    tc = sc.create_lora_training_client(base_model=BASE, rank=4)
    datum = types.Datum(
        model_input=types.ModelInput.from_ints([1, 2, 3, 4]),
        loss_fn_inputs={"target_tokens": [2, 3, 4, 5]},
    )
    fb = tc.forward_backward([datum], "cross_entropy")
    opt = tc.optim_step(types.AdamParams(learning_rate=1e-3))
    assert fb.result().metrics["loss:sum"] > 0
    assert opt.result() is not None


@pytest.mark.parametrize("script", SCRIPTS)
def test_missing_url_or_key_exits_2_naming_it(hosted, script):
    # a valid key, and a quick-start file naming the server in the working directory: not used
    r = hosted.run(script, key=hosted.quick_key, url=None)
    assert r.rc == 2 and r.out is None, r.stderr[-2000:]
    assert r.stderr.strip().splitlines() == [
        "TWINKLE_SERVER_URL is not set: export the hosted service's URL"
    ]
    r = hosted.run(script, key=None, url=hosted.server.url)
    assert r.rc == 2 and r.out is None, r.stderr[-2000:]
    assert r.stderr.strip().splitlines() == [
        "TWINKLE_SERVER_TOKEN (or MODELSCOPE_TOKEN) is not set: export your API key"
    ]


def test_twinkle_self_cognition(hosted):
    owner, other = hosted.user("ms-native-sft"), hosted.user("ms-native-sft-reader")
    r = hosted.ok("twinkle/modelscope/self_cognition.py", "--max-steps", "6", key=owner)
    losses = r.out["losses"]
    assert len(losses) == 6 and losses[-1] < losses[0]
    path = r.out["checkpoint"]
    assert path.startswith("twinkle://") and r.out["published"] == path
    assert f"[hosted] published {path}" in r.stderr
    seen = hosted.checkpoint_as(other, path)  # public: another user of the service reads it
    assert seen.status_code == 200 and seen.json()["public"] is True
    assert seen.json()["twinkle_path"] == path


def test_twinkle_multi_modal(hosted):
    owner, other = hosted.user("ms-native-vl"), hosted.user("ms-native-vl-reader")
    r = hosted.ok("twinkle/modelscope/multi_modal.py", "--max-steps", "30", key=owner)
    losses = r.out["losses"]
    assert len(losses) == 30 and losses[-1] < 0.5 * losses[0]
    assert len(r.out["read"]) == 8  # every image sampled back through the native sampler
    path = r.out["checkpoint"]
    assert path.startswith("twinkle://") and r.out["published"] == path
    seen = hosted.checkpoint_as(other, path)
    assert seen.status_code == 200 and seen.json()["public"] is True


def test_twinkle_dpo(hosted):
    owner, other = hosted.user("ms-native-dpo"), hosted.user("ms-native-dpo-reader")
    r = hosted.ok(
        "twinkle/modelscope/dpo.py", "--max-steps", "4", "--pairs-per-step", "8", key=owner
    )
    assert r.out["losses"][-1] < r.out["losses"][0] and r.out["margins"][-1] > 0
    assert "step 4/4" in r.stderr
    path = r.out["checkpoint"]
    assert path.startswith("twinkle://") and r.out["published"] == path
    assert hosted.checkpoint_as(other, path).json()["public"] is True


def test_tinker_self_cognition_then_another_user_samples_it(hosted):
    owner, other = hosted.user("ms-tinker-sft"), hosted.user("ms-tinker-sampler")
    r = hosted.ok("tinker/modelscope/self_cognition.py", "--max-steps", "6", key=owner)
    losses = r.out["losses"]  # batches of 4 out of 8 rows: steps 0, 2, 4 see the same rows
    assert len(losses) == 6 and losses[4] < losses[2] < losses[0]
    state, sampler = r.out["state"], r.out["sampler_path"]
    assert state.startswith("twinkle://") and sampler.startswith("twinkle://")
    assert sampler.endswith("/sampler_weights/self-cognition") and len(r.out["samples"]) == 2
    assert r.out["published"] == [state, sampler]
    for path in (state, sampler):
        assert hosted.checkpoint_as(other, path).json()["public"] is True

    # another user samples the published weights by path
    s = hosted.ok("tinker/modelscope/sample.py", "--model-path", sampler, key=other)
    assert s.out["model_path"] == sampler and len(s.out["samples"]) == 2
    assert f"sampling {sampler}" in s.stdout
    # the owner, without a path: their newest sampler checkpoint, spelled twinkle://
    s = hosted.ok("tinker/modelscope/sample.py", "--max-tokens", "8", key=owner)
    assert s.out["model_path"] == sampler and len(s.out["samples"]) == 2


def test_tinker_dpo(hosted):
    owner, other = hosted.user("ms-tinker-dpo"), hosted.user("ms-tinker-dpo-reader")
    r = hosted.ok(
        "tinker/modelscope/dpo.py", "--max-steps", "4", "--pairs-per-step", "8", key=owner
    )
    assert r.out["margins"][0] == pytest.approx(0.0, abs=1e-6)  # policy == reference
    assert r.out["losses"][-1] < r.out["losses"][0] and r.out["margins"][-1] > 0
    state = r.out["state"]
    assert state.startswith("twinkle://") and r.out["published"] == state
    assert hosted.checkpoint_as(other, state).json()["public"] is True


def test_tinker_short_math_grpo(hosted):
    owner, other = hosted.user("ms-tinker-grpo"), hosted.user("ms-tinker-grpo-reader")
    args = ("--max-steps", "2", "--reward", "shaped", "--seed", "0")
    r = hosted.ok("tinker/modelscope/short_math_grpo.py", *args, key=owner)
    steps = r.out["steps"]
    assert [s["step"] for s in steps] == [1, 2]
    assert all(len(s["rewards"]) == 2 * 4 for s in steps)  # batch 2 x 4 generations
    assert any(s["loss"] is not None for s in steps)  # shaped rewards: some signal trains
    state = r.out["state"]
    assert state.startswith("twinkle://") and r.out["published"] == state
    assert hosted.checkpoint_as(other, state).json()["public"] is True


@pytest.mark.parametrize(
    ("script", "quota", "limit"),
    [
        # the native client's add_adapter_to_model: HTTP 403
        ("twinkle/modelscope/dpo.py", "max_lora_rank", 4),
        # the Tinker SDK's create_model: HTTP 403
        ("tinker/modelscope/self_cognition.py", "max_training_clients", 0),
        # the Tinker SDK's save_state, after training: a future failed by the quota
        ("tinker/modelscope/dpo.py", "max_checkpoints", 0),
    ],
)
def test_a_hard_cap_exits_3_naming_the_quota(hosted, script, quota, limit):
    key = hosted.user(f"capped-{quota}", **{quota: limit})
    r = hosted.run(script, "--max-steps", "1", key=key, url=hosted.server.url)
    assert r.rc == 3 and r.out is None, r.stderr[-3000:]
    assert "Traceback" not in r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith(f"quota {quota} exhausted: quota {quota} exceeded for user "), last
    assert f"limit {limit}" in last and "request_id" not in last


def test_a_tight_token_quota_waits_and_finishes(hosted):
    """Started by the fixture: self_cognition.py --max-steps 8 under a per-minute token quota
    smaller than its tokens. It backs off (a line per wait) and finishes; the quota keeps any
    minute under the limit, so its first and last pass are over a minute apart."""
    assert hosted.throttled is not None
    r = hosted.throttled.finish(timeout=240)
    assert r.rc == 0 and r.out is not None, r.stderr[-3000:]
    assert len(r.out["losses"]) == THROTTLE_STEPS
    waits = [ln for ln in r.stderr.splitlines() if ln.startswith("[hosted] 429 ")]
    assert waits and all("rate limit train_tokens_per_minute reached" in w for w in waits)
    assert "Traceback" not in r.stderr
    assert 60 < r.wall_s < 180, r.wall_s
    assert r.out["published"] == r.out["checkpoint"]
