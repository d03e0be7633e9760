import socket

import pytest

from tritonlm import ports


def _bindable(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("0.0.0.0", port))
            return True
        except OSError:
            return False


def test_free_ports_are_distinct_bindable_and_below_the_ephemeral_range():
    low = ports._ephemeral_low()
    if low - ports.LOWEST_PORT < 100:
        pytest.skip(f"this host's ephemeral range starts at {low}")
    picked = ports.free_ports(5)
    assert len(set(picked)) == 5
    assert all(ports.LOWEST_PORT <= port < low for port in picked)
    assert all(_bindable(port) for port in picked)


def test_free_ports_skip_a_port_something_listens_on(monkeypatch):
    with socket.socket() as listener:
        listener.bind(("0.0.0.0", ports.free_ports(1)[0]))
        listener.listen()
        taken = listener.getsockname()[1]
        monkeypatch.setattr(ports, "LOWEST_PORT", taken)
        monkeypatch.setattr(ports, "_ephemeral_low", lambda: taken + 1)
        (picked,) = ports.free_ports(1)  # the only candidate is taken: the kernel picks
        assert picked != taken and _bindable(picked)


def test_without_room_below_the_ephemeral_range_the_kernel_picks(tmp_path, monkeypatch):
    range_file = tmp_path / "ip_local_port_range"
    range_file.write_text("1024\t65535\n")
    monkeypatch.setattr(ports, "EPHEMERAL_RANGE_FILE", range_file)
    picked = ports.free_ports(2)
    assert len(set(picked)) == 2 and all(_bindable(port) for port in picked)
