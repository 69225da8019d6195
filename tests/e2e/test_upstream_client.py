"""Upstream Twinkle's own client (PyPI twinkle-kit 0.5.1, with its patched tinker 0.16.1) and ours
(swapped in for it) against a real `twinkle serve`, running upstream's cookbook flows
(tests/compat/flows.py: the calls of self_cognition, dpo, short_math_grpo, sample, written by us
on our own data). Needs no upstream checkout, so CI runs it; the real scripts run in
tests/e2e/test_upstream_cookbook.py where a checkout exists.

Checks, each through both clients:
* labels: an upstream-encoded batch (rolled labels) gives, through the native route, the loss
  of upstream's own Tinker conversion through our Tinker route (1e-5 relative);
* SFT: losses equal between upstream's client and ours on the same data (1e-5), and fall;
* DPO and GRPO train: loss and metrics move (rewards are not all zero); so does upstream's Tinker
  DPO convention through its patched tinker 0.16.1;
* tenants: another user's checkpoint or session answers 404 (load, resume, sample, create).
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.compat.run_upstream import run_flow as run_upstream_flow
from tests.compat.venv import CompatVenvUnavailable, compat_python

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def pythons() -> dict[str, str]:
    try:
        upstream = str(compat_python())
    except CompatVenvUnavailable as exc:
        pytest.skip(str(exc))
    from tests.compat.swap_venv import build_swap_venv

    return {"upstream": upstream, "ours": str(build_swap_venv())}


@pytest.fixture(scope="module")
def run_flow(server, pythons):
    cache: dict[tuple[str, str], dict] = {}

    def run(flow: str, client: str, *extra: str) -> dict:
        if (flow, client) not in cache:
            key = server.create_key(f"flow-{flow}-{client}")
            args = list(extra)
            if flow == "tenant":
                args += ["--other-key", server.create_key(f"flow-{flow}-{client}-other")]
            cache[(flow, client)] = run_upstream_flow(pythons[client], server.url, key, flow, *args)
        return cache[(flow, client)]

    return run


@pytest.mark.parametrize("client", ["upstream", "ours"])
def test_rolled_labels_give_upstreams_own_conversion(run_flow, client):
    r = run_flow("labels", client)
    assert r["ours"] == (client == "ours")
    assert r["tokens"] > 20
    # measured: equal to ~1e-7 relative (float32 sums of a few hundred token losses)
    assert r["native_sum"] == pytest.approx(r["tinker_sum"], rel=1e-5)


def test_sft_losses_equal_across_clients(run_flow):
    up, ours = run_flow("sft", "upstream"), run_flow("sft", "ours")
    assert up["models"] == ours["models"] == ["twinkle/tiny-chat"]
    np.testing.assert_allclose(ours["losses"], up["losses"], rtol=1e-5)
    assert up["losses"][-1] < up["losses"][0]
    for r in (up, ours):
        assert r["path"].startswith("twinkle://") and r["checkpoint_dir"] == r["path"]
        assert r["listed"] and r["runs"] == 1  # a fresh user: this adapter's run
        assert r["progress"]["consumed_train_samples"] == 24 and r["progress"]["cur_step"] == 3
        assert {"loss", "grad_norm", "lr"} <= set(r["metrics"][-1])


@pytest.mark.parametrize("client", ["upstream", "ours"])
def test_dpo_trains(run_flow, client):
    r = run_flow("dpo", client)
    first, last = r["metrics"][0], r["metrics"][-1]
    assert r["losses"][-1] < r["losses"][0]
    assert first["rewards/margins"] == pytest.approx(0.0, abs=1e-6)  # policy == reference
    assert last["rewards/margins"] > 0 and last["rewards/accuracies"] > 0


@pytest.mark.parametrize("client", ["upstream", "ours"])
def test_grpo_trains(run_flow, client):
    steps = run_flow("grpo", client)["steps"]
    assert [s["n"] for s in steps] == [8, 8, 8]  # 2 prompts x num_samples 4
    assert all(s["grad_norm"] and s["grad_norm"] > 0 for s in steps)
    assert len({round(s["loss"], 9) for s in steps}) > 1
    assert all(s["last"] == "assistant" for s in steps)


@pytest.mark.parametrize("client", ["upstream", "ours"])
def test_other_users_checkpoints_and_sessions_are_404(run_flow, client):
    results = run_flow("tenant", client)["results"]
    assert results == {"load": "404", "resume": "404", "sample": "404", "session": "404"}


@pytest.mark.parametrize("client", ["upstream", "ours"])
def test_tinker_dpo_convention_trains(run_flow, client):
    """upstream's tinker/dpo.py: importance_sampling + dpo_* + ref_logps runs DPO."""
    r = run_flow("tinker_dpo", client)
    assert r["losses"][-1] < r["losses"][0]
    assert r["metrics"][0]["dpo_margin:mean"] == pytest.approx(0.0, abs=1e-6)
    assert r["metrics"][-1]["dpo_margin:mean"] > 0


def test_embedding_trains_equally_through_both_clients(run_flow):
    """upstream's embedding.py: InfonceLoss with task='embedding' and EmbeddingMetric."""
    up, ours = run_flow("embedding", "upstream"), run_flow("embedding", "ours")
    np.testing.assert_allclose(ours["losses"], up["losses"], rtol=1e-5)
    assert up["losses"][-1] < up["losses"][0]
    assert up["metrics"][-1]["pos_sim"] > up["metrics"][0]["pos_sim"]


@pytest.mark.parametrize("client", ["upstream", "ours"])
def test_tinker_scripts_through_the_patched_sdk(run_flow, client):
    """upstream's tinker/self_cognition.py + sample.py: init_tinker_client() patches tinker 0.16.1
    (ours only exports the server URL and key); twinkle:// paths are accepted."""
    r = run_flow("tinker_sft", client)
    assert r["losses"][-1] < r["losses"][0]
    assert r["path"].startswith("tinker://") and r["n_logprobs"] == 8
    assert r["sequences"] == 2 and r["runs"] == 1
