"""keep_heap_for_transfers: a freed transfer-sized buffer stays in the process (no page faults for
the next one), and KVSTORE_KEEP_HEAP=0 leaves glibc's defaults alone."""

import json
import os
import subprocess
import sys

import pytest

from kvstore.errors import InvalidRequest
from kvstore.service.heap import keep_heap_for_transfers
from tests.kvstore.service.test_serve_process import REPO

PROBE = """
import json, os, sys
from kvstore.service.heap import keep_heap_for_transfers

def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

kept = keep_heap_for_transfers()
before = rss()
buf = bytearray(16 << 20)  # a transfer: 16 MiB, every page touched
del buf
print(json.dumps({"kept": kept, "retained": rss() - before}))
"""


def probe(**env) -> dict:
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": REPO, **env})
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_a_freed_transfer_buffer_stays_in_the_heap():
    kept = probe()
    assert kept["kept"] and kept["retained"] >= 12 << 20, kept


def test_keep_heap_off_leaves_glibc_returning_the_buffer():
    default = probe(KVSTORE_KEEP_HEAP="0")
    assert not default["kept"] and default["retained"] < 4 << 20, default


@pytest.mark.parametrize("value, kept", [("off", False), ("", False), ("yes", True)])
def test_keep_heap_reads_booleans_as_every_other_setting_does(monkeypatch, value, kept):
    monkeypatch.setenv("KVSTORE_KEEP_HEAP", value)
    assert keep_heap_for_transfers() is kept or (kept and not sys.platform.startswith("linux"))


def test_keep_heap_refuses_a_value_that_is_no_boolean_naming_the_variable(monkeypatch):
    """``maybe`` counted as on, where every other boolean setting refuses it."""
    monkeypatch.setenv("KVSTORE_KEEP_HEAP", "maybe")
    with pytest.raises(InvalidRequest, match="^KVSTORE_KEEP_HEAP: cannot read 'maybe' as a boolean"):
        keep_heap_for_transfers()
