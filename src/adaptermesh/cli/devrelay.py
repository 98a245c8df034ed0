"""The dev mesh's mark relay: where the classifier's mark becomes a shard's Envoy.

In a cluster a mark-steered packet meets a policy route to its shard's node. On one machine
every shard's Envoy listens on 127.0.0.1 with a port of its own (8080 + I), and a mark cannot
change a port. So ``adaptermesh dev up`` listens on the node end of its veth pair
(``10.213.0.1:8080``), with ``net.ipv4.tcp_fwmark_accept`` on: an accepted connection keeps
the mark the classifier put on its SYN, and the relay forwards it to the Envoy of the shard
that mark names (``257 + I``: ``127.0.0.1:8080 + I``). The decision stays the classifier's:
a pin or an override changes which Envoy answers (its responses say so in
``x-adaptermesh-served-by``). Requests come from the client namespace
(``adaptermesh dev exec -- curl ...``), so they cross the veth and the classifier.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
from collections.abc import Callable

__all__ = ["SO_MARK", "MarkRelay", "shard_for_mark"]

_log = logging.getLogger(__name__)

SO_MARK = getattr(socket, "SO_MARK", 36)  # Linux's value; Python exposes it from 3.12


def shard_for_mark(mark: int, first_mark: int, shards: int) -> int | None:
    """The shard index a classifier mark names (``first_mark + I``), None for any other."""
    index = mark - first_mark
    return index if 0 <= index < shards else None


def _pipe(src: socket.socket, dst: socket.socket) -> None:
    try:
        while data := src.recv(65536):
            dst.sendall(data)
    except OSError:
        pass
    finally:
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)


class MarkRelay:
    """Accepts on ``listen`` and forwards each connection to ``upstream(mark)``; a connection
    whose mark names no shard (it bypassed the classifier) is closed at once."""

    def __init__(
        self, listen: tuple[str, int], upstream: Callable[[int], tuple[str, int] | None]
    ) -> None:
        self._listen = listen
        self._upstream = upstream
        self._sock: socket.socket | None = None
        self._stop = threading.Event()
        self.unmarked = 0  # connections refused: no shard's mark

    def start(self) -> None:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(self._listen)
        sock.listen(64)
        sock.settimeout(0.5)
        self._sock = sock
        threading.Thread(target=self._accept, name="dev-relay", daemon=True).start()

    def _accept(self) -> None:
        assert self._sock is not None
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            conn.settimeout(None)
            target = self._upstream(conn.getsockopt(socket.SOL_SOCKET, SO_MARK))
            if target is None:
                self.unmarked += 1
                return
            try:
                upstream = socket.create_connection(target, timeout=5)
            except OSError as exc:
                _log.warning("relay: %s:%d: %s", *target, exc)
                return
            with upstream:
                upstream.settimeout(None)
                back = threading.Thread(target=_pipe, args=(upstream, conn), daemon=True)
                back.start()
                _pipe(conn, upstream)
                back.join()

    def close(self) -> None:
        self._stop.set()
        if self._sock is not None:
            self._sock.close()
