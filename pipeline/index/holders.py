"""Who runs a job: a name for this consumer process (written into the started-marker of the videos
it claims) and whether the process behind such a name still runs.

Inside Ray the name is the replica's actor name: a replica that dies is gone from Ray's registry of
named actors, and a restarted one gets a new name. Outside Ray it is ``proc:<host>:<pid>:<token>``;
only processes on this host can be checked, others count as alive (never charged by mistake).
"""

from __future__ import annotations

import os
import socket
import uuid

_TOKEN = uuid.uuid4().hex[:8]


def process_holder() -> str:
    """This process's name: its Ray actor when it is one, else host, pid and a per-start token."""
    try:
        import ray

        if ray.is_initialized():
            context = ray.get_runtime_context()
            name = context.get_actor_name()
            if name:
                return f"ray:{context.namespace}:{name}"
    except ImportError:  # pragma: no cover - ray is a dependency; the branch keeps this module Ray-free
        pass
    return f"proc:{socket.gethostname()}:{os.getpid()}:{_TOKEN}"


def holder_alive(holder: str) -> bool:
    """Whether the process named ``holder`` still runs (unknown: True)."""
    kind, _, rest = holder.partition(":")
    if kind == "ray":
        namespace, _, name = rest.partition(":")
        import ray

        try:
            ray.get_actor(name, namespace=namespace)
        except ValueError:
            return False
        return True
    if kind == "proc":
        host, _, pid_token = rest.partition(":")
        pid, _, token = pid_token.partition(":")
        if host != socket.gethostname() or not pid.isdigit():
            return True
        if int(pid) == os.getpid():
            return token == _TOKEN
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    return True
