"""The ports the stand-in and the workers of the tests are given."""

from __future__ import annotations

import socket

from sqsinfer.lab import standin


def _local_ends(count: int) -> set[int]:
    """The local ports of `count` connections made now (the kernel's ephemeral range)."""
    with socket.create_server(("127.0.0.1", 0), backlog=count) as server:
        clients = [socket.create_connection(server.getsockname()) for _ in range(count)]
        ends = {c.getsockname()[1] for c in clients}
        for c in clients:
            c.close()
    return ends


def test_a_free_port_is_one_no_outgoing_connection_can_take():
    ports = {standin.free_port() for _ in range(50)}
    ends = _local_ends(200)
    assert max(ports) < min(ends), (sorted(ports)[-3:], sorted(ends)[:3])
    for port in ports:  # and each is free: a server can bind it
        with socket.create_server(("127.0.0.1", port)):
            pass
