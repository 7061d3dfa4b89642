"""Keys: golden vectors that pin the namespace fingerprint and the chained block hash forever.

The hex literals below were derived once from the naive reference ``_naive_chain`` (struct-packed
little-endian uint32 tokens, one xxh3-128 call per block) and a hand-written canonical JSON
string, then frozen. If one of these tests fails, the hash function changed: that needs a new
``HASH_ALGORITHM`` name, never an edit of the literals.
"""

from __future__ import annotations

import dataclasses
import os
import struct
import subprocess
import sys

import numpy as np
import pytest
import xxhash

import kvstore.keys
from kvstore.errors import InvalidRequest
from kvstore.keys import (
    DIGEST_BYTES,
    HASH_ALGORITHM,
    Namespace,
    chain_hashes,
    config_hash,
    encode_extra_keys,
    namespace_hashes,
)

ZERO_SEED = bytes(16)


@pytest.fixture(autouse=True, params=["native", "python"])
def hash_loop(request, monkeypatch):
    """Every test runs on both loops of ``chain_hashes``: the C one (kvstore/_chain.c) and the
    Python fallback used where the extension could not be built."""
    if request.param == "native" and not kvstore.keys.native_hashing():
        pytest.skip("kvstore._chain is not built (needs a C compiler and libxxhash-dev at install)")
    if request.param == "python":
        monkeypatch.setattr(kvstore.keys, "_native", None)
    return request.param

V3 = Namespace(model="deepseek-ai/DeepSeek-V3", model_config_hash="cfg-v3", num_layers=61, components=("mla_bf16",))
V3_CANONICAL_JSON = (
    '{"block_size":64,"cache_salt":"","components":["mla_bf16"],"engine":"mla-kvstore",'
    '"engine_version":"0","extra":[],"hash_algorithm":"xxh3-128-chain-v1",'
    '"model":"deepseek-ai/DeepSeek-V3","model_config_hash":"cfg-v3","num_layers":61,"weights_hash":""}'
)
V3_ID_HEX = "71d54dbc68958993770ae3a2669de755"
V3_TOKENS_0_127_HEX = ["5e14a872d076f05b1a315643d5ddfe82", "ed507f6e9dd1d239d04e2e35424ddb3e"]
ZERO_SEED_TOKENS_0_127_HEX = ["f4f82385840f98f798fd01657ccc215c", "213e9f06b8b527205f47a5f7fe78b592"]
EXTRA_ON_BLOCK_1_HEX = ["f4f82385840f98f798fd01657ccc215c", "65d4e9a9fd63de52e333ceb44ec42128"]
CONTINUED_128_255_HEX = ["7effcab722e4f448bd3d75f06a17c82e", "7035496b94c95637613d638494b5b557"]
EXTREME_TOKENS_HEX = ["1235a93edfa360add901b102eb7bf87d"]


