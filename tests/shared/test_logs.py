"""The log line formats: text by default, one JSON object per line on request."""

from __future__ import annotations

import json
import logging

import pytest

from shared.logs import JsonFormatter, configure


def test_a_json_line_carries_time_level_logger_and_message():
    record = logging.LogRecord("sluice.access", logging.INFO, __file__, 1, "id %s", ("x",), None)
    line = json.loads(JsonFormatter().format(record))
    assert {key: line[key] for key in ("level", "logger", "message")} == {
        "level": "INFO",
        "logger": "sluice.access",
        "message": "id x",
    }
    assert line["time"]


def test_an_unknown_format_is_refused():
    with pytest.raises(ValueError, match="text, json"):
        configure("INFO", "xml")
