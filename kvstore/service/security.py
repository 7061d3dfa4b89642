"""Who may talk to the sidecar: loopback by default, a bearer token and TLS beyond it.

Policy (``check_exposure``), applied to both the gRPC and the HTTP address at start:

    unix:PATH, 127.0.0.0/8, ::1, localhost    open (the socket's file mode or the host is the boundary);
                                              a configured token is still required
    any other address                         refused unless a token is configured, and refused
                                              without TLS (cert + key) unless allow_plaintext is
                                              set (a trusted network namespace, e.g. inside one
                                              pod): a bearer token sent in plain text is anyone's

Mechanism: ``BearerAuthInterceptor`` checks ``authorization: Bearer TOKEN`` on every gRPC call
except the health service (probes carry no token) in constant time, and answers UNAUTHENTICATED
with a message that says what to send. ``load_token`` reads the token from a file (first line)
or takes it as given; an empty token is an error, not "no auth".
"""

from __future__ import annotations

import hmac
import ipaddress
import os
import ssl
from typing import Callable

import grpc

from kvstore.errors import InvalidRequest

HEALTH_METHOD_PREFIX = "/grpc.health.v1.Health/"
AUTH_METADATA = "authorization"


def is_local_address(address: str) -> bool:
    """True for ``unix:`` sockets and loopback hosts (``HOST:PORT``)."""
    if address.startswith("unix:"):
        return True
    host = address.rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name or a wildcard: reachable from elsewhere


def check_exposure(what: str, address: str, token: str | None, tls: bool, allow_plaintext: bool) -> None:
    """Raise ``InvalidRequest`` if listening on ``address`` would expose the store without auth."""
    if is_local_address(address):
        return
    if token is None:
        raise InvalidRequest(f"{what} {address!r} is reachable from other hosts: give a bearer token "
                             "(--token-file FILE or KVSTORE_TOKEN), or listen on loopback or a unix socket")
    if not tls and not allow_plaintext:
        raise InvalidRequest(f"{what} {address!r} is reachable from other hosts: give --tls-cert and --tls-key "
                             "(or --allow-plaintext inside a trusted network namespace only)")


def load_token(token: str | None = None, token_file: str | None = None) -> str | None:
    """The bearer token: ``token`` itself, else the first line of ``token_file``, else None."""
    if token_file:
        try:
            with open(token_file, encoding="utf-8") as f:
                token = f.readline().strip()
        except OSError as exc:
            raise InvalidRequest(f"cannot read the token file {token_file!r}: {exc.strerror}") from None
        if not token:
            raise InvalidRequest(f"the token file {token_file!r} is empty; put the token on its first line")
    if token is not None and not token.strip():
        raise InvalidRequest("the bearer token is empty; unset it to run without one")
    return token.strip() if token else None


def read_tls(cert_file: str | None, key_file: str | None) -> tuple[bytes, bytes] | None:
    """(certificate chain, private key) PEM bytes, or None when neither is given."""
    if not cert_file and not key_file:
        return None
    if not (cert_file and key_file):
        raise InvalidRequest("TLS needs both --tls-cert and --tls-key")
    try:
        with open(cert_file, "rb") as cert, open(key_file, "rb") as key:
            pair = cert.read(), key.read()
    except OSError as exc:
        raise InvalidRequest(f"cannot read TLS file {exc.filename!r}: {exc.strerror}") from None
    check_tls_pair(cert_file, key_file)
    return pair


def check_tls_pair(cert_file: str, key_file: str) -> None:
    """``InvalidRequest`` unless the files are a PEM certificate chain and its unencrypted private
    key. gRPC would fail to listen, and say only "is the port in use?"."""
    def encrypted() -> bytes:
        raise InvalidRequest(f"the TLS key {key_file!r} is encrypted: give an unencrypted one (openssl pkey "
                             "-in KEY -out PLAIN)")

    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(cert_file, key_file, password=encrypted)
    except ssl.SSLError as exc:
        raise InvalidRequest(f"the TLS certificate {cert_file!r} and key {key_file!r} are not a PEM certificate "
                             f"chain and its private key ({exc.reason or exc}): are they swapped, or of "
                             "different pairs?") from None


def server_credentials(tls: tuple[bytes, bytes]) -> grpc.ServerCredentials:
    return grpc.ssl_server_credentials([(tls[1], tls[0])])


def token_matches(presented: str | None, token: str) -> bool:
    """Constant-time comparison of an ``Authorization`` header value with ``Bearer TOKEN``; the
    scheme's case does not matter (RFC 9110: ``bearer TOKEN`` is the same)."""
    if presented is None:
        return False
    scheme, _, credentials = presented.partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(credentials.encode(), token.encode())


class BearerAuthInterceptor(grpc.aio.ServerInterceptor):
    """Every call but the health service's must carry ``authorization: Bearer TOKEN``.
    ``on_refused``, if given, hears the full method name (``/kvstore.v1.KVStore/Lookup``) of each
    call refused, before it is answered (the sidecar counts them in its metrics)."""

    def __init__(self, token: str, on_refused: Callable[[str], None] | None = None):
        self._token = token
        self._on_refused = on_refused

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(HEALTH_METHOD_PREFIX):
            return handler
        metadata = dict(handler_call_details.invocation_metadata or ())
        if token_matches(metadata.get(AUTH_METADATA), self._token):
            return handler
        if self._on_refused is not None:
            self._on_refused(handler_call_details.method)
        return _refusing(handler, handler_call_details.method)


def _refusing(handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
    """A handler of the same streaming kind as ``handler`` that answers UNAUTHENTICATED."""
    message = (f"{method} needs 'authorization: Bearer TOKEN' metadata with the sidecar's token "
               "(KVStoreClient(token=...) or KVSTORE_TOKEN)")

    async def refuse(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    kinds = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }
    make = kinds[(handler.request_streaming, handler.response_streaming)]
    if handler.response_streaming:
        async def refuse_stream(request, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
            yield  # pragma: no cover  (abort raises)
        return make(refuse_stream, request_deserializer=handler.request_deserializer,
                    response_serializer=handler.response_serializer)
    return make(refuse, request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer)


def token_from_env() -> tuple[str | None, str | None]:
    """(``KVSTORE_TOKEN``, ``KVSTORE_TOKEN_FILE``) from the environment."""
    return os.environ.get("KVSTORE_TOKEN"), os.environ.get("KVSTORE_TOKEN_FILE")
