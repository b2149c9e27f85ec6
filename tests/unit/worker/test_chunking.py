"""Token windows of overflow_policy chunk, and the chunk options' validation (shared by both doors)."""

from __future__ import annotations

import pytest

from protocol.errors import SIEError
from protocol.params import ChunkSpec, chunking
from worker.runtime.chunking import char_spans, windows, word_starts


@pytest.mark.parametrize(
    ("count", "size", "overlap"),
    [(0, 4, 1), (4, 4, 1), (5, 4, 1), (10, 4, 0), (100, 7, 3), (254, 254, 32), (300, 254, 32)],
)
def test_windows_cover_every_token_and_overlap(count, size, overlap):
    got = windows(count, size, overlap)
    assert got[0][0] == 0 and got[-1][1] == count
    assert all(0 < b - a <= size or count == 0 for a, b in got)
    for (a1, b1), (a2, _) in zip(got, got[1:], strict=False):
        assert a2 == b1 - overlap and a2 > a1


def test_windows_keep_to_word_boundaries_without_leaving_tokens_out():
    # words of 3 pieces: a word starts at every third token
    starts = [i % 3 == 0 for i in range(40)]
    got = windows(40, 10, 4, starts)
    assert got[0][0] == 0 and got[-1][1] == 40
    for a, b in got:
        assert b - a <= 10 and starts[a] and (b == 40 or starts[b])
    for (_, b1), (a2, _) in zip(got, got[1:], strict=False):
        assert a2 <= b1  # no gap
    # no word boundary in reach (one long word): plain windows
    assert windows(12, 4, 1, [i == 0 for i in range(12)]) == windows(12, 4, 1)
    # more windows than the limit: stops counting early
    assert len(windows(10_000, 8, 0, None, limit=5)) == 6


def test_char_spans_follow_token_offsets():
    text = "aa bb cc dd ee"
    offsets = [[0, 2], [3, 5], [6, 8], [9, 11], [12, 14]]
    assert word_starts(offsets) == [True] * 5
    assert word_starts([[0, 2], [2, 4], [5, 6]]) == [True, False, True]
    assert char_spans(text, offsets, windows(5, 2, 1)) == [(0, 5), (3, 8), (6, 11), (9, 14)]
    assert char_spans(text, offsets, windows(5, 5, 1)) == [(0, len(text))]


def test_chunk_options_are_checked():
    assert chunking({}, "encode") is None
    assert chunking({"overflow_policy": "chunk"}, "encode") == ChunkSpec()
    assert chunking(
        {
            "overflow_policy": "chunk",
            "chunking": "late",
            "chunk_size": 64,
            "chunk_overlap": 0,
            "chunk_pooling": "max",
        },
        "encode",
    ) == ChunkSpec(64, 0, "max", True)
    for bad, op in [
        ({"chunk_size": 4}, "encode"),
        ({"chunk_size": True}, "encode"),
        ({"chunk_overlap": -1}, "score"),
        ({"chunk_size": 16, "chunk_overlap": 16}, "encode"),
        ({"chunk_pooling": "sum"}, "encode"),
        ({"chunking": "late"}, "score"),
        ({}, "extract"),
        ({}, "tokenize"),
    ]:
        with pytest.raises(SIEError) as e:
            chunking({"overflow_policy": "chunk", **bad}, op)
        assert e.value.status == 400, bad
