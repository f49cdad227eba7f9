"""engine.rollout.sglang_forkserver's client side, without a server: ``ForkedServerProcess`` reports
the exit status the forkserver sends, to every thread that polls it (an engine polls its servers
from several)."""
from __future__ import annotations

import os
import select
import socket
import threading

from engine.rollout.sglang_forkserver import ForkedServerProcess


def test_a_poll_that_waited_while_another_read_the_status_reports_that_status(monkeypatch):
    """The race a loaded run hit: one poller reads the status and closes the connection while a
    second is between choosing what to watch and watching it. That second poll must report the
    status read, not take the closed connection for the forkserver's end (exit status -1)."""
    ours, forkserver_side = socket.socketpair()
    process = ForkedServerProcess(ours, os.getpid(), ["server"])  # this process stands in for the server
    real_select = select.select
    first_done, second_watching = threading.Event(), threading.Event()

    def select_after_the_first_poll(readers, writers, errors, timeout):
        if threading.current_thread().name == "second":
            second_watching.set()
            first_done.wait(timeout=2)  # without the client's lock the first poll finishes meanwhile
        return real_select(readers, writers, errors, timeout)

    monkeypatch.setattr(select, "select", select_after_the_first_poll)
    forkserver_side.sendall(b'{"exit": -9}\n')
    statuses, errors = {}, []

    def poll(name):
        try:
            statuses[name] = process.wait(timeout=10)
        except Exception as error:  # noqa: BLE001 - the test reports it
            errors.append(error)

    second = threading.Thread(target=poll, args=("second",), name="second")
    second.start()
    second_watching.wait(timeout=5)
    first = threading.Thread(target=poll, args=("first",), name="first")
    first.start()
    first.join(timeout=10)
    first_done.set()
    second.join(timeout=10)
    assert errors == [] and statuses == {"first": -9, "second": -9} and process.returncode == -9
    forkserver_side.close()
