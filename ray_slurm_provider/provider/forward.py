"""Local port forwarding for `ray dashboard` and `ray exec -p`, without SSH.

The head binds its dashboard on the node's own address, so the login node can connect to it
directly; this module just listens on localhost and relays each connection there.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterable


def _pipe(src: socket.socket, dst: socket.socket) -> None:
    try:
        while data := src.recv(65536):
            dst.sendall(data)
    except OSError:
        pass
    finally:
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


class Forwarder:
    """Relay 127.0.0.1:local -> host:remote until stopped."""

    def __init__(self, local_port: int, host: str, remote_port: int) -> None:
        self.host = host
        self.remote_port = remote_port
        self.sock = socket.create_server(("127.0.0.1", local_port), reuse_port=False)
        self.local_port = self.sock.getsockname()[1]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        self.sock.settimeout(0.5)
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            try:
                up = socket.create_connection((self.host, self.remote_port), timeout=10)
            except OSError:
                conn.close()
                continue
            up.settimeout(None)
            for a, b in ((conn, up), (up, conn)):
                threading.Thread(target=_pipe, args=(a, b), daemon=True).start()

    def stop(self) -> None:
        self._stop.set()
        self.sock.close()


def targets(pairs: Iterable[tuple[int, int]], host: str,
            remap: dict[int, int]) -> list[tuple[int, str, int]]:
    """(local port, host, remote port) per (local, remote) pair; `remap` translates Ray's
    default remote ports (8265) into this cluster's."""
    return [(int(lp), host, remap.get(int(rp), int(rp))) for lp, rp in pairs]


def forward_all(pairs: Iterable[tuple[int, int]], host: str, remap: dict[int, int]) -> list[
    Forwarder
]:
    """Start one forwarder per `targets` entry."""
    return [Forwarder(lp, h, rp) for lp, h, rp in targets(pairs, host, remap)]
