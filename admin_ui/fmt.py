"""How the console writes values for people: counts with thousands separators, durations, UTC
timestamps without microseconds, byte sizes, statuses; and the id -> name lookups the tables use
instead of bare ids. Pure functions (tests/console/test_fmt.py)."""

from __future__ import annotations

from datetime import UTC, datetime


def count(n: int | float | None) -> str:
    if n is None:
        return "—"
    if isinstance(n, float) and not n.is_integer():
        return f"{n:,.1f}"
    return f"{int(n):,}"


def rate(per_s: float | None, unit: str = "/s") -> str:
    if per_s is None:
        return "—"
    if per_s >= 100:
        return f"{per_s:,.0f}{unit}"
    return f"{per_s:,.1f}{unit}"


def percent(fraction: float | None) -> str:
    return "—" if fraction is None else f"{100 * fraction:.1f}%"


def seconds(s: float | None) -> str:
    if s is None:
        return "—"
    if s < 1:
        return f"{1000 * s:.0f} ms"
    if s < 120:
        return f"{s:.1f} s"
    if s < 7200:
        return f"{s / 60:.0f} min"
    return f"{s / 3600:.1f} h"


def nbytes(n: int | None) -> str:
    if n is None:
        return "—"
    size = float(n)
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if size < 1000 or unit == "TB":
            return f"{size:,.0f} {unit}" if unit == "B" else f"{size:,.1f} {unit}"
        size /= 1000
    return f"{size:,.1f} TB"


def when(iso: str | None) -> str:
    """``2025-01-02T03:04:05.123456Z`` -> ``2025-01-02 03:04:05 UTC``; None -> empty."""
    if not iso:
        return ""
    try:
        ts = datetime.fromisoformat(iso.replace("Z", "+00:00"))
    except ValueError:
        return iso
    return ts.strftime("%Y-%m-%d %H:%M:%S UTC")


def status(disabled: bool) -> str:
    return "disabled" if disabled else "active"


def key_status(key: dict, now: datetime | None = None) -> str:
    if key.get("revoked_at"):
        return "revoked"
    expires = key.get("expires_at")
    if expires:
        now = now or datetime.now(UTC).replace(tzinfo=None)  # the API's times: naive UTC + Z
        if datetime.fromisoformat(expires.rstrip("Z")) <= now:
            return "expired"
    return "active"


def details(d: dict | None) -> str:
    """An audit entry's details as ``key=value`` pairs, in a stable order."""
    if not d:
        return ""
    return ", ".join(f"{k}={'—' if v is None else v}" for k, v in sorted(d.items()))


def _limit(v: object) -> str:
    return "unlimited" if v is None else count(v) if isinstance(v, int) else str(v)


def event_summary(event: str, d: dict) -> str:
    """One readable line for an audit entry (actor and organization have their own columns);
    unknown events and extra fields fall back to `details`."""
    d = dict(d)
    if event == "quota_changed" and {"quota", "old", "new"} <= d.keys():
        line = f"{d.pop('quota')}: {_limit(d.pop('old'))} → {_limit(d.pop('new'))}"
        subject = d.pop("subject", "")
        line += f" ({subject.replace(':', ' ')})" if subject else ""
    elif event == "access_denied" and "path" in d:
        line = f"{d.pop('method', '')} {d.pop('path')}: {d.pop('reason', 'denied')}".strip()
    elif event in ("key_created", "key_revoked") and "key_prefix" in d:
        d.pop("key_id", None)
        line = f"key {d.pop('key_prefix')}…"
        if "scope" in d:
            line += f" ({d.pop('scope')} scope)"
        if "user" in d:
            line += f" for {d.pop('user')}"
    elif event in ("user_updated", "organization_updated") and "disabled" in d:
        what = d.pop("user", "")
        line = f"{what + ' ' if what else ''}{'disabled' if d.pop('disabled') else 'enabled'}"
    else:
        return details(d)
    rest = details(d)
    return f"{line}; {rest}" if rest else line


def names(rows: list[dict], key: str = "name") -> dict[int, str]:
    """``{id: name}`` for users or orgs (tables show names, not ids)."""
    return {r["id"]: r[key] for r in rows}
