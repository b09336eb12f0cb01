"""A unix socket in front of the Docker engine's that a test can cut: the engine goes away for the study without
stopping the machine's shared dockerd."""

from __future__ import annotations

import contextlib
import socket
import threading
from pathlib import Path


class EngineProxy:
    """Forwards every connection on `path` to `upstream`. `cut(refuse)` drops the open connections and refuses the
    next `refuse` ones (accepted, then closed: the SDK sees the engine gone); then it forwards again."""

    def __init__(self, path: Path, upstream: str = "/var/run/docker.sock") -> None:
        self.path = path
        self.upstream = upstream
        self.refuse = 0
        self.refused = 0
        self.accepted = 0  # connections forwarded so far
        self._open: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(str(path))
        self._listener.listen(64)
        threading.Thread(target=self._accept, name="engine-proxy", daemon=True).start()

    @property
    def url(self) -> str:
        return f"unix://{self.path}"

    def cut(self, refuse: int) -> None:
        with self._lock:
            self.refuse = refuse
            for s in self._open:
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self._listener.close()
        self.cut(0)

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return  # closed
            with self._lock:
                refusing = self.refuse > 0
                if refusing:
                    self.refuse -= 1
                    self.refused += 1
            if refusing:
                client.close()
                continue
            engine = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            engine.connect(self.upstream)
            with self._lock:
                self._open |= {client, engine}
                self.accepted += 1
            for a, b in ((client, engine), (engine, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for s in (source, sink):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
            with self._lock:
                self._open.discard(source)
            source.close()
