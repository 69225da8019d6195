"""Engine page: per base model, the Trainer's adapters (owner, loaded or offloaded), its queue per
tenant (jobs, place in line, oldest wait) and counters, and the Sampler's batching counters.

Source: ``GET /api/v1/admin/engine`` (each replica's ``stats``; with several replicas, the one
that answered); ``GET /api/v1/admin/users`` to name tenants (a tenant is its owner's user id).
"""

from __future__ import annotations

import pandas as pd
import streamlit as st

from admin_ui import fmt
from admin_ui.client import AdminClient


def _tenant(users: dict[int, str], tenant: str) -> str:
    return users.get(int(tenant), f"user {tenant}") if tenant.isdigit() else tenant


def _trainer(stats: dict, users: dict[int, str]) -> None:
    pool = stats.get("pool", {})
    m = st.columns(5)
    execution = stats.get("execution")
    mode = execution.get("mode") if isinstance(execution, dict) else execution
    m[0].metric("Execution", mode or "—", help="fused or sequential (auto: measured at start)")
    m[1].metric("Adapters loaded", f"{pool.get('resident', 0)} / {pool.get('capacity', 0)}")
    m[2].metric("Offloaded", fmt.count(pool.get("offloaded")))
    m[3].metric("Evictions / reloads", f"{pool.get('evictions', 0)} / {pool.get('reloads', 0)}")
    m[4].metric("Jobs completed", fmt.count(stats.get("completed")))
    st.markdown("**Queue per tenant**")
    queue = [
        {
            "Tenant": _tenant(users, q["tenant"]),
            "Queued jobs": q["jobs"],
            "Place in line": q["ahead"] + 1,
            "Oldest wait": fmt.seconds(q["oldest_wait_s"]),
        }
        for q in stats.get("queue", [])
    ]
    if queue:
        st.dataframe(pd.DataFrame(queue), hide_index=True, width="stretch")
    else:
        st.caption("Nothing queued.")
    st.markdown("**Adapters**")
    adapters = [
        {
            "Adapter (model id)": a["model_id"],
            "Owner": _tenant(users, a["tenant"]),
            "State": a["state"],
        }
        for a in sorted(stats.get("adapters", []), key=lambda a: (a["state"], a["model_id"]))
    ]
    if adapters:
        st.dataframe(pd.DataFrame(adapters), hide_index=True, width="stretch")
    else:
        st.caption("No adapters on this replica.")


def _sampler(stats: dict) -> None:
    m = st.columns(5)
    m[0].metric("Requests", fmt.count(stats.get("requests")))
    m[1].metric("Batches", fmt.count(stats.get("batches")))
    m[2].metric("Mean batch (requests)", f"{stats.get('mean_batch_requests', 0.0):.2f}")
    m[3].metric("Largest batch (rows)", fmt.count(stats.get("max_batch_rows_seen")))
    m[4].metric("Queued", fmt.count(stats.get("queued")))


def render(api: AdminClient) -> None:
    st.title("Engine")
    models = api.engine()
    users = fmt.names(api.users())
    if st.button("Refresh"):
        pass  # the click reruns the page
    for name, entry in models.items():
        st.header(name, divider="gray")
        trainer, sampler = entry.get("trainer", {}), entry.get("sampler", {})
        st.subheader("Trainer")
        if "error" in trainer:
            st.warning(f"The Trainer did not answer ({trainer['error']}).")
        else:
            _trainer(trainer, users)
        st.subheader("Sampler")
        if "error" in sampler:
            st.warning(f"The Sampler did not answer ({sampler['error']}).")
        else:
            _sampler(sampler)
