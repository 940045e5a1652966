"""Parsing the human forms of sizes, CPU amounts and durations that specs and flags accept.

Every parser raises ValueError with a sentence that says what was wrong and what would be right;
pydantic turns that into the 422 an API client sees and the CLI prints it as one line.
"""

from __future__ import annotations

import math
import re

_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3, "kb": 10**3, "ki": 2**10, "kib": 2**10,
    "m": 10**6, "mb": 10**6, "mi": 2**20, "mib": 2**20,
    "g": 10**9, "gb": 10**9, "gi": 2**30, "gib": 2**30,
    "t": 10**12, "tb": 10**12, "ti": 2**40, "tib": 2**40,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")
_DURATION_RE = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h|d)")
_DURATION_UNITS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400}

MAX_BYTES = 2**62


def _kind_check(value: object, what: str, example: str) -> None:
    if not isinstance(value, (str, int, float)) or isinstance(value, bool):
        raise ValueError(f"{what} must be a number or a string like {example}, not {type(value).__name__}")


def parse_size(value: str | int | float) -> int:
    """`512Mi`, `2G`, `1.5GiB`, `1048576` → bytes."""
    _kind_check(value, "a size", "512Mi or 2G")
    if isinstance(value, bool):
        raise ValueError("a size must be a number of bytes or a string like 512Mi or 2G, not a boolean")
    if isinstance(value, (int, float)):
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"a size must be a non-negative number of bytes, got {value!r}")
        return _bounded(int(value), value)
    m = _SIZE_RE.match(str(value))
    if not m:
        raise ValueError(f"{value!r} is not a size; write bytes or a number with a unit, like 512Mi, 2G or 1048576")
    number, unit = m.groups()
    factor = _SIZE_UNITS.get(unit.lower())
    if factor is None:
        raise ValueError(
            f"{value!r} has an unknown unit {unit!r}; use one of K, M, G, T (powers of 1000) or Ki, Mi, Gi, Ti (powers of 1024)"
        )
    return _bounded(int(float(number) * factor), value)


def _bounded(n: int, original: object) -> int:
    if n > MAX_BYTES:
        raise ValueError(f"{original!r} is too large")
    return n


def parse_cpu(value: str | int | float) -> int:
    """Cores as a number (`0.5`, `2`) or millicores (`500m`) → millicores."""
    _kind_check(value, "CPU", "0.5 or 500m")
    if isinstance(value, bool):
        raise ValueError("CPU must be a number of cores like 0.5 or millicores like 500m, not a boolean")
    if isinstance(value, str):
        text = value.strip()
        try:
            millis = float(text[:-1]) if text.endswith("m") else float(text) * 1000
        except ValueError:
            raise ValueError(f"{value!r} is not a CPU amount; write cores like 0.5 or 2, or millicores like 500m") from None
    else:
        millis = float(value) * 1000
    if not math.isfinite(millis) or millis < 0:
        raise ValueError(f"CPU must be a non-negative amount, got {value!r}")
    if millis > 10**9:
        raise ValueError(f"{value!r} is more CPU than any machine has")
    return int(round(millis))


def parse_duration(value: str | int | float) -> float:
    """`30s`, `5m`, `1h30m`, `250ms`, or a number of seconds → seconds."""
    _kind_check(value, "a duration", "30s or 5m")
    if isinstance(value, bool):
        raise ValueError("a duration must be seconds or a string like 30s, 5m or 1h30m, not a boolean")
    if isinstance(value, (int, float)):
        seconds = float(value)
    else:
        text = value.strip().lower().replace(" ", "")
        try:
            seconds = float(text)
        except ValueError:
            pos, seconds = 0, 0.0
            for m in _DURATION_RE.finditer(text):
                if m.start() != pos:
                    break
                seconds += float(m.group(1)) * _DURATION_UNITS[m.group(2)]
                pos = m.end()
            if pos != len(text) or not text:
                raise ValueError(f"{value!r} is not a duration; write seconds or a string like 30s, 5m or 1h30m") from None
    if not math.isfinite(seconds) or seconds < 0:
        raise ValueError(f"a duration must be non-negative, got {value!r}")
    if seconds > 366 * 86400:
        raise ValueError(f"{value!r} is longer than a year")
    return seconds


def format_size(n: int) -> str:
    for unit, factor in (("Ti", 2**40), ("Gi", 2**30), ("Mi", 2**20), ("Ki", 2**10)):
        if n >= factor:
            v = n / factor
            return f"{v:.1f}{unit}" if v < 10 and v != int(v) else f"{int(round(v))}{unit}"
    return f"{n}B"


def format_cpu(millis: int) -> str:
    return f"{millis // 1000}" if millis % 1000 == 0 else f"{millis / 1000:g}"
