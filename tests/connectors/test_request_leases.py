"""RequestLeases: a lookup's answer as the engine's hit, and the lease kept until a load or release."""

from connectors.lower_tiers import LowerTiers
from connectors.request_leases import RequestLeases
from kvstore.results import LookupResult


def _leases(ended: list[int]) -> RequestLeases:
    return RequestLeases(64, LowerTiers(["host"], load_timeout_s=1.0), ended.append)


def test_a_leased_hit_is_served_and_its_lease_kept_for_the_load():
    ended = []
    leases = _leases(ended)
    hit = leases.hit("r", LookupResult(3, 64, ("host", "host", "disk"), lease_id=7))
    assert (hit.blocks, hit.tokens, hit.tiers) == (3, 192, ("host", "host", "disk"))
    assert leases.take("r") == 7
    assert leases.take("r") is None  # taken over: a release now ends nothing
    leases.release("r")
    assert ended == []


def test_a_hit_whose_lease_was_refused_is_a_miss():
    leases = _leases([])
    hit = leases.hit("r", LookupResult(2, 64, ("host", "host"), lease_refused=True))
    assert (hit.blocks, hit.tiers) == (0, ())
    assert leases.take("r") is None


def test_no_answer_is_a_miss():
    assert _leases([]).hit("r", None).blocks == 0


def test_release_ends_the_lease_once():
    ended = []
    leases = _leases(ended)
    leases.hit("r", LookupResult(1, 64, ("host",), lease_id=5))
    leases.release("r")
    leases.release("r")
    assert ended == [5]


def test_while_reads_below_memory_hang_a_hit_stops_before_them_and_an_empty_one_ends_its_lease():
    ended = []
    leases = _leases(ended)
    leases.lower_tiers.hung()  # a disk read hung: the back-off window opens
    partial = leases.hit("a", LookupResult(3, 64, ("host", "disk", "disk"), lease_id=1))
    assert (partial.blocks, partial.tiers) == (1, ("host",))
    assert leases.take("a") == 1  # still leased: the load pins the host block
    empty = leases.hit("b", LookupResult(2, 64, ("disk", "disk"), lease_id=2))
    assert empty.blocks == 0
    assert ended == [2] and leases.take("b") is None


def test_release_all_ends_every_lease_held():
    ended = []
    leases = _leases(ended)
    for i, request in enumerate("abc"):
        leases.hit(request, LookupResult(1, 64, ("host",), lease_id=i))
    leases.take("b")
    leases.release_all()
    assert sorted(ended) == [0, 2]
