"""The store's jsonb codec (orjson, the standard library for what orjson refuses) in jsonb's binary
format (a version byte, then the text): what goes in comes back equal, including the JSON orjson
will not read, and a version it does not know is refused, not misread."""

from __future__ import annotations

import json

import pytest

from podium.store.db import _jsonb_decode, _jsonb_encode


def test_values_come_back_equal() -> None:
    value = {"name": "bench", "command": ["true"], "env": {"A": "ü \u2028 \"q\""}, "n": [0, -1, 2**62, 0.5, None, True]}
    data = _jsonb_encode(value)
    assert isinstance(data, bytes) and data[:1] == b"\x01"
    assert _jsonb_decode(data) == value == json.loads(data[1:])


def test_what_orjson_refuses_is_read_by_the_standard_library() -> None:
    # a lone surrogate escape is valid JSON (PostgreSQL's jsonb may hand it back), and so is a
    # number past a double: orjson refuses both, and the row must still be readable
    for text in ['"\\ud800"', '[1e400]']:
        assert _jsonb_decode(b"\x01" + text.encode()) == json.loads(text)


def test_an_unknown_format_version_is_refused() -> None:
    with pytest.raises(ValueError, match="version byte"):
        _jsonb_decode(b"\x02{}")
