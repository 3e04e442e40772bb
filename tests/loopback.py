"""Loopback ports for the servers and process groups the tests start (JupyterLab, torchrun's rendezvous, the
stand-in and real serving engines)."""

import socket


def free_port() -> int:
    """A loopback port nothing listens on: bound by the OS, then closed (a server started next may take it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
