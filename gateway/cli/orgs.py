"""``twinkle orgs`` and ``twinkle quotas``: manage organizations and quota limits directly in the
database (like ``twinkle keys``; the admin API offers the same over HTTP).

``twinkle orgs create NAME | list | disable NAME | enable NAME``;
``twinkle quotas set (--org NAME | --user NAME) QUOTA=VALUE... | show (--org | --user) NAME``
(``QUOTA=none`` removes a limit). Changes are audited like the admin API's.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from sqlmodel import Session, col, select

from gateway.accounts.audit import record_event
from gateway.accounts.service import ensure_org, find_org
from gateway.db import make_engine, session_scope, upgrade_to_head
from gateway.db.tables import OrganizationRow, UserRow, utcnow
from gateway.errors import GatewayError, InvalidRequestError, NotFoundError
from gateway.quotas.limits import QUOTAS, limits_of, set_limit
from gateway.settings import Settings


def _orgs(session: Session, args: argparse.Namespace) -> int:
    if args.command == "list":
        for org in session.exec(select(OrganizationRow).order_by(col(OrganizationRow.id))):
            state = "disabled" if org.disabled_at else "active"
            print(f"{org.id}\t{org.name}\t{state}")
        return 0
    if args.command == "create":
        org = ensure_org(session, args.name)
        print(f"organization {org.name!r} (id {org.id})", file=sys.stderr)
        return 0
    org = find_org(session, args.name)
    if org is None:
        raise NotFoundError(f"organization {args.name!r} not found")
    org.disabled_at = utcnow() if args.command == "disable" else None
    session.add(org)
    record_event(
        session,
        "organization_updated",
        org_id=org.id,
        details={"disabled": org.disabled_at is not None},
    )
    print(f"organization {org.name!r} {args.command}d", file=sys.stderr)
    return 0


def _subject(session: Session, args: argparse.Namespace) -> tuple[str, int, int | None]:
    if args.org:
        org = find_org(session, args.org)
        if org is None:
            raise NotFoundError(f"organization {args.org!r} not found")
        assert org.id is not None
        return "org", org.id, org.id
    user = session.exec(select(UserRow).where(UserRow.name == args.user)).first()
    if user is None:
        raise NotFoundError(f"user {args.user!r} not found")
    assert user.id is not None
    return "user", user.id, user.org_id


def _quotas(session: Session, args: argparse.Namespace) -> int:
    kind, sid, org_id = _subject(session, args)
    if args.command == "set":
        for item in args.limits:
            name, sep, raw = item.partition("=")
            if not sep:
                raise InvalidRequestError(
                    f"{item!r}: expected QUOTA=VALUE (one of {sorted(QUOTAS)})"
                )
            value = None if raw.strip().lower() == "none" else int(raw)
            old, new = set_limit(session, kind, sid, name.strip(), value)
            record_event(
                session,
                "quota_changed",
                org_id=org_id,
                details={"subject": f"{kind}:{sid}", "quota": name, "old": old, "new": new},
            )
    for name, value in sorted(limits_of(session, kind, sid).items()):
        print(f"{name}={value}")
    return 0


def orgs_main(argv: Sequence[str], which: str = "orgs") -> int:
    p = argparse.ArgumentParser(prog=f"twinkle {which}")
    sub = p.add_subparsers(dest="command", required=True)
    if which == "orgs":
        for cmd in ("create", "disable", "enable"):
            sub.add_parser(cmd).add_argument("name")
        sub.add_parser("list")
    else:
        for cmd in ("set", "show"):
            sp = sub.add_parser(cmd)
            who = sp.add_mutually_exclusive_group(required=True)
            who.add_argument("--org")
            who.add_argument("--user")
            if cmd == "set":
                sp.add_argument("limits", nargs="+", metavar="QUOTA=VALUE")
    try:
        args = p.parse_args(list(argv))
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 2
    settings = Settings.from_env()
    upgrade_to_head(settings.database_url)
    engine = make_engine(settings.database_url)
    try:
        with session_scope(engine) as session:
            return _orgs(session, args) if which == "orgs" else _quotas(session, args)
    except (GatewayError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    finally:
        engine.dispose()
