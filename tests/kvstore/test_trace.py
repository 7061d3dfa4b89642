"""Mooncake-format traces: parsing, partial last blocks, and clear errors naming the line."""

import pytest

from kvstore.errors import InvalidRequest
from kvstore.trace import TraceRequest, read_trace, write_trace


def test_round_trip_and_partial_last_block(tmp_path):
    path = tmp_path / "t.jsonl"
    write_trace(str(path), [TraceRequest(1.5, 1100, 7, (1, 2, 3)), {"timestamp": 2, "input_length": 512, "hash_ids": [1]}])
    first, second = read_trace(str(path))
    assert first == TraceRequest(1.5, 1100, 7, (1, 2, 3)) and second.hash_ids == (1,) and second.output_length == 0
    assert [first.block_tokens(i, 512) for i in range(3)] == [512, 512, 76]


@pytest.mark.parametrize("line, message", [
    ("not json", "not JSON"),
    ('{"input_length": 10}', "not a trace request"),
    ('{"input_length": 10, "hash_ids": [-1]}', "non-negative"),
    ('{"input_length": 2000, "hash_ids": [1, 2]}', "cannot hold input_length 2000"),
    ('{"input_length": 512, "hash_ids": [1, 2]}', "is --block-tokens right"),
    ('[1, 2]', "a JSON list"),
    ('{"input_length": 5, "hash_ids": "12"}', "hash_ids is a str"),
    ('{"input_length": 1024.7, "hash_ids": [1, 2]}', "1024.7 is not a whole number"),
    ('{"input_length": true, "hash_ids": [1]}', "True is not a whole number"),
    ('{"input_length": 5, "hash_ids": [Infinity]}', "inf is not a whole number"),
    ('{"input_length": 5, "hash_ids": [340282366920938463463374607431768211456]}', r"in \[0, 2\*\*128\)"),
    ('{"input_length": 600, "hash_ids": [7, 7]}', "a hash id appears twice in one request"),
    ('{"input_length": 600, "hash_ids": [3, 9]}', "hash id 9 follows id 3 here but nothing .a request's start. at "),
])
def test_malformed_lines_name_the_file_and_line(tmp_path, line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"input_length": 5, "hash_ids": [9]}\n' + line + "\n")
    with pytest.raises(InvalidRequest, match=f"bad.jsonl:2: .*{message}"):
        read_trace(str(path))


def test_an_id_under_two_parents_names_both_lines(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text('{"input_length": 600, "hash_ids": [1, 2]}\n{"input_length": 600, "hash_ids": [5, 2]}\n')
    with pytest.raises(InvalidRequest, match=r"t.jsonl:2: hash id 2 follows id 5 here but id 1 at .*t.jsonl:1"):
        read_trace(str(path))


def test_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(InvalidRequest, match="does not exist"):
        read_trace(str(tmp_path / "nope.jsonl"))


def test_blank_lines_are_skipped(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text('\n{"input_length": 5, "hash_ids": [9]}\n\n')
    assert len(read_trace(str(path))) == 1
