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

from fastapi import APIRouter

from gateway.admin_api import admin, admin_overview, admin_quotas, auth_routes, tinker_admin

router = APIRouter()
for _module in (admin, admin_quotas, admin_overview, auth_routes, tinker_admin):
    router.include_router(_module.router)

__all__ = ["router"]
