"""Access control lists, Kafka-shaped, and the decision they give (sans-IO).

An ACL: principal (``User:NAME`` or ``User:*``), allow or deny, an operation, a
resource (stream, consumer group, or the cluster) named literally or by prefix.
A request is allowed when an allow matches and no deny does (deny wins); super users
bypass ACLs; with user authentication on, anything not allowed is denied. As in Kafka,
an allow of read, write, delete or alter allows describe, alter-configs allows
describe-configs, and ``all`` stands for every operation; a deny denies its operation only. The literal name ``*`` matches every name;
create on the cluster allows creating any stream.
"""

from __future__ import annotations

from dataclasses import dataclass

OPERATIONS = ("read", "write", "create", "delete", "alter", "describe", "describe-configs",
              "alter-configs", "cluster-action", "all")
RESOURCES = ("stream", "group", "cluster")
PATTERNS = ("literal", "prefixed")
PERMISSIONS = ("allow", "deny")
CLUSTER = "kera-cluster"   # the one cluster resource's name
ANONYMOUS = "User:ANONYMOUS"

# an operation asked -> the operations an ACL may name to allow it (Kafka's implications)
_GRANTS = {op: {op, "all"} for op in OPERATIONS}
for _op in ("read", "write", "delete", "alter"):
    _GRANTS["describe"].add(_op)
_GRANTS["describe-configs"].add("alter-configs")


@dataclass(frozen=True, slots=True)
class Acl:
    principal: str
    permission: str
    operation: str
    resource: str
    name: str
    pattern: str = "literal"

    def to_wire(self) -> list:
        return [self.principal, self.permission, self.operation, self.resource, self.name,
                self.pattern]

    @classmethod
    def from_wire(cls, v) -> Acl:
        if not (isinstance(v, list) and len(v) == 6 and all(isinstance(x, str) for x in v)):
            raise ValueError("an ACL is [principal, permission, operation, resource, name, pattern]")
        return check(cls(*v))

    def matches(self, op: str, resource: str, name: str) -> bool:
        """Whether this ACL speaks of ``op`` on the resource: an allow by implication too
        (read allows describe), a deny only of that operation (or all), as in Kafka."""
        if self.resource != resource or self.operation not in (
                _GRANTS[op] if self.permission == "allow" else (op, "all")):
            return False
        if self.pattern == "prefixed":
            return name.startswith(self.name)
        return self.name == name or self.name == "*"

    def __str__(self) -> str:
        what = CLUSTER if self.resource == "cluster" else f"{self.resource} {self.name!r}" + (
            " (prefixed)" if self.pattern == "prefixed" else "")
        return f"{self.permission} {self.principal} {self.operation} on {what}"


def check(a: Acl) -> Acl:
    """``a`` if well formed, else ValueError saying what is wrong."""
    if not (a.principal.startswith("User:") and len(a.principal) > 5):
        raise ValueError(f"principal must be User:NAME or User:*, not {a.principal!r}")
    for value, allowed, what in ((a.permission, PERMISSIONS, "permission"),
                                 (a.operation, OPERATIONS, "operation"),
                                 (a.resource, RESOURCES, "resource"), (a.pattern, PATTERNS, "pattern")):
        if value not in allowed:
            raise ValueError(f"{what} must be one of {', '.join(allowed)}, not {value!r}")
    if a.resource == "cluster" and (a.name != CLUSTER or a.pattern != "literal"):
        raise ValueError(f"the cluster resource is named {CLUSTER}, literally")
    if not a.name or len(a.name) > 255:
        raise ValueError("a resource name has 1 to 255 characters")
    return a


class Authorizer:
    """The decisions of one version of the ACLs. ``allowed`` costs a scan of the ACLs naming
    the principal (or ``User:*``) and the resource type: callers cache decisions per
    connection (``gate.Peer``), so this runs once per resource and connection."""

    def __init__(self, acls=(), super_users=(), version: int = 0):
        self.version = version
        self.super_users = frozenset(super_users)
        self.acls = tuple(acls)
        self._by: dict[tuple[str, str], list[Acl]] = {}
        for a in self.acls:
            self._by.setdefault((a.principal, a.resource), []).append(a)

    def allowed(self, principal: str, op: str, resource: str, name: str) -> bool:
        """Whether ``principal`` may ``op`` the resource; the group name ``*any*`` asks
        whether it may read some consumer group."""
        if principal in self.super_users:
            return True
        if resource == "group" and name == "*any*":
            return any(a.permission == "allow" and a.operation in _GRANTS["read"]
                       for p in (principal, "User:*") for a in self._by.get((p, "group"), ()))
        if op == "create" and resource == "stream" and self.allowed(principal, op, "cluster", CLUSTER):
            return True   # as Kafka: create on the cluster allows creating any stream
        allow = False
        for p in (principal, "User:*"):
            for a in self._by.get((p, resource), ()):
                if a.matches(op, resource, name):
                    if a.permission == "deny":
                        return False
                    allow = True
        return allow
