"""The one header-block splitter (``queues.lib.header_end``), as the store, the
viewer and the reports use it."""

from __future__ import annotations

import itertools
import random

import pytest

from queues.bounce import dsn
from queues.lib import _HEADER_END, header_block, header_end, inspect_headers


@pytest.mark.parametrize(
    ("data", "block"),
    [
        (b"A: 1\r\nB: 2\r\n\r\nbody\r\n", b"A: 1\r\nB: 2"),
        (b"A: 1\nB: 2\n\nbody\n", b"A: 1\nB: 2"),  # LF alone is a line end too
        (b"A: 1\r\n\r\n", b"A: 1"),
        (b"A: 1\r\n", b"A: 1"),  # all header, with a final line end
        (b"A: 1", b"A: 1"),  # all header, without one
        (b"", b""),
        (b"\r\nbody\r\n\r\nmore", b""),  # starts with the empty line: no header fields
        (b"\r\n\r\nbody", b""),
    ],
)
def test_the_header_block_ends_at_the_first_empty_line(data, block):
    assert header_block(data) == block
    assert header_end(data) == len(block)
    assert inspect_headers(data).header_bytes == len(block)
    # A report returns the same fields, each line ending in CRLF.
    expected = block.replace(b"\r\n", b"\n").replace(b"\n", b"\r\n")
    returned = dsn.header_block_in(data, whole=True)
    assert returned == (expected + b"\r\n" if expected else b"")


def test_a_body_after_an_empty_first_line_is_not_read_as_headers():
    info = inspect_headers(b"\r\nSubject: not a header\r\nReceived: nor this\r\n\r\nx")
    assert (info.subject, info.received_count) == ("", 0)


def _by_definition(data: bytes) -> int:
    match = _HEADER_END.search(data)
    return match.start() if match else len(data)


def test_header_end_finds_what_its_regular_expression_defines():
    # header_end searches bytes instead of running _HEADER_END: every string of
    # up to 7 pieces of CR, LF, CRLF, a blank and a letter, and random longer ones.
    pieces = [b"\r", b"\n", b"\r\n", b" ", b"a"]
    cases = [b"".join(p) for n in range(8) for p in itertools.product(pieces, repeat=n)]
    rnd = random.Random(24)
    cases += [bytes(rnd.choice(b"\r\na:") for _ in range(rnd.randint(0, 40))) for _ in range(20000)]
    for data in cases:
        assert header_end(data) == _by_definition(data), data
        assert header_end(bytearray(data)) == _by_definition(data), data
