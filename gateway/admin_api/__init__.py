"""Admin and account endpoints.

* ``/api/v1/admin/...`` (`gateway.admin_api.admin`, `gateway.admin_api.admin_quotas`): the admin
  REST API (admin scope): organizations, users, keys, quotas, usage, audit log, engine status.
  The admin console (admin_ui/) is built on it alone; `gateway.admin_api.admin_overview` holds
  what only the console needs (``whoami``, ``overview``).
* ``/api/v1/auth/...`` (`gateway.admin_api.auth_routes`): the Tinker SDK's JWT exchange and the
  CLI's ``auth/apikey/me``.
* ``/api/v1/audit``, ``/api/v1/billing/...`` (`gateway.admin_api.tinker_admin`): what the
  Tinker SDK's ``AdminClient`` calls, scoped to the caller's organization.
"""

from __future__ import annotations

from fastapi import APIRouter


def routers() -> list[APIRouter]:
    from gateway.admin_api import admin, admin_overview, admin_quotas, auth_routes, tinker_admin

    return [
        admin.router,
        admin_quotas.router,
        admin_overview.router,
        auth_routes.router,
        tinker_admin.router,
    ]
