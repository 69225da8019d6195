"""``twinkle keys`` subcommands: create, list and revoke API keys directly in the database.

Owns the operator's key workflow. Each command first brings the configured database (see
`gateway.settings`) to the head migration, so it works on a fresh data dir and next to a running
server (SQLite WAL). ``create`` prints only the key on stdout; everything else goes to stderr.
Digests are never printed.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import TextIO

from sqlmodel import Session, col, select

from gateway.accounts.keys import DISPLAY_PREFIX_LEN, KEY_PREFIX, digest_key
from gateway.accounts.service import create_key, ensure_user, revoke_key
from gateway.db import make_engine, session_scope, upgrade_to_head
from gateway.db.tables import ApiKeyRow, OrganizationRow, UserRow
from gateway.errors import GatewayError
from gateway.settings import Settings


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="twinkle keys", description="Manage Twinkle API keys.")
    sub = p.add_subparsers(dest="command", required=True, metavar="{create,list,revoke}")
    c = sub.add_parser("create", help="create a key (and the user if missing); prints the key")
    c.add_argument("--user", required=True, help="user name")
    c.add_argument("--admin", action="store_true", help="give the key the admin scope")
    c.add_argument(
        "--org", help="organization of a new user (created if missing; default: default)"
    )
    c.add_argument("--name", help="a label for the key")
    c.add_argument("--expires-in", type=int, metavar="SECONDS", help="key lifetime in seconds")
    sub.add_parser("list", help="list keys: prefix, user, org, scope, created, expires, revoked")
    r = sub.add_parser("revoke", help="revoke the key with this display prefix (e.g. tml-AbCdEf)")
    r.add_argument("prefix", help="the key's display prefix as shown by `twinkle keys list`")
    return p


def _create(session: Session, args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    user = ensure_user(session, args.user, org_name=args.org, admin=args.admin)
    assert user.id is not None
    key, _ = create_key(
        session,
        user.id,
        scope="admin" if args.admin else "user",
        name=args.name,
        expires_in_s=args.expires_in,
    )
    session.commit()
    scope = "admin" if args.admin else "user"
    print(key, file=out, flush=True)
    print(
        f"created {scope} key {key[:DISPLAY_PREFIX_LEN]}... for user {args.user.strip()!r}; "
        "it is shown only once, store it now",
        file=err,
    )
    return 0


def _list(session: Session, out: TextIO) -> int:
    rows = session.exec(
        select(ApiKeyRow, UserRow, OrganizationRow)
        .join(UserRow, col(UserRow.id) == ApiKeyRow.user_id)
        .join(OrganizationRow, col(OrganizationRow.id) == UserRow.org_id, isouter=True)
        .order_by(col(ApiKeyRow.id))
    ).all()

    def ts(value) -> str:
        return value.isoformat(timespec="seconds") + "Z" if value else "-"

    table = [("PREFIX", "USER", "ORG", "SCOPE", "CREATED", "EXPIRES", "REVOKED")]
    for key, user, org in rows:
        table.append(
            (
                key.prefix,
                user.name,
                org.name if org else "-",
                key.scope,
                ts(key.created_at),
                ts(key.expires_at),
                ts(key.revoked_at),
            )
        )
    widths = [max(len(r[i]) for r in table) for i in range(len(table[0]))]
    for r in table:
        print("  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)).rstrip(), file=out)
    return 0


def _revoke(session: Session, args: argparse.Namespace, err: TextIO) -> int:
    wanted = args.prefix.strip()
    if not wanted.startswith(KEY_PREFIX):
        print(f"error: a key prefix starts with {KEY_PREFIX!r}", file=err)
        return 1
    if len(wanted) > DISPLAY_PREFIX_LEN:  # a full key: exact match on its digest
        matches = session.exec(select(ApiKeyRow).where(ApiKeyRow.digest == digest_key(wanted)))
        rows = list(matches.all())
        wanted = wanted[:DISPLAY_PREFIX_LEN]
    else:
        rows = list(session.exec(select(ApiKeyRow).where(ApiKeyRow.prefix == wanted)).all())
    if not rows:
        print(f"error: no key with prefix {wanted}", file=err)
        return 1
    if len(rows) > 1:
        print(f"error: {len(rows)} keys share prefix {wanted}; pass the full key", file=err)
        return 1
    row = rows[0]
    if row.revoked_at is not None:
        print(f"key {wanted} was already revoked at {row.revoked_at.isoformat()}Z", file=err)
        return 0
    revoke_key(session, row)
    session.commit()
    print(f"revoked key {wanted}", file=err)
    return 0


def keys_main(argv: Sequence[str]) -> int:
    """Run ``twinkle keys <argv...>``; returns the exit status (argparse errors give 2)."""
    out, err = sys.stdout, sys.stderr
    try:
        args = _parser().parse_args(list(argv))
    except SystemExit as exc:  # --help or a usage error
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)
    settings = Settings.from_env()
    upgrade_to_head(settings.database_url)
    engine = make_engine(settings.database_url)
    try:
        with session_scope(engine) as session:
            if args.command == "create":
                return _create(session, args, out, err)
            if args.command == "list":
                return _list(session, out)
            return _revoke(session, args, err)
    except GatewayError as exc:
        print(f"error: {exc.message}", file=err)
        return 1
    finally:
        engine.dispose()


if __name__ == "__main__":
    sys.exit(keys_main(sys.argv[1:]))
