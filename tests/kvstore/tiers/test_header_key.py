"""The disk tier's header key: headers planted in clients' payloads never become records, the key
file is made once and kept private, and a tier that lost it starts empty instead of guessing."""

from __future__ import annotations

import glob
import logging
import os
import shutil
import stat

import numpy as np
import pytest

from kvstore.checksum import layer_checksums
from kvstore.errors import InvalidRequest
from kvstore.tiers.disk_files import HEADER_KEY_FILE, open_header_key, read_header_key
from kvstore.tiers.header_key import SECRET_BYTES, HeaderKey
from kvstore.tiers.segment import HEADER_BYTES, PAGE, RecordHeader

from tests.kvstore.tiers.disk_helpers import (
    FP, LAYERS, header_key_of, index_of, key_of, meta_of, payload_of, put, reads_exact, segment_paths,
    without_hole_punching,
)

VICTIM = 99  # the block a forger wants served under its key: another namespace's, say


def _block_with_a_planted_header(forger: HeaderKey) -> np.ndarray:
    """A client's block: page 0 filler, page 1 a header for ``VICTIM``'s key tagged with ``forger``
    at a sequence number beyond any, then the victim's exact payload for that header to verify."""
    victim = payload_of(VICTIM)
    header = RecordHeader(key_of(VICTIM), victim.nbytes, LAYERS, 2**62, None, layer_checksums(victim, LAYERS))
    block = np.zeros(2 * PAGE + FP, np.uint8)
    block[PAGE : 2 * PAGE] = np.frombuffer(header.encode(forger), np.uint8)
    block[2 * PAGE : 2 * PAGE + victim.nbytes] = victim
    return block


@pytest.mark.parametrize("stolen", [False, True], ids=["guessed_key", "tiers_own_key"])
def test_a_header_planted_in_a_removed_block_never_comes_back_from_a_rebuild(open_tier, tmp_path, monkeypatch,
                                                                            stolen):
    """Where no hole is punched a removed record's header page is zeroed and its payload stays; a
    rebuild then scans that payload page by page. Before format 2 a planted header (its checksum an
    unkeyed xxh3 anyone computes) came back as the victim's block. Only with the tier's own key
    (one who can read the tier's directory, which clients cannot) does it: the scan reaches it."""
    without_hole_punching(monkeypatch)
    tier = open_tier()
    forger = header_key_of(tmp_path / "disk") if stolen else HeaderKey(os.urandom(SECRET_BYTES))
    block = _block_with_a_planted_header(forger)
    assert put(tier, 0)
    assert tier.write(key_of(1), block, meta_of(block))
    assert put(tier, 2)
    assert tier.remove(key_of(1))  # its header page zeroed, its payload left in place
    tier.close()
    shutil.rmtree(tmp_path / "disk" / "index")  # lost: the next open rebuilds it from the segments
    tier = open_tier()
    assert tier.stats().extra["index_rebuilds"] == 1
    assert {index_of(k) for k, _ in tier.items()} == ({0, 2, VICTIM} if stolen else {0, 2})
    assert reads_exact(tier, 0) and reads_exact(tier, 2)
    assert reads_exact(tier, VICTIM) == stolen
    tier.check_integrity()


def _stored_then_closed(open_tier, blocks: int = 6) -> None:
    tier = open_tier()
    for i in range(blocks):
        assert put(tier, i)
    tier.close()


@pytest.mark.parametrize("index_too", [False, True], ids=["index_kept", "index_lost"])
def test_a_tier_whose_header_key_is_gone_starts_empty_and_frees_its_records(open_tier, tmp_path, caplog,
                                                                          index_too):
    """No header can be authenticated without the key: the records are garbage, whatever an index
    says (it is set aside: reads through it would all fail). The new key serves new writes."""
    _stored_then_closed(open_tier)
    os.unlink(tmp_path / "disk" / HEADER_KEY_FILE)
    if index_too:
        shutil.rmtree(tmp_path / "disk" / "index")
    with caplog.at_level(logging.WARNING, logger="kvstore.tiers.disk"):
        tier = open_tier()
    assert "no header key (header.key) beside 1 segment files" in caplog.text
    assert tier.stats().blocks == 0 and tier.used_bytes == 0 and not reads_exact(tier, 0)
    assert tier.stats().extra["recovered_lost_blocks"] == (0 if index_too else 6)
    assert len(glob.glob(str(tmp_path / "disk" / "index.corrupt-*"))) == (0 if index_too else 1)
    assert put(tier, 7)
    tier.close()
    tier = open_tier()
    assert {index_of(k) for k, _ in tier.items()} == {7} and reads_exact(tier, 7)
    tier.check_integrity()


