"""Kills a Python backend stub once its tritonserver is gone (killed, crashed).

    python -m tritonlm.triton.stub_reaper SERVER_PID STUB_PID

The stub notices a dead server itself, but then destroys the model and calls exit() from its
heartbeat thread while the engine thread still computes: in CI that exit hung (the stub left
generating, reparented to init), and no thread inside the stub can end it once the GIL is held
for good. This process needs neither; it waits on both processes without polling and exits with
the stub.
"""
import logging
import os
import select
import signal
import sys

logger = logging.getLogger("tritonlm")


def reap(server_pid: int, stub_pid: int) -> None:
    try:
        stub = os.pidfd_open(stub_pid)
    except ProcessLookupError:
        return
    try:
        server = os.pidfd_open(server_pid)
    except ProcessLookupError:
        server = None
    if server is not None:
        poller = select.poll()
        for fd in (server, stub):
            poller.register(fd, select.POLLIN)
        if all(fd != server for fd, _ in poller.poll()):
            return  # the stub ended first
    logger.error("tritonserver (pid %d) is gone: killing its backend stub (pid %d)", server_pid,
                 stub_pid)
    signal.pidfd_send_signal(stub, signal.SIGKILL)


if __name__ == "__main__":
    logging.basicConfig(format="%(asctime)s %(levelname)s %(message)s")
    reap(*(int(pid) for pid in sys.argv[1:3]))
