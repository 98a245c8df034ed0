"""A TCP proxy that can stall: in front of a store (a moto S3 server, say) it forwards every
connection, or, once :meth:`StallProxy.stall` is called, accepts new connections and never
answers them (and freezes the ones open: no byte goes either way), the way a hung object
store or a dead load balancer looks to a client. :meth:`StallProxy.forward` ends the stall for
new connections; the frozen ones stay frozen until the client gives up on them (its read
timeout), as they would with a real store that lost them.

The listening socket belongs to the network namespace of the thread that calls
:meth:`StallProxy.start`; the upstream connections are made from the proxy's own threads,
which inherit that namespace, so the upstream must be reachable from it.
"""

from __future__ import annotations

import contextlib
import socket
import threading

__all__ = ["StallProxy"]


class StallProxy:
    def __init__(self, upstream: tuple[str, int], host: str = "127.0.0.1", port: int = 0) -> None:
        self.upstream = upstream
        self.host = host
        self.port = port
        self._stalled = threading.Event()
        self._closed = threading.Event()
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []
        self._listener: socket.socket | None = None
        self._thread: threading.Thread | None = None
        # Connections accepted while stalled (never answered) and forwarded.
        self.held = 0
        self.forwarded = 0

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def stalled(self) -> bool:
        return self._stalled.is_set()

    def start(self) -> StallProxy:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((self.host, self.port))
        listener.listen(128)
        self.port = listener.getsockname()[1]
        self._listener = listener
        self._thread = threading.Thread(target=self._accept, daemon=True, name="stall-proxy")
        self._thread.start()
        return self

    def stall(self) -> None:
        self._stalled.set()

    def forward(self) -> None:
        self._stalled.clear()

    def close(self) -> None:
        self._closed.set()
        if self._listener is not None:
            with contextlib.suppress(OSError):
                self._listener.close()
        with self._lock:
            sockets, self._sockets = self._sockets, []
        for sock in sockets:
            with contextlib.suppress(OSError):
                sock.close()
        if self._thread is not None:
            self._thread.join(5)

    def __enter__(self) -> StallProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _keep(self, sock: socket.socket) -> None:
        with self._lock:
            self._sockets.append(sock)

    def _accept(self) -> None:
        assert self._listener is not None
        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            self._keep(client)
            if self._stalled.is_set():
                self.held += 1  # accepted, never read from or answered
                continue
            self.forwarded += 1
            threading.Thread(target=self._pipe_pair, args=(client,), daemon=True).start()

    def _pipe_pair(self, client: socket.socket) -> None:
        try:
            upstream = socket.create_connection(self.upstream, timeout=5)
        except OSError:
            with contextlib.suppress(OSError):
                client.close()
            return
        upstream.settimeout(None)
        self._keep(upstream)
        for src, dst in ((client, upstream), (upstream, client)):
            threading.Thread(target=self._pipe, args=(src, dst), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while not self._closed.is_set():
                data = src.recv(65536)
                if not data:
                    break
                while self._stalled.is_set() and not self._closed.is_set():
                    # Frozen: hold the bytes until the stall ends or the proxy closes.
                    self._closed.wait(0.05)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            with contextlib.suppress(OSError):
                dst.shutdown(socket.SHUT_WR)
