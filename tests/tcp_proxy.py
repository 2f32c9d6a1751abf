"""A loopback TCP proxy for fault tests: put it in front of the moto server and make the network misbehave.

    proxy = FaultProxy(("127.0.0.1", moto_port)).start()
    endpoint = proxy.url                 # http://127.0.0.1:<proxy port>
    proxy.mode = "stall"                 # every connection, open or new, stops forwarding bytes
    proxy.mode = "reset"                 # new connections (and open ones at their next byte) are reset (RST)
    proxy.mode = "slow"                  # bytes flow, `slow_chunk` bytes every `slow_delay_s` seconds
    proxy.mode = "pass"                  # normal forwarding again
    proxy.reset_next(2)                  # the next 2 connection events (accepts or chunks) are reset, then pass
    proxy.stop()

Each accepted connection gets one thread that copies bytes both ways; the
mode is read at every chunk, so switching it affects connections already
open (a stalled request stays stalled until the mode changes or the client
gives up). `connections` counts accepted connections (tests use it to see
retries).
"""
from __future__ import annotations

import select
import socket
import struct
import threading
import time
from typing import Optional

MODES = ("pass", "stall", "reset", "slow")


class FaultProxy:
    """A threaded TCP proxy on 127.0.0.1 whose `mode` (pass | stall | reset | slow) can change at any time."""

    def __init__(self, upstream: tuple[str, int], *, slow_chunk: int = 1024, slow_delay_s: float = 0.05) -> None:
        self.upstream = upstream
        self.mode = "pass"
        self.slow_chunk = slow_chunk
        self.slow_delay_s = slow_delay_s
        self.connections = 0
        self.resets = 0
        self._to_reset = 0
        self._server: Optional[socket.socket] = None
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._socks: set[socket.socket] = set()
        self._lock = threading.Lock()

    @property
    def port(self) -> int:
        assert self._server is not None, "start() first"
        return self._server.getsockname()[1]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def reset_next(self, n: int) -> None:
        """Reset the next `n` connection events (a new connection, or the next chunk of an open one)."""
        with self._lock:
            self._to_reset = n

    def _take_reset(self) -> bool:
        if self.mode == "reset":
            return True
        with self._lock:
            if self._to_reset > 0:
                self._to_reset -= 1
                self.resets += 1
                return True
        return False

    def start(self) -> "FaultProxy":
        srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        srv.bind(("127.0.0.1", 0))
        srv.listen(64)
        srv.settimeout(0.1)
        self._server = srv
        t = threading.Thread(target=self._accept_loop, name="fault-proxy", daemon=True)
        t.start()
        self._threads.append(t)
        return self

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=2)
        with self._lock:
            for s in list(self._socks):
                _close(s)
        if self._server is not None:
            self._server.close()

    def __enter__(self) -> "FaultProxy":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # ------------------------------------------------------------ internals
    def _accept_loop(self) -> None:
        assert self._server is not None
        while not self._stop.is_set():
            try:
                client, _ = self._server.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            self.connections += 1
            if self._take_reset():
                _reset(client)
                continue
            try:
                upstream = socket.create_connection(self.upstream, timeout=5)
            except OSError:
                _reset(client)
                continue
            with self._lock:
                self._socks.update((client, upstream))
            t = threading.Thread(target=self._pipe, args=(client, upstream), daemon=True)
            t.start()
            self._threads = [x for x in self._threads if x.is_alive()] + [t]

    def _pipe(self, client: socket.socket, upstream: socket.socket) -> None:
        peer = {client: upstream, upstream: client}
        try:
            while not self._stop.is_set():
                if self.mode == "stall":
                    time.sleep(0.02)  # hold the connection open, forward nothing
                    continue
                ready, _, _ = select.select([client, upstream], [], [], 0.05)
                for src in ready:
                    if self._take_reset():
                        _reset(client)
                        return
                    n = self.slow_chunk if self.mode == "slow" else 65536
                    data = src.recv(n)
                    if not data:
                        return
                    if self.mode == "slow":
                        time.sleep(self.slow_delay_s)
                    peer[src].sendall(data)
        except OSError:
            return
        finally:
            with self._lock:
                self._socks.discard(client)
                self._socks.discard(upstream)
            _close(client)
            _close(upstream)


def _reset(sock: socket.socket) -> None:
    """Close with an RST instead of a FIN (SO_LINGER with a zero timeout)."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass
    _close(sock)


def _close(sock: socket.socket) -> None:
    try:
        sock.close()
    except OSError:
        pass
