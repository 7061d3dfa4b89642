"""``put_shm`` falls back to Put, and stores every block, wherever its staging slots cannot be trusted:
a reservation about to lapse, a commit that finds the slots changed (a late writer of a lapsed
reservation whose slots went to this one), a client told not to map shared memory."""

from __future__ import annotations

import numpy as np

from kvstore.results import PutResult
from kvstore.service import client as client_module
from kvstore.service.client import KVStoreClient
from tests.conftest import payloads_for


class CountingCommits:
    """The client's CommitSlots, counted, with ``before`` run ahead of each call (a late writer)."""

    def __init__(self, client: KVStoreClient, before=lambda: None):
        self.calls, self._real, self._before = 0, client._stub.CommitSlots, before
        client._stub.CommitSlots = self

    def __call__(self, request, **kwargs):
        self.calls += 1
        self._before()
        return self._real(request, **kwargs)


def loaded(client: KVStoreClient, ns_id: bytes, hashes, spec) -> list[np.ndarray]:
    dsts = [np.zeros(spec.block_bytes, np.uint8) for _ in hashes]
    assert client.load(ns_id, hashes, dsts).complete
    return dsts


def test_a_commit_whose_slots_a_late_writer_spoiled_falls_back_to_put(staged_client, staging, namespace, spec, chain):
    """Before session 34 the commit's ABORTED (INVALID_ARGUMENT then) reached the caller, and the
    blocks were not stored: an innocent client's put failed for another's late write."""
    ns_id = staged_client.register_namespace(namespace)
    payloads = payloads_for(spec, chain[:3])
    arena = np.frombuffer(staging._segment.mmap, np.uint8)

    def late_writer():  # writes over every slot of the area, as one whose reservation lapsed
        arena[:] = 0x5A

    commits = CountingCommits(staged_client, before=late_writer)
    assert staged_client.put_shm(ns_id, chain[:3], payloads) == PutResult(3, 0, 0)
    assert commits.calls == 1, "the commit was tried, refused, and Put took the blocks"
    assert all(np.array_equal(d, p) for d, p in zip(loaded(staged_client, ns_id, chain[:3], spec), payloads))
    assert staging.active() == 0, "the refused commit ended its reservation"


def test_a_reservation_too_close_to_lapsing_is_not_written_and_put_takes_the_blocks(staged_client, staging, namespace,
                                                                                    spec, chain, monkeypatch):
    """A reservation past its writing time once ReserveSlots answers: a write then could land in
    slots the area has given to another client. (A 1 ms TTL alone was not always past it: the
    call answered within 0.9 ms once, on a fresh clone; the whole TTL is the margin here.)"""
    monkeypatch.setattr(client_module, "STAGING_WRITE_MARGIN", 1.0)
    ns_id = staged_client.register_namespace(namespace)
    payloads = payloads_for(spec, chain[:2])
    commits = CountingCommits(staged_client)
    assert staged_client.put_shm(ns_id, chain[:2], payloads, ttl_s=0.001) == PutResult(2, 0, 0)
    assert commits.calls == 0, "nothing was written, so nothing to commit"
    assert not np.frombuffer(staging._segment.mmap, np.uint8).any(), "no slot was written"
    assert all(np.array_equal(d, p) for d, p in zip(loaded(staged_client, ns_id, chain[:2], spec), payloads))


def test_a_client_told_not_to_map_shared_memory_puts_through_put(staged_server, staging, namespace, spec, chain):
    """Before session 34 ``shared_memory=False`` held for loads only: put_shm still mapped the
    staging segment, so tests standing for another host never took its Put path."""
    with KVStoreClient(staged_server.target, timeout_s=30, shared_memory=False) as client:
        ns_id = client.register_namespace(namespace)
        payloads = payloads_for(spec, chain[:2])
        commits = CountingCommits(client)
        assert client.put_shm(ns_id, chain[:2], payloads) == PutResult(2, 0, 0)
        assert commits.calls == 0 and client._staging.mapped_paths() == []
        assert all(np.array_equal(d, p) for d, p in zip(loaded(client, ns_id, chain[:2], spec), payloads))


def test_put_shm_still_commits_through_staging_when_nothing_goes_wrong(staged_client, staging, namespace, spec, chain):
    ns_id = staged_client.register_namespace(namespace)
    commits = CountingCommits(staged_client)
    assert staged_client.put_shm(ns_id, chain[:2], payloads_for(spec, chain[:2])) == PutResult(2, 0, 0)
    assert commits.calls == 1 and staged_client._staging.mapped_paths() == [staging.segment_path]
