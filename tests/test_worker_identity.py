"""What a worker process makes its own after a fork: the name every record of its attempts carries
(``host:pid``), and its start left out of garbage collections."""

from __future__ import annotations

import gc
import os
import select
import signal
import socket
from pathlib import Path

from celery.signals import worker_process_init

from tasks import Settings, create_app
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


def test_a_pool_child_leaves_what_its_start_made_out_of_collections(tmp_path: Path) -> None:
    """A full garbage collection walks every object a process tracks, and the task in that process waits
    it out: a pool child freezes what it made until it takes tasks (gc.freeze), the clients it built for
    itself included, once Celery's worker_process_init reaches it, as it does in a forked prefork child."""
    database = f"sqlite:///{tmp_path / 'child.db'}"
    settings = Settings.from_env(
        {"RESERVATIONS_DATABASE_URL": database, "RESERVATIONS_BROKER_URL": f"sqla+{database}"}
    )
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: start as a pool child does, report what is frozen, leave without cleanup
        os.close(read)
        try:
            create_app(settings).set_current()
            frozen_before = gc.get_freeze_count()
            worker_process_init.send(sender=None)
            os.write(write, f"{frozen_before} {gc.get_freeze_count()}".encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        # A child forked from a process with threads can hang on a lock one of them held: not forever.
        if not select.select([pipe], [], [], 60)[0]:
            os.kill(pid, signal.SIGKILL)
        reported = pipe.read().decode()
    os.waitpid(pid, 0)
    assert reported, "the child reported nothing within 60 s"
    before, after = (int(count) for count in reported.split())
    assert before == 0
    assert after > 10_000  # Celery, kombu, SQLAlchemy and the child's clients
    assert gc.get_freeze_count() == 0  # the parent's own objects are its business
