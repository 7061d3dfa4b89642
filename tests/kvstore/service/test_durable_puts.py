"""Durable puts (``--durable-puts``): a Put answers durable=True only when every block is on the
disk tier and a flush that succeeded followed its copy there."""

from __future__ import annotations

import errno
import os
import threading
import time

import grpc

from kvstore.service.v1 import kvstore_pb2 as pb
from kvstore.service.v1.kvstore_pb2_grpc import KVStoreStub
from tests.conftest import payloads_for


def test_a_duplicate_is_durable_only_once_a_flush_followed_its_copy_reaching_the_disk(make_store, start_server,
                                                                                   namespace, spec, chain):
    """Engine A puts a block; its copy to the disk runs inline (backpressure) and lands only later.
    Engine B's duplicate put was answered durable=True once its flush ran, before that copy had
    landed: a crash then lost a block called durable. Since session 32 a flush follows every
    durable answer's last block reaching the disk; since session 33 B's put also waits for A's
    put of the block to finish before calling it a duplicate."""
    store = make_store(host_bytes=1 << 20, disk_bytes=4 << 20, background_writes=False)
    ns_id = store.register_namespace(namespace)
    disk, events = store.tiers[1], []
    a_copying, copy_may_land = threading.Event(), threading.Event()
    write, flush = disk.write, disk.flush

    def a_slow_copy(*args):
        a_copying.set()
        copy_may_land.wait(10)
        written = write(*args)
        events.append("written")
        return written

    def recorded_flush():
        events.append("flushed")
        return flush()

    disk.write, disk.flush = a_slow_copy, recorded_flush
    server = start_server(store, durable_puts=True)
    payload = payloads_for(spec, chain[:1])[0]
    engine_a = threading.Thread(target=store.put, args=(ns_id, chain[:1], [payload]))
    engine_a.start()
    replies = []

    def engine_b():
        with grpc.insecure_channel(server.target) as channel:
            header = pb.PutHeader(namespace_id=ns_id, block_hashes=chain[:1], block_bytes=spec.block_bytes)
            chunk = pb.Chunk(block_index=0, offset=0, data=payload.tobytes())
            replies.append(KVStoreStub(channel).Put(iter([pb.PutRequest(header=header), pb.PutRequest(chunk=chunk)]),
                                                    timeout=30))

    b = threading.Thread(target=engine_b)
    try:
        assert a_copying.wait(10)
        b.start()
        time.sleep(0.3)
        assert not replies and "flushed" not in events, "B waits for A's put of the block"
    finally:
        copy_may_land.set()
        engine_a.join(10)
        b.join(30)
    reply = replies[0]
    assert reply.duplicates == 1 and disk.contains(ns_id + chain[0])
    assert reply.durable, "the block is on the disk and a flush followed"
    assert events[0] == "written" and "flushed" in events[1:], "synced after it was written"


def test_a_put_is_not_durable_when_the_disk_tier_could_not_fsync(make_store, start_server, namespace, spec, chain,
                                                                 monkeypatch):
    """The disk tier logged a failed fsync and the put was answered durable=True: a crash could lose
    it. Now the answer is False, for that put and every later one, until the tier is reopened."""
    store = make_store(host_bytes=1 << 20, disk_bytes=4 << 20, background_writes=False)
    ns_id = store.register_namespace(namespace)
    server = start_server(store, durable_puts=True)
    payloads = payloads_for(spec, chain[:3])

    def put(i):
        with grpc.insecure_channel(server.target) as channel:
            header = pb.PutHeader(namespace_id=ns_id, block_hashes=chain[i:i + 1], block_bytes=spec.block_bytes,
                                  parent=chain[i - 1] if i else None)
            chunk = pb.Chunk(block_index=0, offset=0, data=payloads[i].tobytes())
            return KVStoreStub(channel).Put(iter([pb.PutRequest(header=header), pb.PutRequest(chunk=chunk)]),
                                            timeout=30)

    def eio(fd):
        raise OSError(errno.EIO, "injected: Input/output error")

    assert put(0).durable
    with monkeypatch.context() as broken:
        broken.setattr(os, "fdatasync", eio)
        reply = put(1)
    assert reply.stored == 1 and not reply.durable
    reply = put(2)
    assert reply.stored == 1 and not reply.durable, "an fsync failed since: nothing written is known durable"
    assert store.tiers[1].contains(ns_id + chain[2]) and store.tiers[1].stats().io_errors == 1
