"""The console's pages, one module each, in sidebar order. Each page is ``render(api)``: it reads
and changes the service through `admin_ui.client.AdminClient` only; an `ApiError` it lets
through is shown by the app as one error line."""

from __future__ import annotations

from collections.abc import Callable

from admin_ui.client import AdminClient
from admin_ui.views import accounts, audit, engine, keys, overview, quotas, usage

PAGES: dict[str, Callable[[AdminClient], None]] = {
    "Overview": overview.render,
    "Orgs & users": accounts.render,
    "Keys": keys.render,
    "Quotas": quotas.render,
    "Usage": usage.render,
    "Audit log": audit.render,
    "Engine": engine.render,
}
