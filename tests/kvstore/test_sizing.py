"""Sizing in bytes: bytes per token of each model preset, capacities in tokens or bytes, the
least measured capacity that keeps a fraction of the maximum."""

import pytest

from kvstore.errors import InvalidRequest
from kvstore.sizing import MODELS, bytes_per_token, format_bytes, parse_capacity, smallest_capacity_reaching


@pytest.mark.parametrize("model, expected", [
    ("deepseek-v3", 61 * (512 + 64) * 2),  # bf16 latent and rope key
    ("deepseek-v3-fp8", 61 * (512 + 4 * 4 + 64 * 2)),  # fp8 latent, 4 fp32 tile scales, bf16 rope
    ("deepseek-v3.2", 61 * (656 + 128 + 4)),  # plus the fp8 indexer key and its fp32 scale
    ("kimi-k2", 61 * 1152),
])
def test_bytes_per_token_follow_the_layouts(model, expected):
    assert bytes_per_token(model) == expected


def test_an_unknown_model_names_the_known_ones():
    with pytest.raises(InvalidRequest, match="unknown model 'llama'; known: " + ", ".join(MODELS)):
        bytes_per_token("llama")


@pytest.mark.parametrize("text, expected", [("3M", 3_000_000), ("500k", 500_000), ("1.5M", 1_500_000), ("42", 42),
                                            (" 2G ", 2_000_000_000), ("4.1M", 4_100_000), ("2.01k", 2_010),
                                            ("1e6", 1_000_000), ("0.128512M", 128_512)])
def test_capacities_in_tokens(text, expected):
    assert parse_capacity(text) == expected == parse_capacity(text, "deepseek-v3")


@pytest.mark.parametrize("text, model, expected", [
    ("128GiB", "deepseek-v3.2", (128 << 30) // 48068),
    ("1TB", "deepseek-v3", 10**12 // 70272),
    ("40016B", "deepseek-v3-fp8", 1),
    ("0.1GB", "deepseek-v3", 10**8 // 70272),
])
def test_capacities_in_bytes_are_the_tokens_that_fit(text, model, expected):
    assert parse_capacity(text, model) == expected


@pytest.mark.parametrize("text, message", [
    ("lots", "cannot read 'lots' as a capacity"),
    ("-3M", "a capacity must be at least one token, got '-3M'"),
    ("-5", "a capacity must be at least one token, got '-5'"),
    ("3x", "cannot read '3x'"),
    ("0", "at least one token"),
    ("128GiB", "'128GiB' is a size in bytes: give --model"),
    ("12xb", "cannot read '12xb' as a capacity; examples: 3M or 500k tokens, or 128GiB with --model"),
])
def test_bad_capacities_are_refused_with_what_to_give(text, message):
    with pytest.raises(InvalidRequest, match=message):
        parse_capacity(text)


def test_bytes_smaller_than_one_token_are_refused():
    with pytest.raises(InvalidRequest, match="at least one token"):
        parse_capacity("1KiB", "deepseek-v3")


@pytest.mark.parametrize("n, text", [(0, "0 B"), (1023, "1023 B"), (1536, "1.5 KiB"), (3 << 30, "3.0 GiB"),
                                     (5 << 40, "5.0 TiB"), ((1 << 20) - 1, "1.0 MiB"), ((1 << 30) - 10, "1.0 GiB")])
def test_format_bytes(n, text):
    assert format_bytes(n) == text


def test_smallest_capacity_reaching_is_the_least_measured_point_at_or_above():
    points = [(4000, 0.8), (1000, 0.3), (2000, 0.5), (8000, 0.95)]
    assert smallest_capacity_reaching(points, 0.5) == 2000
    assert smallest_capacity_reaching(points, 0.75) == 4000
    assert smallest_capacity_reaching(points, 0.99) is None
