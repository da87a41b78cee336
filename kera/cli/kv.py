"""``kera kv put|get|cas|delete|list MAP ...``: the linearizable map from the shell.

Exit status 1 means "no": ``get`` of an absent key, ``cas`` on a version
mismatch, ``delete`` of an absent key. Errors print ``error: CODE: message``
and exit 1 as well, so scripts test the output, not only the status.
"""

from __future__ import annotations

import sys

from .options import client, config, coordinator, run


def add_parsers(sub) -> None:
    kv = sub.add_parser("kv", help="a linearizable key-value map on a stream")
    ksub = kv.add_subparsers(dest="op", required=True)
    for op, extra in (("put", ("key", "value")), ("get", ("key",)),
                      ("cas", ("key", "version", "value")), ("delete", ("key",)), ("list", ())):
        p = client(ksub.add_parser(op))
        p.add_argument("map")
        for a in extra:
            p.add_argument(a, type=int if a == "version" else str)


def cmd_kv(args) -> None:
    from kera_client.kv import open_kv

    async def go():
        async with open_kv(args.map, coordinator(args), config=config(args)) as m:
            if args.op == "put":
                return f"version {await m.put(args.key, args.value)}", True
            if args.op == "get":
                v = await m.get(args.key)
                return (None, False) if v is None else (v.decode(errors="replace"), True)
            if args.op == "cas":
                ok = await m.compare_and_set(args.key, args.version, args.value)
                return (None if ok else "version mismatch"), ok
            if args.op == "delete":
                ok = await m.delete(args.key)
                return (None if ok else "absent"), ok
            return "\n".join(f"{k.decode(errors='replace')}\t{ver}\t{v.decode(errors='replace')}"
                             for k, ver, v in await m.items()) or None, True

    out, ok = run(go)
    if out is not None:
        print(out, file=sys.stdout if ok else sys.stderr)
    if not ok:
        sys.exit(1)


COMMANDS = {"kv": cmd_kv}
