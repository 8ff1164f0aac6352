"""Who is asking: the tenant a request belongs to, resolved once at the edge and handed inward as a plain value.

The API keys file (kimiserve/security.py ApiKeys) names a tenant per key; without `--api-keys-file` every request
belongs to DEFAULT. The edges resolve the presented key:
- gRPC: the API-key interceptor (security.ApiKeyInterceptor) runs each admitted call with its tenant set;
  `grpc_tenant(context)` reads it in a servicer.
- HTTP: the gate (router/http/gate.py) stores it in the request's scope; `http_tenant(request)` reads it.
From there it is an argument: the flows (router/flow.py `choices` -> `run` -> router/generation.py
`Generation.run`), the batch runner (which runs a batch's requests as the batch's tenant) and the HTTP file and batch
routes take a `Tenant`, never a key.

Files and batches belong to the tenant that created them (Tenant.reads / Tenant.changes, applied by the batch
runner and router/http/batches.py). An admin identity reads every tenant's files and batches and changes only its
own; it has no other power.
"""

from __future__ import annotations

import contextvars
import re
from dataclasses import dataclass
from typing import Any

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
ADMIN_MARK = "admin"


@dataclass(frozen=True)
class Tenant:
    name: str  # matches NAME: printable, short, safe in logs, metric labels and cache salts
    admin: bool = False  # reads every tenant's files and batches (docs/threat-model.md)

    def reads(self, owner: str) -> bool:
        """May this tenant see a file or batch of tenant `owner` (get, list, download, results)? Where it may not,
        the thing does not exist for it: NOT_FOUND / 404, exactly as for an id never issued."""
        return self.admin or owner == self.name

    def changes(self, owner: str) -> bool:
        """May it change one (cancel, delete, run a batch from a file)? Only its owner may."""
        return owner == self.name


DEFAULT = Tenant("default")  # every request's tenant without --api-keys-file, and a key listed without a name

# Set by the API-key interceptor inside each call it admits (each gRPC call runs in a task of its own). Its default
# holds for a router without keys, where the interceptor is not installed and every caller is DEFAULT.
_GRPC_TENANT: contextvars.ContextVar[Tenant] = contextvars.ContextVar("kimiserve_tenant", default=DEFAULT)


def set_grpc_tenant(tenant: Tenant) -> None:
    """The interceptor's half: the running call belongs to `tenant`."""
    _GRPC_TENANT.set(tenant)


def grpc_tenant(context: Any) -> Tenant:
    """The tenant of the gRPC call being served (its `context` names which call is meant; the interceptor set the
    tenant in the call's own task)."""
    del context  # the call's task carries it
    return _GRPC_TENANT.get()


def http_tenant(request: Any) -> Tenant:
    """The tenant of an HTTP request (a Starlette Request), set by the gate before any route runs."""
    return request.scope["state"]["tenant"]
