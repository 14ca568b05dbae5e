"""What a process is in its topology, and where its peers are.

The supervisor (``--replicas``, ``--frontends``) starts each child as ``voxserve serve`` with its settings as
VOXSERVE_* variables (``supervisor.child_environment``) and its role as the variables below. The child's entry
point (``app.serve``) reads them once, into a Role, and passes that on as an argument: nothing further down
reads the environment to learn what it is.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

RUN_DIR_ENV = "VOXSERVE_REPLICA_DIR"  # the supervisor's run directory: shared registry, statistics, metrics
NAME_ENV = "VOXSERVE_REPLICA_INDEX"  # the child's name among its peers
ROLE_ENV = "VOXSERVE_ROLE"  # with --frontends: "engine" or "frontend"
ENGINE_SOCKET_ENV = "VOXSERVE_ENGINE_SOCKET"  # an engine's socket
ENGINES_ENV = "VOXSERVE_ENGINES"  # a front end's engines' sockets, os.pathsep between them
# --frontend-impl native: the Unix socket a Python front end serves gRPC on, behind its native front end (only there)
FRONTEND_SOCKET_ENV = "VOXSERVE_FRONTEND_SOCKET"

STANDALONE, REPLICA, FRONTEND, ENGINE = "standalone", "replica", "frontend", "engine"


@dataclass(frozen=True)
class Role:
    """``standalone``: a server of its own (the model in process, its own ports and metrics). ``replica``: one of
    --replicas, sharing the supervisor's port; ``frontend``: a gRPC front end of ``engines``; ``engine``: the
    model's process behind ``engine_socket``. All but standalone keep their shared state in ``run_dir``. A front end
    with a ``partner_socket`` is the partner of a native front end (--frontend-impl native): it serves gRPC on that
    private socket only, for the calls the native one hands it, and hears from it what it served itself."""

    kind: str = STANDALONE
    run_dir: str = ""
    name: str = ""
    engines: tuple[str, ...] = ()
    engine_socket: str = ""
    partner_socket: str = ""

    @property
    def supervised(self) -> bool:
        return self.kind != STANDALONE

    @classmethod
    def from_environment(cls, env: Mapping[str, str] = os.environ) -> Role:
        run_dir = env.get(RUN_DIR_ENV, "")
        if not run_dir:
            return cls()
        kind = env.get(ROLE_ENV, "") or REPLICA
        if kind not in (REPLICA, FRONTEND, ENGINE):
            raise ValueError(f"{ROLE_ENV}={kind!r}: not a role (replica, frontend or engine)")
        engines = tuple(p for p in env.get(ENGINES_ENV, "").split(os.pathsep) if p) if kind == FRONTEND else ()
        if kind == FRONTEND and not engines:
            raise ValueError(f"{ROLE_ENV}={FRONTEND} needs the engines' sockets in {ENGINES_ENV}")
        partner = env.get(FRONTEND_SOCKET_ENV, "") if kind == FRONTEND else ""
        return cls(kind, run_dir, env.get(NAME_ENV, ""), engines, env.get(ENGINE_SOCKET_ENV, ""), partner)

    def environment(self) -> dict[str, str]:
        """The variables that tell a child this role (from_environment's inverse)."""
        env = {RUN_DIR_ENV: self.run_dir, NAME_ENV: self.name}
        if self.kind in (FRONTEND, ENGINE):
            env[ROLE_ENV] = self.kind
        if self.engines:
            env[ENGINES_ENV] = os.pathsep.join(self.engines)
        if self.engine_socket:
            env[ENGINE_SOCKET_ENV] = self.engine_socket
        if self.partner_socket:
            env[FRONTEND_SOCKET_ENV] = self.partner_socket
        return env
