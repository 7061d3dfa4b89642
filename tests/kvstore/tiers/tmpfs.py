"""A real tmpfs of a chosen size, for tests of a shared-memory directory that fills up."""

from __future__ import annotations

import contextlib
import os
import subprocess
from typing import Iterator

import pytest


@contextlib.contextmanager
def mounted_tmpfs(path: str, size_bytes: int) -> Iterator[str]:
    """Mount a tmpfs of ``size_bytes`` at ``path`` (made if missing) and unmount it afterwards;
    skips the test where mounting is not permitted (not root, no CAP_SYS_ADMIN)."""
    os.makedirs(path, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_bytes}", "tmpfs", path],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield path
    finally:
        if subprocess.run(["umount", path], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", path], check=True)  # still mapped: detach now, freed when unmapped
