"""The embedded moto server the `emulated` backend (and the tests) send AWS requests to, with
S3's conditional create made atomic as S3's own is.

S3 checks `If-None-Match: *` "for the existence of an object during the WRITE operation"
(S3 User Guide, conditional-writes.html): of two creates of one key, exactly one succeeds.
moto 5 checks and then stores in two steps of a threaded server, so two creates racing on one
key could both succeed: two drivers claimed one run_num in CI. Every conditional put here is
made one step, by a lock around moto's put-object handler.
"""

from __future__ import annotations

import functools
import logging
import socket
import threading

_CONDITIONAL_PUT = threading.Lock()


def _atomic_conditional_puts() -> None:
    """Serialize moto's PutObject handler where it carries a precondition (once per process)."""
    from moto.s3.responses import S3Response

    put = S3Response.put_object
    if getattr(put, "smpipe_atomic", False):
        return

    @functools.wraps(put)
    def atomic_put(self, *args, **kwargs):
        if self.headers.get("If-None-Match") is None and self.headers.get("If-Match") is None:
            return put(self, *args, **kwargs)
        with _CONDITIONAL_PUT:
            return put(self, *args, **kwargs)

    atomic_put.smpipe_atomic = True
    S3Response.put_object = atomic_put


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve():
    """A started moto server on a free local port of 127.0.0.1; returns (server, endpoint)."""
    from moto.server import ThreadedMotoServer

    _atomic_conditional_puts()
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # a line per request otherwise
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    return server, f"http://127.0.0.1:{port}"
