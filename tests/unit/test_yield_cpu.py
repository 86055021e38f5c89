"""pipeline/serve/resources.py ``yield_cpu``: every thread of the process is niced, whichever thread
asks (a Ray actor's __init__ runs on a thread of its own), in a child process so this one keeps its
priority."""

from __future__ import annotations

import subprocess
import sys

CHILD = """
import os, threading
from pipeline.serve.resources import yield_cpu

def nice_of(tid):
    return int(open(f"/proc/self/task/{tid}/stat").read().rsplit(")", 1)[1].split()[16])

idle = threading.Event()
other = threading.Thread(target=idle.wait)
other.start()
asker = threading.Thread(target=yield_cpu, args=(7,))
asker.start()
asker.join()
later = []
spawned = threading.Thread(target=lambda: later.append(nice_of(threading.get_native_id())))
spawned.start()
spawned.join()
print(sorted({nice_of(t) for t in os.listdir("/proc/self/task")}), later)
idle.set()
"""


def test_every_thread_is_niced_whichever_thread_asks() -> None:
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=60, check=True)
    base = int(subprocess.run(["sh", "-c", "nice"], capture_output=True, text=True, check=True).stdout)
    niced = min(19, base + 7)
    assert out.stdout.split() == [f"[{niced}]", f"[{niced}]"], out.stdout
