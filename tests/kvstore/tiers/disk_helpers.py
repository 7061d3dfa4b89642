"""What the disk tier tests share: block keys and payloads, a tier factory, file surgery, and a
real process that owns a tier."""

from __future__ import annotations

import glob
import hashlib
import json
import os
import signal
import subprocess
import sys

import numpy as np

from kvstore.checksum import layer_checksums
from kvstore.tiers import disk_reclaim, disk_recovery
from kvstore.tiers.base import BlockMeta
from kvstore.tiers.disk import DiskTier
from kvstore.tiers.disk_files import read_header_key
from kvstore.tiers.header_key import HeaderKey
from kvstore.tiers.segment import footprint, scan_segment


REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

LAYERS = 4
NBYTES = 24_000  # 4 layers of 6,000 bytes; a record is 7 pages
FP = footprint(NBYTES)


# ---- helpers (the child processes define the same functions, see _PRELUDE) -----------------

def key_of(i: int) -> bytes:
    """32-byte key whose first 8 bytes give back ``i`` (so a reopened index can be checked)."""
    return i.to_bytes(8, "little") + hashlib.blake2b(i.to_bytes(8, "little"), digest_size=24).digest()


def index_of(key: bytes) -> int:
    return int.from_bytes(key[:8], "little")


def payload_of(i: int, nbytes: int = NBYTES) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 256, nbytes, dtype=np.uint8)


def meta_of(payload: np.ndarray, num_layers: int = LAYERS, parent: bytes | None = None) -> BlockMeta:
    return BlockMeta(payload.nbytes, num_layers, layer_checksums(payload, num_layers), parent)


def put(tier: DiskTier, i: int, nbytes: int = NBYTES, num_layers: int = LAYERS, parent: bytes | None = None) -> bool:
    payload = payload_of(i, nbytes)
    return tier.write(key_of(i), payload, meta_of(payload, num_layers, parent))


def reads_exact(tier: DiskTier, i: int, nbytes: int = NBYTES) -> bool:
    dst = np.zeros(nbytes, np.uint8)
    if not tier.read(key_of(i), dst):
        return False
    assert np.array_equal(dst, payload_of(i, nbytes)), f"block {i} read back WRONG bytes"
    return True


def segment_paths(path) -> list[str]:
    return sorted(glob.glob(os.path.join(str(path), "segments", "*.seg")))


def header_key_of(path) -> HeaderKey:
    """The header key of the tier at ``path`` (what a test forging or reading records needs)."""
    header_key = read_header_key(str(path))
    assert header_key is not None, f"no header key in {path}"
    return header_key


def locate(path, key: bytes) -> tuple[str, int]:
    """(segment file, record offset) of ``key``, found by scanning the segments."""
    for seg in segment_paths(path):
        for record in scan_segment(seg, header_key_of(path), verify=False):
            if record.header.key == key:
                return seg, record.offset
    raise AssertionError("record not found in any segment")


def flip_byte(file: str, offset: int, mask: int = 0x01) -> None:
    with open(file, "r+b") as f:
        byte = os.pread(f.fileno(), 1, offset)
        os.pwrite(f.fileno(), bytes([byte[0] ^ mask]), offset)


def without_hole_punching(monkeypatch) -> None:
    """A file system that cannot punch holes (NFSv3, some FUSE): the probe at open finds none."""
    monkeypatch.setattr(disk_reclaim, "punch_hole", lambda fd, offset, length: False)
    monkeypatch.setattr(disk_recovery, "punch_hole", lambda fd, offset, length: False)


def tier_with_index_in_one_sst(path, blocks: int) -> str:
    """Write blocks ``0..blocks-1`` to a new tier at ``path`` (8 records a segment), flush its
    index into a single SST file (a table of checksummed blocks), and close it; the file's path."""
    tier = DiskTier(str(path), 64 << 20, segment_bytes=8 * FP)
    for i in range(blocks):
        assert put(tier, i)
    tier._db.flush()  # the memtable out to an SST file
    tier.close()
    [sst] = glob.glob(os.path.join(str(path), "index", "*.sst"))
    return sst


def corrupt_index_block(sst: str, where: str) -> None:
    """Flip a byte in a data block of the index's SST file: one of block entries ("entries", a
    third of the way in), or the last, which holds the ``m/`` keys after them ("metadata")."""
    with open(sst, "rb") as f:
        data = f.read()
    offset = len(data) // 3 if where == "entries" else data.find(b"m/format")
    assert offset > 0, "no format key in the SST file's bytes (compressed?)"
    flip_byte(sst, offset, 0xFF)


# ---- a tier open in another process ------------------------------------------------------------

_OWNER = """
import json, sys
from kvstore.tiers.disk import DiskTier
from kvstore.tiers.disk_files import read_header_key
from kvstore.tiers.header_key import HeaderKey
from tests.kvstore.tiers.disk_helpers import key_of, put

tier = DiskTier(sys.argv[1], 64 << 20, durable=True)
for line in sys.stdin:  # block ids: write them (or, after "-", discard them), say which took; empty: close
    words = line.split()
    if not words:
        break
    if words[0] == "-":
        print(json.dumps([tier.discard(key_of(int(i))) for i in words[1:]]), flush=True)
    else:
        print(json.dumps([put(tier, int(i)) for i in words]), flush=True)
tier.close()
"""


class TierOwner:
    """A real process that opens the disk tier at ``path`` (``durable=True``) and holds it until
    ``close()`` or ``kill()``; ``put`` has it write blocks. Leaving the ``with`` block kills it."""

    def __init__(self, path):
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _OWNER, str(path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": REPO},
        )

    def put(self, *ids: int) -> list[bool]:
        """Write blocks ``ids`` in the owner; which it acknowledged (after its tier is open)."""
        return self._ask(" ".join(map(str, ids)))

    def discard(self, *ids: int) -> list[bool]:
        """Have the owner ``discard`` blocks ``ids``; which were resident."""
        return self._ask(" ".join(["-", *map(str, ids)]))

    def _ask(self, line: str) -> list[bool]:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        answer = self.proc.stdout.readline()
        assert answer, f"the owner process died: {self.proc.stderr.read()}"
        return json.loads(answer)

    def close(self) -> None:
        """Close the tier and let the process end."""
        _, err = self.proc.communicate("\n", timeout=30)
        assert self.proc.returncode == 0, err

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)

    def __enter__(self) -> "TierOwner":
        return self

    def __exit__(self, *exc) -> None:
        if self.proc.poll() is None:
            self.kill()
        for stream in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            stream.close()
