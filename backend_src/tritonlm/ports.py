"""Free TCP ports for the listeners this project starts itself (a tritonserver for tests and the
bench, the tensor-parallel rendezvous).

A port the kernel hands out for a bind to port 0 comes from the ephemeral range, the range
every outgoing connection and every gloo pair socket draws from; between our probe and the real
bind, loading a tensor-parallel model can take it ("Socket '0.0.0.0:N' already in use"). Ports
below that range are only ever taken by an explicit bind, so they stay free once probed.
"""
import random
import socket
from pathlib import Path

EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
LOWEST_PORT = 10000  # below this lie the well-known and registered services
CANDIDATES = 200  # ports tried below the ephemeral range before the kernel picks


def _ephemeral_low() -> int:
    try:
        return int(EPHEMERAL_RANGE_FILE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def _bound(port: int) -> socket.socket | None:
    sock = socket.socket()
    try:
        sock.bind(("0.0.0.0", port))
        return sock
    except OSError:
        sock.close()
        return None


def free_ports(n: int) -> list[int]:
    """n distinct ports nothing listens on, outside the ephemeral range where it leaves room."""
    below = range(LOWEST_PORT, _ephemeral_low())
    # random, so that processes picking at once rarely pick alike
    candidates = random.Random().sample(below, min(len(below), CANDIDATES))
    held: list[socket.socket] = []
    try:
        for port in candidates:
            if len(held) == n:
                break
            if (sock := _bound(port)) is not None:
                held.append(sock)
        while len(held) < n:  # no room below the ephemeral range: let the kernel pick
            if (sock := _bound(0)) is None:
                raise OSError("no free TCP port")
            held.append(sock)
        return [sock.getsockname()[1] for sock in held]
    finally:
        for sock in held:
            sock.close()
