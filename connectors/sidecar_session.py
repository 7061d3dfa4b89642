"""A connector's link to the sidecar: one client, one namespace registered on demand, and the
sidecar's availability logged once per change rather than once per call. Shared by the engine's
``SidecarConnector`` and LMCache's plugin (``connectors.lmcache``).

``call(fn)`` registers the namespace first if needed and once more after a ``NOT_FOUND`` (a
restarted sidecar has forgotten it), then runs ``fn`` again. Failures propagate: the connector
decides that they are misses. A sidecar found not answering (``UNAVAILABLE``, or a call past its
deadline: a hung sidecar) is skipped for a back-off window (``connectors.backoff``): ``call``
raises ``SidecarNotAnswering`` at once instead of each call waiting out its timeout. Thread-safe
(``KVStoreClient`` is; registering twice is harmless).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TypeVar

import grpc

from connectors.backoff import Backoff
from kvstore.keys import Namespace
from kvstore.service.client import KVStoreClient

log = logging.getLogger(__name__)
T = TypeVar("T")
NOT_ANSWERING = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


class SidecarNotAnswering(RuntimeError):
    """A call skipped without trying: the sidecar stopped answering and its back-off window is open."""


class SidecarSession:
    """``meanwhile`` finishes the warning logged when the sidecar stops answering (what the caller
    does without it, e.g. "LMCache sees misses")."""

    def __init__(self, client: KVStoreClient, namespace: Namespace, target: str,
                 meanwhile: str = "callers see misses", backoff: Backoff | None = None):
        self.client = client
        self.namespace = namespace
        self.ns_id = namespace.id  # the sidecar's id of a namespace is its content hash
        self.target = target
        self.meanwhile = meanwhile
        self.backoff = backoff or Backoff()
        self._registered = False
        self._available = True

    def call(self, fn: Callable[[], T], timeout_s: float | None = None, needs_namespace: bool = True) -> T:
        """``fn()`` unless the sidecar is being skipped. ``timeout_s`` bounds the namespace's
        registration when one is due (else the client's timeout). ``needs_namespace=False``: a
        call that neither registers first nor means "namespace unknown" by ``NOT_FOUND``."""
        if not self.backoff.allow():
            raise SidecarNotAnswering(f"skipped: the sidecar stopped answering; next try in "
                                      f"{self.backoff.retry_in_s():.1f} s")
        try:
            result = self._call_registered(fn, timeout_s) if needs_namespace else fn()
        except grpc.RpcError as exc:
            if exc.code() in NOT_ANSWERING:
                self.backoff.not_answering()
            else:
                self.backoff.answered()
            raise
        except BaseException:
            self.backoff.answered()  # not a sign of a hung sidecar; a probe must not stay taken
            raise
        self.backoff.answered()
        if not self._available:
            log.info("the kvstore sidecar %s answers again", self.target)
            self._available = True
        return result

    def register(self, timeout_s: float | None = None) -> None:
        """Register the namespace now (idempotent on the sidecar); raises what the call raises."""
        ns_id = self.client.register_namespace(self.namespace, timeout_s)
        if ns_id != self.ns_id:
            raise RuntimeError(f"the sidecar registered {self.namespace.model} as {ns_id.hex()}, "
                               f"expected {self.ns_id.hex()}: it fingerprints namespaces differently")
        self._registered = True

    def failed(self, what: str, exc: Exception) -> None:
        """Log a failed call: a warning when the sidecar was answering until now, else at debug level."""
        if isinstance(exc, grpc.RpcError) and exc.code() == grpc.StatusCode.UNAVAILABLE:
            self._registered = False  # it may come back as a new process
        if self._available:
            log.warning("kvstore sidecar %s: cannot %s (%s); %s until it answers",
                        self.target, what, describe(exc), self.meanwhile)
            self._available = False
        else:
            log.debug("kvstore sidecar %s: cannot %s (%s)", self.target, what, describe(exc))

    def _call_registered(self, fn: Callable[[], T], timeout_s: float | None) -> T:
        self._ensure_registered(timeout_s)
        try:
            return fn()
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.NOT_FOUND:
                raise
            self._registered = False
            self._ensure_registered(timeout_s)
            return fn()

    def _ensure_registered(self, timeout_s: float | None = None) -> None:
        if not self._registered:
            self.register(timeout_s)


def describe(exc: Exception) -> str:
    if isinstance(exc, grpc.RpcError):
        return f"{exc.code().name}: {exc.details()}"
    return str(exc) or type(exc).__name__