def _naive_chain(seed: bytes, tokens, block_size: int, extra=None, parent=None) -> list[bytes]:
    """Reference implementation straight from DESIGN.md section 5, one block at a time."""
    prev = parent if parent is not None else seed
    out = []
    for i in range(len(tokens) // block_size):
        data = prev + struct.pack(f"<{block_size}I", *(int(t) for t in tokens[i * block_size : (i + 1) * block_size]))
        for item in (extra or {}).get(i, ()):
            raw = item.encode() if isinstance(item, str) else item
            data += struct.pack("<I", len(raw)) + raw
        prev = xxhash.xxh3_128_digest(data)
        out.append(prev)
    return out


# ---- golden vectors ------------------------------------------------------------------------


def test_golden_namespace_canonical_json_and_id():
    assert V3.canonical_json() == V3_CANONICAL_JSON
    assert V3.id.hex() == V3_ID_HEX
    assert V3.id == xxhash.xxh3_128_digest(V3_CANONICAL_JSON.encode())


def test_golden_chain_of_two_blocks_seeded_by_namespace():
    hashes = namespace_hashes(V3, np.arange(128))
    assert [h.hex() for h in hashes] == V3_TOKENS_0_127_HEX
    assert chain_hashes(bytes.fromhex(V3_ID_HEX), list(range(128)), 64) == hashes


def test_golden_chain_from_zero_seed():
    assert [h.hex() for h in chain_hashes(ZERO_SEED, np.arange(128), 64)] == ZERO_SEED_TOKENS_0_127_HEX


def test_golden_extra_keys_change_only_their_block_and_later():
    extra = {1: ["lora:adapter-7", b"\x00\x01img"]}
    hashes = chain_hashes(ZERO_SEED, np.arange(128), 64, extra_keys=extra)
    assert [h.hex() for h in hashes] == EXTRA_ON_BLOCK_1_HEX
    assert hashes[0].hex() == ZERO_SEED_TOKENS_0_127_HEX[0]  # block 0 has no extra keys
    assert hashes[1].hex() != ZERO_SEED_TOKENS_0_127_HEX[1]


def test_golden_continuing_from_parent():
    parent = bytes.fromhex(ZERO_SEED_TOKENS_0_127_HEX[-1])
    hashes = chain_hashes(ZERO_SEED, np.arange(128, 256), 64, parent=parent)
    assert [h.hex() for h in hashes] == CONTINUED_128_255_HEX
    # continuing equals hashing the whole prompt in one go
    whole = chain_hashes(ZERO_SEED, np.arange(256), 64)
    assert [h.hex() for h in whole] == ZERO_SEED_TOKENS_0_127_HEX + CONTINUED_128_255_HEX


def test_golden_extreme_token_ids_pack_as_little_endian_uint32():
    tokens = [2**32 - 1, 0, 65535, 2**31]
    assert [h.hex() for h in chain_hashes(ZERO_SEED, tokens, 4)] == EXTREME_TOKENS_HEX
    assert [h.hex() for h in chain_hashes(ZERO_SEED, np.array(tokens, np.uint64), 4)] == EXTREME_TOKENS_HEX


def test_golden_literals_agree_with_the_naive_reference():
    """The frozen literals really are the naive function's output (guards against typos)."""
    assert [h.hex() for h in _naive_chain(V3.id, range(128), 64)] == V3_TOKENS_0_127_HEX
    assert [h.hex() for h in _naive_chain(ZERO_SEED, range(128), 64)] == ZERO_SEED_TOKENS_0_127_HEX
    assert [h.hex() for h in _naive_chain(ZERO_SEED, range(128), 64, {1: ["lora:adapter-7", b"\x00\x01img"]})] \
        == EXTRA_ON_BLOCK_1_HEX
    parent = bytes.fromhex(ZERO_SEED_TOKENS_0_127_HEX[-1])
    assert [h.hex() for h in _naive_chain(ZERO_SEED, range(128, 256), 64, parent=parent)] == CONTINUED_128_255_HEX


def test_golden_config_hash():
    assert config_hash({"b": [1, 2], "a": 1}) == config_hash({"a": 1, "b": [1, 2]})
    assert config_hash({"a": 1, "b": [1, 2]}) == xxhash.xxh3_128_hexdigest(b'{"a":1,"b":[1,2]}')


def test_constants_are_pinned():
    assert HASH_ALGORITHM == "xxh3-128-chain-v1"
    assert DIGEST_BYTES == 16


# ---- cross-check against the one-line definition -------------------------------------------


def test_matches_naive_definition_on_random_inputs():
    rng = np.random.default_rng(20240601)
    for _ in range(50):
        block_size = int(rng.integers(1, 40))
        tokens = rng.integers(0, 2**32, int(rng.integers(0, 300)), dtype=np.uint64)
        seed = rng.bytes(16)
        expected, prev = [], seed
        for i in range(len(tokens) // block_size):
            prev = xxhash.xxh3_128_digest(prev + tokens[i * block_size : (i + 1) * block_size].astype("<u4").tobytes())
            expected.append(prev)
        assert chain_hashes(seed, tokens, block_size) == expected
        assert chain_hashes(seed, tokens.astype(np.int64), block_size) == expected
        assert chain_hashes(seed, [int(t) for t in tokens], block_size) == expected


def test_matches_naive_definition_with_extra_keys_and_parent():
    rng = np.random.default_rng(7)
    for _ in range(20):
        block_size = int(rng.integers(1, 16))
        tokens = rng.integers(0, 2**32, block_size * int(rng.integers(1, 8)), dtype=np.uint64)
        n = len(tokens) // block_size
        extra = {int(i): [rng.bytes(int(rng.integers(0, 9))), "adapter"] for i in rng.choice(n, (n + 1) // 2, False)}
        parent = rng.bytes(16)
        assert chain_hashes(ZERO_SEED, tokens, block_size, extra_keys=extra, parent=parent) == _naive_chain(
            ZERO_SEED, tokens, block_size, extra, parent
        )


# ---- behaviour -----------------------------------------------------------------------------


def test_partial_trailing_block_is_ignored():
    full = chain_hashes(ZERO_SEED, np.arange(128), 64)
    for extra_tokens in (1, 17, 63):
        assert chain_hashes(ZERO_SEED, np.arange(128 + extra_tokens), 64) == full
    assert len(chain_hashes(ZERO_SEED, np.arange(191), 64)) == 2
    assert len(chain_hashes(ZERO_SEED, np.arange(192), 64)) == 3
    assert chain_hashes(ZERO_SEED, np.arange(63), 64) == []
    assert chain_hashes(ZERO_SEED, [], 64) == []


def test_each_block_depends_on_the_whole_prefix():
    base = chain_hashes(ZERO_SEED, np.arange(256), 64)
    changed = np.arange(256)
    changed[70] = 999_999  # a token of block 1
    other = chain_hashes(ZERO_SEED, changed, 64)
    assert other[0] == base[0]
    assert all(a != b for a, b in zip(other[1:], base[1:]))


def test_extra_keys_encoding_is_length_prefixed():
    assert encode_extra_keys([]) == b""
    assert encode_extra_keys(["ab", b"\x00"]) == b"\x02\x00\x00\x00ab\x01\x00\x00\x00\x00"
    # ["ab", "c"] and ["a", "bc"] must not collide
    assert encode_extra_keys(["ab", "c"]) != encode_extra_keys(["a", "bc"])
    tokens = np.arange(8)
    assert chain_hashes(ZERO_SEED, tokens, 8, extra_keys={0: ["ab", "c"]}) != chain_hashes(
        ZERO_SEED, tokens, 8, extra_keys={0: ["a", "bc"]}
    )


def test_same_digests_in_processes_with_different_hash_seeds():
    script = (
        "import sys\n"
        f"sys.path.insert(0, {os.path.dirname(os.path.dirname(kvstore.keys.__file__))!r})\n"
        "import numpy as np\n"
        "from kvstore.keys import Namespace, namespace_hashes\n"
        "assert 'torch' not in sys.modules\n"
        "ns = Namespace(model='deepseek-ai/DeepSeek-V3', model_config_hash='cfg-v3', num_layers=61,"
        " components=('mla_bf16',))\n"
        "print(hash('kvstore-hash-seed-probe'))\n"
        "print(ns.id.hex())\n"
        "print(','.join(h.hex() for h in namespace_hashes(ns, np.arange(128))))\n"
    )
    procs = [
        subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env={**os.environ, "PYTHONHASHSEED": seed})
        for seed in ("1", "2")
    ]
    outputs = []
    for proc in procs:
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err
        outputs.append(out.split())
    (probe_1, id_1, chain_1), (probe_2, id_2, chain_2) = outputs
    assert probe_1 != probe_2  # the two interpreters really did hash strings differently
    assert id_1 == id_2 == V3.id.hex() == V3_ID_HEX
    assert chain_1 == chain_2 == ",".join(V3_TOKENS_0_127_HEX)


# ---- namespace fingerprint -----------------------------------------------------------------

BASE_FIELDS = dict(model="m", model_config_hash="c", num_layers=2, components=("mla_fp8_ds", "indexer_fp8"))


@pytest.mark.parametrize(
    "field, value",
    [
        ("model", "m2"),
        ("model_config_hash", "c2"),
        ("num_layers", 3),
        ("components", ("mla_bf16", "indexer_fp8")),
        ("components", ("indexer_fp8", "mla_fp8_ds")),  # order decides the byte layout
        ("components", ("mla_fp8_ds",)),
        ("block_size", 32),
        ("engine", "vllm"),
        ("engine_version", "0.11.0"),
        ("cache_salt", "tenant-a"),
        ("weights_hash", "w1"),
        ("extra", (("hadamard", "1"),)),
    ],
)
def test_namespace_id_changes_when_any_field_changes(field, value):
    base = Namespace(**BASE_FIELDS)
    changed = Namespace(**{**BASE_FIELDS, field: value})
    assert changed != base
    assert changed.id != base.id
    assert namespace_hashes(changed, np.arange(128)) != namespace_hashes(base, np.arange(128))


def test_namespace_id_equal_for_equal_fields():
    a = Namespace(**BASE_FIELDS)
    b = Namespace(**{**BASE_FIELDS, "components": list(BASE_FIELDS["components"])})  # list becomes tuple
    assert a == b
    assert a.id == b.id
    assert hash(a) == hash(b)
    assert len(a.id) == DIGEST_BYTES
    assert namespace_hashes(a, np.arange(128)) == namespace_hashes(b, np.arange(128))


@pytest.mark.parametrize(
    "ns",
    [
        V3,
        Namespace(**BASE_FIELDS),
        Namespace(model="kimi", model_config_hash="x", num_layers=61, components=["mla_bf16"], block_size=16,
                  engine="sglang", engine_version="0.5", weights_hash="w", cache_salt="s\u00e9l",
                  extra=[("hadamard", "1"), ("rope", "neox")]),
    ],
)
def test_namespace_json_round_trip(ns):
    back = Namespace.from_json(ns.canonical_json())
    assert back == ns
    assert back.id == ns.id
    assert isinstance(back.components, tuple) and isinstance(back.extra, tuple)
    assert dataclasses.asdict(back) == dataclasses.asdict(ns)


# ---- invalid input -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "tokens",
    [
        [0, -1, 2, 3],
        [2**32, 0, 0, 0],
        [2**64, 0, 0, 0],
        np.array([[0, 1], [2, 3]]),
        np.array([0.0, 1.0, 2.0, 3.0]),
        [True, False, True, False],
        ["a", "b", "c", "d"],
    ],
    ids=["negative", "2**32", "2**64", "2-D", "float", "bool", "str"],
)
def test_invalid_tokens_raise(tokens):
    with pytest.raises(InvalidRequest):
        chain_hashes(ZERO_SEED, tokens, 2)


def test_largest_token_id_is_accepted():
    assert len(chain_hashes(ZERO_SEED, [2**32 - 1] * 4, 2)) == 2


@pytest.mark.parametrize("seed", [b"", bytes(15), bytes(17), bytes(32)])
def test_bad_seed_length_raises(seed):
    with pytest.raises(InvalidRequest):
        chain_hashes(seed, np.arange(4), 2)


@pytest.mark.parametrize("parent", [b"", bytes(15), bytes(32)])
def test_bad_parent_length_raises(parent):
    with pytest.raises(InvalidRequest):
        chain_hashes(ZERO_SEED, np.arange(4), 2, parent=parent)


@pytest.mark.parametrize("block_size", [0, -4])
def test_bad_block_size_raises(block_size):
    with pytest.raises(InvalidRequest):
        chain_hashes(ZERO_SEED, np.arange(8), block_size)


@pytest.mark.parametrize(
    "overrides",
    [
        dict(model=""),
        dict(hash_algorithm="sha256"),
        dict(hash_algorithm="xxh3-128-chain-v2"),
        dict(num_layers=0),
        dict(block_size=0),
        dict(components=()),
    ],
)
def test_invalid_namespace_raises(overrides):
    with pytest.raises(InvalidRequest):
        Namespace(**{**BASE_FIELDS, **overrides})


def test_concurrent_threads_get_the_same_digests_as_one_thread():
    """The hash uses per-thread scratch buffers: threads hashing different prompts at once must
    never see each other's rows."""
    import threading

    prompts = [np.random.default_rng(seed).integers(0, 129280, 64 * 300) for seed in range(8)]
    expected = [chain_hashes(ZERO_SEED, p, 64) for p in prompts]
    failures = []

    def worker(index: int) -> None:
        for _ in range(20):
            if chain_hashes(ZERO_SEED, prompts[index], 64) != expected[index]:
                failures.append(index)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert failures == []


def test_prompts_longer_than_the_cached_scratch_hash_correctly():
    import kvstore.keys as keys_module

    tokens = np.random.default_rng(3).integers(0, 129280, 64 * (keys_module._MAX_CACHED_ROWS + 5))
    naive, prev = [], ZERO_SEED
    packed = tokens.astype("<u4").tobytes()
    for i in range(len(tokens) // 64):
        prev = xxhash.xxh3_128_digest(prev + packed[i * 256 : (i + 1) * 256])
        naive.append(prev)
    assert chain_hashes(ZERO_SEED, tokens, 64) == naive


def test_strided_token_views_hash_like_their_copies():
    tokens = np.arange(512, dtype=np.int64)[::2]  # a non-contiguous view
    assert chain_hashes(ZERO_SEED, tokens, 64) == _naive_chain(ZERO_SEED, tokens.tolist(), 64)


@pytest.mark.parametrize("field, value", [("num_layers", 4.0), ("num_layers", True), ("block_size", "64"),
                                          ("model", 7), ("cache_salt", None)])
def test_a_namespace_field_of_the_wrong_type_is_refused(field, value):
    """A float layer count once made its own namespace id (and float block sizes)."""
    fields = dict(model="m", model_config_hash="c", num_layers=4, components=("mla_bf16",))
    with pytest.raises(InvalidRequest, match=f"Namespace.{field} must be"):
        Namespace(**{**fields, field: value})


def test_numpy_integers_are_plain_ints_in_a_namespace():
    fields = dict(model="m", model_config_hash="c", components=("mla_bf16",))
    assert Namespace(num_layers=np.int64(4), block_size=np.int32(64), **fields).id == \
        Namespace(num_layers=4, block_size=64, **fields).id


@pytest.mark.parametrize("field, value", [("components", [["mla_bf16"]]), ("components", "mla_bf16"),
                                          ("components", (b"mla_bf16",)), ("extra", [("k", [1])]),
                                          ("extra", [(1, "v")]), ("extra", [("k", "v", "w")]), ("extra", "kv")])
def test_namespace_components_and_extra_must_hold_strings(field, value):
    """Anything else once reached the layout (an unhashable component: TypeError) or made a
    namespace the gRPC Namespace message cannot express."""
    fields = dict(model="m", model_config_hash="c", num_layers=4, components=("mla_bf16",))
    with pytest.raises(InvalidRequest, match=f"Namespace.{field} must be a list of"):
        Namespace(**{**fields, field: value})


def test_a_namespace_takes_any_iterable_of_its_fields_and_keeps_the_ids_of_older_versions():
    """Inputs the constructor took before its type checks still work, with the same ids: any
    iterable of components, extra as a mapping or its items, and number values in extra."""
    fields = dict(model="m", model_config_hash="c", num_layers=4)
    listed = Namespace(components=["mla_bf16"], extra=[["lora", "a"], ["rank", 8]], **fields)
    assert Namespace(components=(c for c in ["mla_bf16"]), extra={"lora": "a", "rank": 8}, **fields).id == listed.id
    assert Namespace(components=("mla_bf16",), extra={"lora": "a", "rank": 8}.items(), **fields).id == listed.id
    assert listed.id.hex() == "c879c82807679061093af2473e55064f", "the id the code before the checks gave"
