"""The name every record of a worker process's attempts carries: ``host:pid``, its own in a forked child."""

from __future__ import annotations

import os
import socket

from tasks.worker import worker_identity


def test_names_this_host_and_process() -> None:
    assert worker_identity() == f"{socket.gethostname()}:{os.getpid()}"
    assert worker_identity() is worker_identity()  # kept, not asked of the kernel again


def test_a_forked_child_names_itself_not_its_parent() -> None:
    parent = worker_identity()  # kept in the parent before the fork, as a prefork pool's parent has it
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report its identity and leave without running the parent's cleanup
        os.close(read)
        os.write(write, worker_identity().encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        child = pipe.read().decode()
    os.waitpid(pid, 0)
    assert child == f"{socket.gethostname()}:{pid}"
    assert child != parent
