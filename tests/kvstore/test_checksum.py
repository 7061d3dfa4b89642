"""Per-layer checksums, and hashing the next payloads of a put ahead on a helper thread."""

import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from kvstore import checksum
from kvstore.checksum import checksums_ahead, layer_checksums, layers_match


def _payloads(count: int) -> list[np.ndarray]:
    rng = np.random.default_rng(5)
    return [rng.integers(0, 256, 4 * 1000, dtype=np.uint8) for _ in range(count)]


def test_layer_checksums_see_every_layer():
    payload = _payloads(1)[0]
    sums = layer_checksums(payload, 4)
    assert len(sums) == 4 and layers_match(payload, sums)
    payload[3999] ^= 1
    assert layers_match(payload[:3000], sums[:3]) and not layers_match(payload, sums)


@pytest.mark.parametrize("ahead", [1, 3])
@pytest.mark.parametrize("count", [0, 1, 2, 9])
def test_checksums_ahead_are_the_checksums_in_order(count, ahead):
    payloads = _payloads(count)
    with ThreadPoolExecutor(2) as executor:
        got = list(checksums_ahead(payloads, 4, executor, ahead, min_offload_bytes=0))
    assert got == [layer_checksums(p, 4) for p in payloads]
    assert list(checksums_ahead(payloads, 4, None)) == got


def test_closing_early_cancels_what_has_not_started(monkeypatch):
    payloads, hashed = _payloads(50), []
    def slow_hash(payload, num_layers):  # slow enough that the queue cannot drain behind our back
        hashed.append(1)
        time.sleep(0.05)
        return layer_checksums(payload, num_layers)

    monkeypatch.setattr(checksum, "layer_checksums", slow_hash)
    with ThreadPoolExecutor(1) as executor:
        sums = checksums_ahead(payloads, 4, executor, ahead=5, min_offload_bytes=0)
        assert next(sums) == layer_checksums(payloads[0], 4)
        sums.close()
    assert len(hashed) <= 2  # the one consumed, and at most the one the worker had already begun


class _CountingExecutor(ThreadPoolExecutor):
    def __init__(self):
        super().__init__(1)
        self.submitted = 0

    def submit(self, *args, **kwargs):
        self.submitted += 1
        return super().submit(*args, **kwargs)


def test_small_payloads_are_hashed_inline_and_large_ones_ahead():
    small = _payloads(5)  # 4,000 bytes each
    large = [np.resize(p, 1 << 20) for p in small[:3]]
    with _CountingExecutor() as executor:
        assert list(checksums_ahead(small, 4, executor)) == [layer_checksums(p, 4) for p in small]
        assert executor.submitted == 0
        assert list(checksums_ahead(large, 4, executor)) == [layer_checksums(p, 4) for p in large]
        assert executor.submitted == 3
