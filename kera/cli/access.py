"""``kera user`` and ``kera acl``: the users and ACLs of a cluster run with ``--auth``.

    kera user add NAME [--password-file F]     (else asked for, twice, or read from stdin)
    kera user delete NAME
    kera user list
    kera acl add --allow|--deny User:NAME --operation OP (--stream S | --group G | --cluster) [--prefixed]
    kera acl remove ...the same arguments...
    kera acl list [--principal User:NAME]

A password never leaves this process: the salted SCRAM keys are made here and sent.
"""

from __future__ import annotations

import getpass
import sys

from ..security.acl import CLUSTER, OPERATIONS, Acl, check
from .options import client, config, coordinator, run


def add_parsers(sub) -> None:
    u = sub.add_parser("user", help="users (SCRAM-SHA-256/512) of a cluster run with --auth")
    usub = u.add_subparsers(dest="action", required=True)
    add = client(usub.add_parser("add", help="add a user, or change its password"))
    add.add_argument("name")
    add.add_argument("--password-file", default=None, metavar="F",
                     help="read the password from F (its first line); else it is asked for")
    client(usub.add_parser("delete", help="delete a user")).add_argument("name")
    client(usub.add_parser("list", help="users and their mechanisms"))

    a = sub.add_parser("acl", help="ACLs (Kafka-shaped: deny wins, super users bypass)")
    asub = a.add_subparsers(dest="action", required=True)
    for action in ("add", "remove"):
        p = client(asub.add_parser(action, help=f"{action} an ACL"))
        allow = p.add_mutually_exclusive_group(required=True)
        allow.add_argument("--allow", metavar="PRINCIPAL", help="User:NAME or User:*")
        allow.add_argument("--deny", metavar="PRINCIPAL")
        p.add_argument("--operation", required=True, choices=OPERATIONS)
        what = p.add_mutually_exclusive_group(required=True)
        what.add_argument("--stream", metavar="NAME", help="a stream (or a prefix, --prefixed)")
        what.add_argument("--group", metavar="NAME", help="a consumer group (or a prefix)")
        what.add_argument("--cluster", action="store_true", help="the cluster")
        p.add_argument("--prefixed", action="store_true", help="NAME is a prefix")
    client(asub.add_parser("list", help="ACLs")).add_argument(
        "--principal", default=None, help="only this principal's")


def _acl(args) -> Acl:
    resource, name = ("cluster", CLUSTER) if args.cluster else \
        ("stream", args.stream) if args.stream is not None else ("group", args.group)
    try:
        return check(Acl(args.allow or args.deny, "allow" if args.allow else "deny", args.operation,
                         resource, name, "prefixed" if args.prefixed else "literal"))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


def _password(args) -> str:
    if args.password_file:
        with open(args.password_file) as f:
            pw = f.readline().rstrip("\n")
    elif sys.stdin.isatty():
        pw = getpass.getpass(f"password for {args.name}: ")
        if getpass.getpass("again: ") != pw:
            print("error: the passwords differ", file=sys.stderr)
            sys.exit(2)
    else:
        pw = sys.stdin.readline().rstrip("\n")
    if not pw:
        print("error: an empty password", file=sys.stderr)
        sys.exit(2)
    return pw


def cmd_user(args) -> None:
    from kera_client import open_admin

    password = _password(args) if args.action == "add" else None

    async def go():
        async with open_admin(coordinator(args), config(args)) as a:
            if args.action == "add":
                await a.add_user(args.name, password)
                print(f"user {args.name}: SCRAM-SHA-256 and SCRAM-SHA-512 keys stored")
            elif args.action == "delete":
                await a.delete_user(args.name)
                print(f"user {args.name} deleted")
            else:
                for name, mechs in await a.users():
                    print(f"{name}\t{','.join(mechs)}")

    run(go)


def cmd_acl(args) -> None:
    from kera_client import open_admin

    acl = _acl(args) if args.action in ("add", "remove") else None

    async def go():
        async with open_admin(coordinator(args), config(args)) as a:
            if args.action == "add":
                print(f"{'added' if await a.add_acl(acl) else 'already there'}: {acl}")
            elif args.action == "remove":
                print(f"{'removed' if await a.remove_acl(acl) else 'not there'}: {acl}")
            else:
                for x in await a.acls(args.principal):
                    print(x)

    run(go)


COMMANDS = {"user": cmd_user, "acl": cmd_acl}
