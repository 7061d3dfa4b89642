"""Mooncake-format traces: parsing, partial last blocks, and clear errors naming the line."""

import os

import pytest

from kvstore.errors import InvalidRequest
from kvstore.trace import TraceRequest, read_trace, write_trace


def test_round_trip_and_partial_last_block(tmp_path):
    path = tmp_path / "t.jsonl"
    write_trace(str(path), [TraceRequest(1.5, 1100, 7, (1, 2, 3)), {"timestamp": 2, "input_length": 512, "hash_ids": [1]}])
    first, second = read_trace(str(path)).requests
    assert first == TraceRequest(1.5, 1100, 7, (1, 2, 3)) and second.hash_ids == (1,) and second.output_length == 0
    assert [first.block_tokens(i, 512) for i in range(3)] == [512, 512, 76]


@pytest.mark.parametrize("line, message", [
    ("not json", "not JSON"),
    ('{"input_length": 10}', r"not a trace request \(no hash_ids\); expected keys input_length and hash_ids"),
    ('{"timestamp": 3}', r"not a trace request \(no input_length and no hash_ids\)"),
    ('{"timestamp": "noon", "input_length": 5, "hash_ids": [1]}', 'timestamp "noon" is not a number'),
    ('{"timestamp": 1' + "0" * 400 + ', "input_length": 5, "hash_ids": [1]}',
     r"timestamp 10{19}\.\.\. is too large for a number of milliseconds"),
    ('{"input_length": 10, "hash_ids": [-1]}', "non-negative"),
    ('{"input_length": 512, "hash_ids": [1, 2]}', "input_length 512 leaves the last of 2 hash ids without a token "
     r"at 512 tokens a block \(they need more than 512\); check that --block-tokens \(512\) is the trace's block size"),
    ('{"timestamp": NaN, "input_length": 5, "hash_ids": [1]}', "timestamp must be a finite number, got nan"),
    ('[1, 2]', "a JSON list"),
    ('{"input_length": 5, "hash_ids": "12"}', "hash_ids is a JSON string, not a list of block ids"),
    ('{"input_length": 5, "hash_ids": 12}', "hash_ids is a JSON number, not a list"),
    ('{"input_length": 1024.7, "hash_ids": [1, 2]}', "input_length 1024.7 is not a whole number"),
    ('{"input_length": true, "hash_ids": [1]}', "input_length true is not a whole number"),
    ('{"input_length": 5, "output_length": "7", "hash_ids": [1]}', 'output_length "7" is not a whole number'),
    ('{"input_length": 5, "hash_ids": [Infinity]}', "a hash id Infinity is not a whole number"),
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


def test_an_id_holding_two_token_counts_names_both_lines(tmp_path):
    """Block 2 is a partial last block of 88 tokens on line 1 and a full one on line 2: a hit on
    line 2 would count 512 tokens the store never held for it (the replay counted 1024 of 1024)."""
    path = tmp_path / "t.jsonl"
    path.write_text('{"input_length": 600, "hash_ids": [1, 2]}\n{"input_length": 1024, "hash_ids": [1, 2]}\n')
    with pytest.raises(InvalidRequest, match=r"t.jsonl:2: hash id 2 holds 512 tokens here but 88 at .*t.jsonl:1 "
                                             r"\(at 512 tokens a block\); a partial last block and the block"):
        read_trace(str(path))


def test_a_partial_last_block_may_return_partial_and_a_full_one_under_an_unhashed_tail(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text('{"input_length": 600, "hash_ids": [1, 2]}\n{"input_length": 600, "hash_ids": [1, 2]}\n'
                    '{"input_length": 1500, "hash_ids": [1, 3]}\n{"input_length": 1024, "hash_ids": [1, 3]}\n')
    assert len(read_trace(str(path)).requests) == 4


def test_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(InvalidRequest, match="does not exist"):
        read_trace(str(tmp_path / "nope.jsonl"))


def test_blank_lines_are_skipped(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text('\n{"input_length": 5, "hash_ids": [9]}\n\n')
    assert len(read_trace(str(path)).requests) == 1


LINES = ('{"timestamp": 1, "input_length": 600, "hash_ids": [1, 2]}\n'
         '{"timestamp": 2, "input_length": 512, "hash_ids": [1]}\n')


def test_a_gzip_trace_is_read_as_the_text_it_holds(tmp_path):
    """Before, a .gz trace crashed with a UnicodeDecodeError traceback."""
    import gzip

    plain, packed = tmp_path / "t.jsonl", tmp_path / "t.jsonl.gz"
    plain.write_text(LINES)
    packed.write_bytes(gzip.compress(LINES.encode()))
    requests = read_trace(str(plain)).requests
    assert read_trace(str(packed)).requests == requests and len(requests) == 2


@pytest.mark.parametrize("compressed", [False, True])
def test_a_trace_is_read_whole_from_a_pipe(compressed):
    """A pipe (``<(zcat ...)``, /dev/stdin) cannot be read twice: looking for gzip's magic must not
    lose its first bytes (it did: line 1 was then 'not JSON')."""
    import gzip

    data = gzip.compress(LINES.encode()) if compressed else LINES.encode()
    read_end, write_end = os.pipe()
    try:
        os.write(write_end, data)  # fits the pipe's buffer
        os.close(write_end)
        requests = read_trace(f"/dev/fd/{read_end}").requests
    finally:
        os.close(read_end)
    assert len(requests) == 2 and requests[0].hash_ids == (1, 2)


def test_a_utf8_byte_order_mark_is_skipped(tmp_path):
    """Before, the BOM refused the whole trace as 'not JSON'."""
    path = tmp_path / "t.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + LINES.encode())
    assert [r.hash_ids for r in read_trace(str(path)).requests] == [(1, 2), (1,)]


@pytest.mark.parametrize("line, message", [
    (b'{"input_length": 5, "hash_ids": [9], "note": "caf\xe9"}', r"not UTF-8 text \(byte 0xe9 at column 50\)"),
    (b'{"input_length": 5, "hash_ids": [' + b"7" * 5000 + b"]}", r"a number too large to read .*2\*\*128"),
    (b"[" * 100_000, r"not a trace request \(JSON nested too deeply\)"),
])
def test_unreadable_text_and_numbers_name_the_file_and_line(tmp_path, line, message):
    """Before, these raised UnicodeDecodeError, ValueError and RecursionError: tracebacks."""
    path = tmp_path / "bad.jsonl"
    path.write_bytes(b'{"input_length": 5, "hash_ids": [9]}\n' + line + b"\n")
    with pytest.raises(InvalidRequest, match=f"bad.jsonl:2: {message}"):
        read_trace(str(path))


def test_a_damaged_gzip_file_names_the_file(tmp_path):
    import gzip

    path = tmp_path / "t.jsonl.gz"
    path.write_bytes(gzip.compress(LINES.encode() * 50)[:-30])
    with pytest.raises(InvalidRequest, match=r"t.jsonl.gz: damaged gzip data .*gzip -t"):
        read_trace(str(path))


def test_requests_come_in_timestamp_order_equal_ones_in_file_order(tmp_path):
    """Before, a trace out of timestamp order (merged logs) was replayed in file order, silently."""
    stamps = [5, 1, 5, 0, 1]
    path = tmp_path / "t.jsonl"
    write_trace(str(path), [{"timestamp": t, "input_length": 512, "hash_ids": [i]} for i, t in enumerate(stamps)])
    trace = read_trace(str(path))
    assert [r.hash_ids[0] for r in trace.requests] == [3, 1, 4, 0, 2]  # by time, ties as in the file
    assert trace.reordered_requests == 3  # stamped before 5, which came earlier
    path.write_text(LINES)
    assert read_trace(str(path)).reordered_requests == 0


def test_tokens_past_the_last_id_are_an_unhashed_tail(tmp_path):
    """A generator hashing only whole blocks leaves a tail past the last id. Before, such a line
    refused the whole trace; now it is read, counted, and the last block counts one block at most."""
    path = tmp_path / "t.jsonl"
    path.write_text('{"input_length": 1500, "hash_ids": [1, 4]}\n{"input_length": 40, "hash_ids": []}\n' + LINES)
    trace = read_trace(str(path))
    assert trace.unhashed_tail_requests == 2 and trace.requests[0].input_length == 1500
    assert [trace.requests[0].block_tokens(i, 512) for i in range(2)] == [512, 512]
