"""KnownKeys: what list() reports, bounded, and found with one lookup per run of present keys."""

from connectors.lmcache.framing import key_digest
from connectors.lmcache.known_keys import KnownKeys


def test_the_newest_keys_are_kept_and_a_key_seen_again_is_newest():
    known = KnownKeys(limit=3)
    known.remember(["a", "b", "c"])
    known.remember(["a", "d"])  # b goes: a was seen again
    assert known.present(lambda digests: len(digests), 10, lambda: False, lambda exc: None) == ["c", "a", "d"]


def test_present_skips_one_missing_key_per_lookup_and_keeps_what_it_found_when_a_lookup_fails():
    known = KnownKeys()
    known.remember(["a", "b", "c", "d", "e"])
    held = {key_digest(k) for k in "abde"}
    calls = []

    def lookup(digests):
        calls.append(len(digests))
        return next((i for i, d in enumerate(digests) if d not in held), len(digests))
    assert known.present(lookup, 10, lambda: False, lambda exc: None) == ["a", "b", "d", "e"]
    assert calls == [5, 2]

    failures = []

    def fails_second(digests):
        if failures or len(digests) < 5:
            raise RuntimeError("the sidecar went away")
        return 2
    assert known.present(fails_second, 10, lambda: False, failures.append) == ["a", "b"]
    assert len(failures) == 1


def test_present_stops_when_told():
    known = KnownKeys()
    known.remember(["a", "b"])
    assert known.present(lambda digests: len(digests), 1, lambda: True, lambda exc: None) == []
