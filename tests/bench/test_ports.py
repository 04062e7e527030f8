"""Ports for servers the tests start come from outside the kernel's ephemeral range, so a server
that binds seconds later does not find its port taken by someone's outgoing connection."""

import socket

from bench import ports


def test_free_ports_are_below_the_ephemeral_range_and_above_rays_worker_ports():
    start = ports._ephemeral_start()
    chosen = [ports.free_port() for _ in range(50)]
    assert all(ports.RAY_WORKER_PORTS_END <= p < start for p in chosen)
    assert len(set(chosen)) == len(chosen)  # never the same port twice in one process


def test_a_port_someone_listens_on_is_not_chosen(monkeypatch):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        picks = iter([busy, busy, 23456])
        monkeypatch.setattr(ports.random, "randrange", lambda low, high: next(picks))
        monkeypatch.setattr(ports, "_used", set())
        monkeypatch.setattr(ports, "_ephemeral_start", lambda: 60000)
        assert ports.free_port() == 23456
