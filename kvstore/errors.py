"""Typed errors for caller mistakes.

Three kinds of failure (STYLE.md): broken invariants are assertions; caller mistakes raise one of
these with a message that says what would be valid; misses and backpressure are return values,
never exceptions. The gRPC edge maps each class to a status code.
"""


class KVStoreError(Exception):
    """Base class of every error the store raises on purpose."""


class InvalidRequest(KVStoreError, ValueError):
    """The caller passed something malformed (wrong size, bad key, bad config)."""


class UnknownNamespace(KVStoreError, KeyError):
    """The namespace was never registered with this store."""

    def __str__(self) -> str:  # KeyError quotes its argument; keep the message readable
        return str(self.args[0]) if self.args else "unknown namespace"


class UnknownLease(KVStoreError, KeyError):
    """The lease id was never issued, already released, or expired."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "unknown lease"


class StoreClosed(KVStoreError, RuntimeError):
    """An operation was attempted on a closed store or tier."""


class NotPermitted(KVStoreError, PermissionError):
    """The caller acted on something another client holds (a lease it did not take)."""


def describe_os_error(exc: OSError) -> str:
    """One line for a command-line user: ``cannot access PATH: REASON``, or the error's own text
    when it names no path."""
    if exc.filename is None or exc.strerror is None:
        return str(exc)
    return f"cannot access {exc.filename}: {exc.strerror}"
