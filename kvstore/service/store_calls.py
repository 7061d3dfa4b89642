"""The servicer's store calls that are more than one store method, and the rules they share.

Each runs on a worker thread (a transfer thread for Get, Put and CommitSlots, else the event
loop's default executor), never on the event loop: they copy megabytes or take the store's lock.
What a call takes for a client (a lease, a reservation) and the client gave up on meanwhile is
handed back by ``undone_if_abandoned``.
"""

from __future__ import annotations

import asyncio
import functools

import numpy as np

from kvstore.errors import InvalidRequest, UnknownLease
from kvstore.keys import DIGEST_BYTES
from kvstore.results import PutResult
from kvstore.service.staging import Reservation, StagingArea
from kvstore.store import TieredStore
from kvstore.validation import check_chain, check_hashes


def load_group(store: TieredStore, ns_id: bytes, block_bytes: int, hashes: list[bytes],
               lease_id: int | None = None):
    """``store.load`` of ``hashes`` into new buffers (ending ``lease_id``, if given); the result and buffers."""
    dsts = [np.empty(block_bytes, np.uint8) for _ in hashes]  # [block_bytes] uint8 each
    return store.load(ns_id, hashes, dsts, lease_id), dsts


def on_disk(store: TieredStore, ns_id: bytes, hashes: list[bytes]) -> bool:
    """Whether the store's last tier (the disk, under ``--durable-puts``) holds every one of ``hashes``."""
    disk = store.tiers[-1]
    return all(disk.contains(ns_id + block_hash) for block_hash in hashes)


def flush_durable(store: TieredStore, ns_id: bytes, hashes: list[bytes]) -> bool:
    """Flush the store; whether every one of ``hashes`` is now durable on its last tier (the disk).

    ``store.flush`` drains the background writes (this put's own copies to the disk among them),
    then fsyncs what the disk tier had written by then. A block the disk holds only after that
    (a racing put's copy of it landing meanwhile, ours being a duplicate) was fsynced by nothing,
    so once every block is found there the store is flushed again: durable means written before
    a flush that completed. A flush that failed (an fsync error, since which the tier promises
    nothing) answers False."""
    if not store.flush() or not on_disk(store, ns_id, hashes):
        return False
    return store.flush()


def release_quietly(store: TieredStore, lease_id: int) -> None:
    try:
        store.release(lease_id)
    except UnknownLease:  # expired meanwhile: the blocks were served unpinned, and each verified
        pass


def check_put_chain(hashes, parent: bytes | None) -> None:
    """What ``store.put`` checks of a chain (16-byte hashes, distinct, the parent not among them),
    at the call's start: before a Put's payload arrives or a ReserveSlots takes staging space."""
    check_hashes(hashes)
    if parent is not None and len(parent) != DIGEST_BYTES:
        raise InvalidRequest(f"parent must be a {DIGEST_BYTES}-byte block hash (the one before block_hashes[0]), "
                             f"got {len(parent)} bytes")
    check_chain(hashes, parent)


def commit(store: TieredStore, staging: StagingArea, reservation_id: int, checksums: list[tuple[int, ...]],
           owner: str) -> tuple[Reservation, PutResult]:
    """CommitSlots' work, on one transfer thread (a client that goes away cannot part the two):
    ``owner``'s reservation ended into verified copies, those stored, then recycled."""
    reservation, payloads = staging.take(reservation_id, checksums, owner)
    try:
        return reservation, store.put(reservation.ns_id, list(reservation.block_hashes), payloads, reservation.parent)
    finally:
        staging.recycle(payloads)


async def undone_if_abandoned(undo, context, call, *args):
    """``call(*args)`` on a worker thread. If the RPC awaiting it is cancelled meanwhile (its client
    went away, its deadline passed), ``undo(result)`` runs on a worker thread once ``call``
    returns: what it took (a lease, a reservation) belongs to no one who could end it. So it does
    when ``call`` returns after the RPC's deadline (``context.time_remaining()``) but before gRPC
    has cancelled the handler: the client has its DEADLINE_EXCEEDED already, and the handler ends
    cancelled. A cancellation that arrives after that check, before the answer is sent, still
    leaves what was taken to its TTL."""
    calling = asyncio.ensure_future(asyncio.to_thread(call, *args))
    try:
        result = await asyncio.shield(calling)
    except asyncio.CancelledError:
        calling.add_done_callback(functools.partial(_undo_result, undo))
        raise
    remaining = context.time_remaining()
    if remaining is not None and remaining <= 0:
        await asyncio.to_thread(undo, result)
        raise asyncio.CancelledError("the call's deadline passed before its answer was ready")
    return result


def _undo_result(undo, calling: asyncio.Future) -> None:
    if not calling.cancelled() and calling.exception() is None:
        calling.get_loop().run_in_executor(None, undo, calling.result())
