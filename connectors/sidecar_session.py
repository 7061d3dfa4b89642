"""A connector's link to the sidecar: one client, one namespace registered on demand, and the
sidecar's availability logged once per change rather than once per call. Shared by the engine's
``SidecarConnector`` and LMCache's plugin (``connectors.lmcache``).

``call(fn)`` registers the namespace first if needed and once more after a ``NOT_FOUND`` (a
restarted sidecar has forgotten it), then runs ``fn`` again. Failures propagate: the connector
decides that they are misses, and ``failed`` logs them, telling a sidecar that stopped answering
from one that refused a call (a limit, a malformed request) while answering. A sidecar found not answering (``UNAVAILABLE``, or a call past its
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
from kvstore.layout import BlockSpec
from kvstore.service.client import KVStoreClient

log = logging.getLogger(__name__)
T = TypeVar("T")
NOT_ANSWERING = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


class SidecarNotAnswering(RuntimeError):
    """A call skipped without trying: the sidecar stopped answering and its back-off window is open."""


class SidecarSession:
    """``meanwhile`` finishes the warning logged when the sidecar stops answering (what the caller
    does without it, e.g. "LMCache sees misses"). ``spec``: the caller's layout of the namespace's
    blocks (None: ``BlockSpec.of(namespace)``), which the sidecar's must equal."""

    def __init__(self, client: KVStoreClient, namespace: Namespace, target: str,
                 meanwhile: str = "callers see misses", backoff: Backoff | None = None,
                 spec: BlockSpec | None = None):
        self.client = client
        self.namespace = namespace
        self.ns_id = namespace.id  # the sidecar's id of a namespace is its content hash
        self.spec = spec or BlockSpec.of(namespace)
        self.target = target
        self.meanwhile = meanwhile
        self.backoff = backoff or Backoff()
        self._registered = False
        self._available = True
        self._refusals: set[tuple[str, object]] = set()  # (what, status code or exception type) logged once

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
        """Register the namespace now (idempotent on the sidecar); raises what the call raises, and
        ``RuntimeError`` when the sidecar names or lays out its blocks otherwise than this side
        (a client and a sidecar of different versions): the namespace stays unregistered, so every
        call that needs it fails (a miss) rather than move blocks of another layout."""
        registration = self.client.register(self.namespace, timeout_s)
        if registration.namespace_id != self.ns_id:
            raise RuntimeError(f"the sidecar registered {self.namespace.model} as {registration.namespace_id.hex()}, "
                               f"expected {self.ns_id.hex()}: it fingerprints namespaces differently")
        if not registration.matches(self.spec):
            raise RuntimeError(
                f"the sidecar lays out blocks of {self.namespace.model} as {registration.num_layers} layers of "
                f"{registration.layer_bytes} bytes ({registration.block_bytes} bytes, {registration.block_size} "
                f"tokens a block), this side as {self.spec.num_layers} layers of {self.spec.layer_bytes} bytes "
                f"({self.spec.block_bytes} bytes, {self.spec.block_size} tokens): the client and the sidecar are "
                "of different versions; run the same kvstore release on both")
        self._registered = True

    def failed(self, what: str, exc: Exception) -> None:
        """Log a failed call. A sidecar that stopped answering: a warning when it was answering
        until now, else at debug level. A call it answered with an error (a limit, a malformed
        request) says so: a warning the first time such a call fails that way, then debug level;
        the sidecar still counts as answering."""
        if not_answering(exc):
            self._not_answering(what, exc)
            return
        kind = (what, exc.code() if isinstance(exc, grpc.RpcError) else type(exc))
        if kind in self._refusals:
            log.debug("kvstore sidecar %s: cannot %s (%s)", self.target, what, describe(exc))
            return
        self._refusals.add(kind)
        refused = isinstance(exc, grpc.RpcError)
        head = f"kvstore sidecar {self.target} refused to {what}" if refused else \
            f"kvstore sidecar {self.target}: cannot {what}"
        log.warning("%s (%s); such calls are misses (more like it are logged at debug level)", head, describe(exc))

    def _not_answering(self, what: str, exc: Exception) -> None:
        if isinstance(exc, grpc.RpcError) and exc.code() == grpc.StatusCode.UNAVAILABLE:
            self._registered = False  # it may come back as a new process
        for path in self.client.drop_unlinked_segments():  # a successor unlinked them: free their memory for it
            log.info("kvstore sidecar %s: unmapped %s, removed since it was mapped", self.target, path)
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


def not_answering(exc: Exception) -> bool:
    """True for a call skipped in a back-off window, refused a connection, or past its deadline."""
    return isinstance(exc, SidecarNotAnswering) or (isinstance(exc, grpc.RpcError) and exc.code() in NOT_ANSWERING)


def describe(exc: Exception) -> str:
    if isinstance(exc, grpc.RpcError):
        return f"{exc.code().name}: {exc.details()}"
    return str(exc) or type(exc).__name__
