"""A real Prometheus (Debian's package) scrapes a real `twinkle serve` while two tenants train and
sample through the Tinker SDK: the shipped prometheus.yml finds the gateway and every engine
replica (one Trainer, two Samplers, through the data dir's file_sd folder); every PromQL
expression of every dashboard panel and alert rule runs through Prometheus' query API without
error and with data. Alerts that only fire on a failure are made to fire: a Sampler replica is
killed (TwinkleEngineDown), quota denials are provoked (TwinkleQuotaDenialSpike) and an org is
filled to its checkpoint quota (TwinkleStorageNearCap); the rest (a 30-s queue for 5 minutes,
5% 5xx, a full disk) are checked on their signal, the expression without its threshold. Then a
label audit: no series carries a key, a key prefix, a user or org name, or an id."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import tinker
from tinker import types

from tests import services
from tests.e2e.conftest import TWINKLE
from tests.observability import (
    alert_queries,
    instantiate,
    panel_queries,
    prometheus_config,
)
from tests.observability import (
    signal as alert_signal,
)

pytestmark = pytest.mark.e2e
BASE = "twinkle/tiny-chat"
SCRAPE_S = 0.5
DENIALS = 55
#: alerts this test makes fire; the others are checked on their signal only
CAUSED = {"TwinkleEngineDown", "TwinkleQuotaDenialSpike", "TwinkleStorageNearCap"}
#: label names any series may carry (tests the "model, replica and fixed sets only" rule)
LABELS = {
    "__name__", "job", "instance", "model", "replica", "role", "op", "kind", "category", "state",
    "mode", "le", "method", "route", "status", "quota", "level",
}  # fmt: skip


@pytest.fixture(scope="module")
def stack(tmp_path_factory, pool, start_observed):
    """(server, Prometheus URL): the pool's ``observed`` profile (one Trainer, two Samplers) and a
    Prometheus on the shipped config."""
    try:
        services.prometheus_binaries()
    except FileNotFoundError as exc:
        if os.environ.get("CI"):
            raise
        pytest.skip(str(exc))
    srv = pool.get("observed", start_observed)
    prom_dir = tmp_path_factory.mktemp("obs-prom")
    prom_cfg = prometheus_config(prom_dir, srv.url.removeprefix("http://"), srv.data_dir, SCRAPE_S)
    with services.run_prometheus(prom_cfg) as prom:
        yield srv, prom


def query(prom: str, expr: str) -> list[dict]:
    r = httpx.get(f"{prom}/api/v1/query", params={"query": expr}, timeout=10)
    body = r.json()
    assert r.status_code == 200 and body["status"] == "success", f"{expr}: {body}"
    return body["data"]["result"]


def wait_for(prom: str, expr: str, timeout: float = 30.0) -> list[dict]:
    deadline = time.monotonic() + timeout
    while True:
        res = query(prom, expr)
        if res or time.monotonic() > deadline:
            return res
        time.sleep(SCRAPE_S)


def _cli(srv, *args: str) -> str:
    out = subprocess.run(
        [TWINKLE, *args], env=srv.env, capture_output=True, text=True, check=True, timeout=120
    )
    return out.stdout


def _datums(seed: int) -> list[types.Datum]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(4):
        toks = rng.integers(5, 900, size=17).tolist()
        out.append(
            types.Datum(
                model_input=types.ModelInput.from_ints(toks[:-1]),
                loss_fn_inputs={"target_tokens": toks[1:]},
            )
        )
    return out


def _tenant(url: str, key: str, seed: int, save: bool, ids: list[str]) -> None:
    sc = tinker.ServiceClient(base_url=url, api_key=key)
    tc = sc.create_lora_training_client(base_model=BASE, rank=4, seed=seed).result()
    ids.append(tc.model_id)
    for _ in range(3):
        fb = tc.forward_backward(_datums(seed), "cross_entropy")
        opt = tc.optim_step(types.AdamParams(learning_rate=1e-3))
        fb.result()
        opt.result()
    if save:  # a kept checkpoint: the org's storage quota fills up below
        path = tc.save_weights_for_sampler(name="obs-ckpt").result().path
        ids.append(path)
        sampler = tc.create_sampling_client(path)
    else:
        sampler = sc.create_sampling_client(base_model=BASE)
    prompt = types.ModelInput.from_ints([11, 12, 13, 14])
    res = sampler.sample(prompt, 2, types.SamplingParams(max_tokens=6, seed=seed)).result()
    assert len(res.sequences) == 2
    sc.close("success")


@pytest.fixture(scope="module")
def workload(stack) -> dict[str, list[str]]:
    """Two tenants in two orgs train, save, sample; one bad request; quota denials; an org at
    its checkpoint quota. Returns what must never appear in a label: keys, names, ids."""
    srv, prom = stack
    assert wait_for(prom, 'count(up{job="twinkle-engine"} == 1) == 3'), "3 engine targets"
    keys = {
        "obs-user-ann": _cli(srv, "keys", "create", "--user", "obs-user-ann", "--org", "obs-org-a"),
        "obs-user-ben": _cli(srv, "keys", "create", "--user", "obs-user-ben", "--org", "obs-org-b"),
    }
    keys = {u: k.strip().splitlines()[-1] for u, k in keys.items()}
    ids: list[str] = []
    threads = [
        threading.Thread(target=_tenant, args=(srv.url, keys["obs-user-ann"], 1, True, ids)),
        threading.Thread(target=_tenant, args=(srv.url, keys["obs-user-ben"], 2, False, ids)),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=180)
    assert len(ids) == 3, ids  # two model ids and a checkpoint path: both tenants finished

    # A request the engine rejects (a target token beyond the vocabulary): failure panels.
    sc = tinker.ServiceClient(base_url=srv.url, api_key=keys["obs-user-ben"])
    tc = sc.create_lora_training_client(base_model=BASE, rank=4).result()
    ids.append(tc.model_id)
    bad = types.Datum(
        model_input=types.ModelInput.from_ints([1, 2, 3]),
        loss_fn_inputs={"target_tokens": [2, 3, 99999]},
    )
    with pytest.raises(tinker.RequestFailedError):
        tc.forward_backward([bad], "cross_entropy").result()
    # Quota denials: LoRA rank over the org's cap, 403 at once (the SDK does not retry 403);
    # over 50, so the 5-minute rate is above the alert's 10 a minute.
    _cli(srv, "quotas", "set", "--org", "obs-org-b", "max_lora_rank=4")
    for _ in range(DENIALS):
        with pytest.raises(tinker.PermissionDeniedError):
            sc.create_lora_training_client(base_model=BASE, rank=8).result()
    sc.close("success")
    # obs-org-a at exactly its checkpoint bytes: fill ratio 1.0
    kept = wait_for(prom, "max(twinkle_checkpoint_bytes) > 0")
    assert kept, "the saved checkpoint is counted"
    _cli(srv, "quotas", "set", "--org", "obs-org-a", f"max_checkpoint_bytes={kept[0]['value'][1]}")
    return {
        "keys": list(keys.values()),
        "key_parts": [k[:10] for k in keys.values()] + [k[4:14] for k in keys.values()],
        "names": ["obs-user-ann", "obs-user-ben", "obs-org-a", "obs-org-b"],
        "ids": ids,
    }


def _replica_pid(name: str) -> int:
    """The pid of the Ray Serve replica process of deployment ``name`` (its process title)."""
    for proc in Path("/proc").iterdir():
        try:
            title = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except (OSError, ValueError):
            continue
        if f"ServeReplica:twinkle:{name} " in title + " " and "ray::" in title:
            return int(proc.name)
    raise AssertionError(f"no process for replica {name}")


def test_every_panel_and_alert_expression_has_data(stack, workload) -> None:
    srv, prom = stack
    alerts = {q.where.removeprefix("alert "): q.expr for q in alert_queries()}
    assert set(alerts) >= CAUSED
    for name in sorted(CAUSED - {"TwinkleEngineDown"}):
        assert wait_for(prom, alerts[name]), f"{name} does not fire"
    # Engine down: kill one Sampler replica; its target stops answering until Serve replaces it.
    os.kill(_replica_pid("sampler-twinkle-tiny-chat-r1"), signal.SIGKILL)
    assert wait_for(prom, alerts["TwinkleEngineDown"], timeout=20), "no target went down"

    gpu = bool(query(prom, "twinkle_engine_gpu_memory_bytes"))
    empty = []
    for q in panel_queries():
        expr = instantiate(q.expr, "1m")
        if not wait_for(prom, expr, timeout=5) and (gpu or "gpu_memory" not in expr):
            empty.append(q.where)
    for q in alert_queries():
        query(prom, q.expr)  # valid PromQL, whatever it returns now (CAUSED: fired above)
        if not wait_for(prom, alert_signal(q.expr), timeout=5):
            empty.append(f"{q.where} (signal)")
    assert not empty, f"no data for {empty}"
    # the replaced replica is scraped again (its target file now names the new process)
    assert wait_for(prom, 'count(up{job="twinkle-engine"} == 1) == 3', timeout=60)


def test_no_label_value_carries_a_secret_or_an_id(stack, workload) -> None:
    _, prom = stack
    r = httpx.get(
        f"{prom}/api/v1/series", params={"match[]": '{__name__=~"twinkle_.+|up"}'}, timeout=10
    )
    series = r.json()["data"]
    assert len(series) > 100  # the audit looks at the real workload's series
    forbidden = [*workload["keys"], *workload["key_parts"], *workload["names"], *workload["ids"]]
    id_like = re.compile(r"tml-|tinker://|twinkle://|:train:|:sample:|[0-9a-f]{16}")
    for s in series:
        assert set(s) <= LABELS, f"unexpected label in {s}"
        for k, v in s.items():
            assert not any(f in v for f in forbidden), f"{k}={v!r} carries a secret or an id"
            assert not id_like.search(v), f"{k}={v!r} looks like an id"
