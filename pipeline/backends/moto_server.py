"""The embedded moto server the `emulated` backend (and the tests) send AWS requests to (`serve`),
with two patches to moto: S3's conditional create made atomic as S3's own is
(`_atomic_conditional_puts`), and moto's host -> service lookup kept per host
(`_backend_lookup_kept`).
"""

from __future__ import annotations

import functools
import logging
import socket
import threading

_CONDITIONAL_PUT = threading.Lock()


def _atomic_conditional_puts() -> None:
    """Serialize moto's PutObject handler where it carries a precondition (once per process).

    S3 checks `If-None-Match: *` "for the existence of an object during the WRITE operation"
    (S3 User Guide, conditional-writes.html): of two creates of one key, exactly one succeeds.
    moto 5 checks and then stores in two steps of a threaded server, so two creates racing on
    one key could both succeed (two drivers claimed one run_num in CI)."""
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


def _backend_lookup_kept() -> None:
    """Keep moto's host -> service lookup per dispatcher and host (once per process). moto's
    server looks the service up anew on every request: it lists moto's package folder and stats
    each of its subfolders, one a service (moto/backends.py `list_of_moto_modules`, from
    `DomainDispatcherApplication.get_backend_for_host`), under a lock every request takes. The
    answer depends on the host alone."""
    from moto.moto_server.werkzeug_app import DomainDispatcherApplication

    lookup = DomainDispatcherApplication.get_backend_for_host
    if getattr(lookup, "smpipe_kept", False):
        return

    @functools.wraps(lookup)
    def kept(self, host):
        answers = self.__dict__.setdefault("smpipe_backends", {})
        if host not in answers:
            answers[host] = lookup(self, host)
        return answers[host]

    kept.smpipe_kept = True
    DomainDispatcherApplication.get_backend_for_host = kept


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve():
    """A started moto server on a free local port of 127.0.0.1; returns (server, endpoint)."""
    from moto.server import ThreadedMotoServer

    _atomic_conditional_puts()
    _backend_lookup_kept()
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # a line per request otherwise
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    return server, f"http://127.0.0.1:{port}"
