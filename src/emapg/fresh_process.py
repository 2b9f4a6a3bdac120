"""A worker in a fresh interpreter, joined by a socket: what the reward scorer and the
retriever server run user code and searches in.

Not fork: forking a process with torch's (or any) threads running can deadlock the child. Not
multiprocessing's spawn: it re-runs the user's main script. And `-c` importing the entry point,
not `-m module`: `-m` runs a second copy of a module that emapg has already imported, with a
RuntimeWarning on stderr at every start.
"""

from __future__ import annotations

import pickle
import socket
import subprocess
import sys
from multiprocessing.connection import Connection


def start(entry: str, payload: bytes) -> tuple[subprocess.Popen, Connection]:
    """Start `python -c "from <module> import <function>; <function>(fd)"` for `entry`
    ("module:function"), the function taking the file descriptor of its end of the socket
    (and calling `accept`), and send it this sys.path and `payload` (pickled)."""
    module, function = entry.split(":")
    ours, theirs = socket.socketpair()
    code = f"import sys; from {module} import {function}; {function}(int(sys.argv[1]))"
    process = subprocess.Popen(
        [sys.executable, "-c", code, str(theirs.fileno())],
        pass_fds=[theirs.fileno()],
        stdin=subprocess.DEVNULL,
    )
    theirs.close()
    conn = Connection(ours.detach())
    conn.send((sys.path, payload))
    return process, conn


def accept(fd: int) -> tuple[Connection, object] | None:
    """In the worker: its connection and the unpickled payload, after replying "ready"; or None
    after replying what stopped the payload from loading. sys.path is the parent's first, so
    the user's modules the payload names import as they did there."""
    conn = Connection(fd)
    path, payload = conn.recv()
    sys.path[:] = path
    try:
        loaded = pickle.loads(payload)
    except Exception as e:
        conn.send(f"{type(e).__name__}: {e}")
        return None
    conn.send("ready")
    return conn, loaded