@pytest.mark.parametrize("how", ["made_anew_then_killed", "copied_from_another_tier"])
def test_an_index_written_under_another_key_is_set_aside_not_served(open_tier, tmp_path, how):
    """An index whose entries another key's headers back: the key file was lost and the process
    died between making the new one and setting the old index aside, or the file was copied in.
    Before the index kept the key's fingerprint, its entries were loaded as live: lookups hit
    blocks no read could verify, and their bytes were never reclaimed."""
    _stored_then_closed(open_tier)
    key_file = tmp_path / "disk" / HEADER_KEY_FILE
    if how == "copied_from_another_tier":
        open_header_key(str(tmp_path))
        shutil.copyfile(tmp_path / HEADER_KEY_FILE, key_file)
    else:
        key_file.unlink()
        open_header_key(str(tmp_path / "disk"))
    tier = open_tier()
    assert tier.stats().extra["recovered_lost_blocks"] == 6
    assert not any(tier.contains(key_of(i)) for i in range(6)) and tier.used_bytes == 0
    assert len(glob.glob(str(tmp_path / "disk" / "index.corrupt-*"))) == 1
    assert put(tier, 7) and reads_exact(tier, 7)
    tier.close()
    tier = open_tier()  # the new index carries this key's fingerprint: kept
    assert {index_of(k) for k, _ in tier.items()} == {7}


def test_the_key_file_is_private_and_kept_across_opens(open_tier, tmp_path):
    _stored_then_closed(open_tier, blocks=1)
    path = tmp_path / "disk" / HEADER_KEY_FILE
    secret = path.read_bytes()
    assert len(secret) == SECRET_BYTES and stat.S_IMODE(path.stat().st_mode) == 0o600
    tier = open_tier()
    assert reads_exact(tier, 0) and path.read_bytes() == secret
    assert secret.hex() not in repr(tier._header_key)


def test_a_key_file_of_the_wrong_size_is_refused_and_nothing_is_changed(open_tier, tmp_path):
    _stored_then_closed(open_tier)
    (tmp_path / "disk" / HEADER_KEY_FILE).write_bytes(b"short")
    before = {p: open(p, "rb").read() for p in segment_paths(tmp_path / "disk")}
    for _ in range(2):  # the refused open let the directory go
        with pytest.raises(InvalidRequest, match=r"header.key holds 5 bytes, not the 32 a tier writes.*delete it"):
            open_tier()
    assert {p: open(p, "rb").read() for p in segment_paths(tmp_path / "disk")} == before


def test_a_key_that_cannot_be_written_leaves_no_file_and_says_where(tmp_path, monkeypatch):
    def no_space(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", no_space)
    with pytest.raises(OSError, match=rf"{tmp_path}/header.key failed \(No space left on device\)") as caught:
        open_header_key(str(tmp_path))
    assert caught.value.errno == 28 and os.listdir(tmp_path) == []
    monkeypatch.undo()
    made, created = open_header_key(str(tmp_path))
    again, created_again = open_header_key(str(tmp_path))
    assert (created, created_again) == (True, False) and read_header_key(str(tmp_path)) is not None
    page = RecordHeader(key_of(0), 8, 1, 0, None, (0,)).encode(made)
    assert RecordHeader.decode(page, again) is not None and len(page) == HEADER_BYTES


def test_a_header_key_is_exactly_its_size():
    with pytest.raises(ValueError, match="a header key is 32 bytes, got 31"):
        HeaderKey(bytes(31))
    assert HeaderKey(bytes(32)).tag(b"x") != HeaderKey(bytes(31) + b"\x01").tag(b"x")
