"""pipeline/serve/resources.py ``niced_while_starting``: inside the block every thread of the process
is niced, whichever thread asks (a Ray actor's __init__ runs on a thread of its own), threads started
inside too; after it every thread is back at the process's niceness. Where going back is not allowed
nothing is niced. Each case runs in a child process so this one keeps its priority."""

from __future__ import annotations

import subprocess
import sys

from pipeline.serve.resources import may_lower_niceness

CHILD = """
import os, sys, threading
from pipeline.serve import resources
from pipeline.serve.resources import niced_while_starting

if sys.argv[2] == "unprivileged":
    resources.may_lower_niceness = lambda to: False

def nice_of(tid):
    return int(open(f"/proc/self/task/{tid}/stat").read().rsplit(")", 1)[1].split()[16])

def all_nice():
    return sorted({nice_of(t) for t in os.listdir("/proc/self/task")})

idle = threading.Event()
other = threading.Thread(target=idle.wait)  # started before: niced and restored from another thread
other.start()
seen = {}

def start_replica():  # as Ray runs an actor's __init__: on a thread of its own
    with niced_while_starting(int(sys.argv[1])):
        seen["inside"] = all_nice()
        worker = threading.Thread(target=idle.wait)  # started while niced: inherits it, then restored
        worker.start()
        seen["worker"] = nice_of(worker.native_id)
    seen["after"] = all_nice()

asker = threading.Thread(target=start_replica)
asker.start()
asker.join()
later = []
spawned = threading.Thread(target=lambda: later.append(nice_of(threading.get_native_id())))
spawned.start()
spawned.join()
print(seen["inside"], seen["worker"], seen["after"], later)
idle.set()
"""


def run_child(increment: int, privilege: str = "as-is") -> list[str]:
    out = subprocess.run(
        [sys.executable, "-c", CHILD, str(increment), privilege], capture_output=True, text=True, timeout=60, check=True
    )
    return out.stdout.split()


def base_niceness() -> int:
    return int(subprocess.run(["sh", "-c", "nice"], capture_output=True, text=True, check=True).stdout)


def test_every_thread_is_niced_while_starting_and_back_after() -> None:
    base = base_niceness()
    # As this process may: the child is the same user with the same limits and capabilities.
    niced = min(19, base + 7) if may_lower_niceness(base) else base
    assert run_child(7) == [f"[{niced}]", f"{niced}", f"[{base}]", f"[{base}]"]


def test_where_going_back_is_not_allowed_nothing_is_niced() -> None:
    base = base_niceness()
    assert run_child(7, "unprivileged") == [f"[{base}]", f"{base}", f"[{base}]", f"[{base}]"]


def test_no_increment_leaves_every_thread_where_it_was() -> None:
    base = base_niceness()
    assert run_child(0) == [f"[{base}]", f"{base}", f"[{base}]", f"[{base}]"]
