import pytest

from podium.units import parse_cpu, parse_duration, parse_size


@pytest.mark.parametrize(
    "text,expected",
    [("512Mi", 512 * 2**20), ("2G", 2 * 10**9), ("1.5Gi", int(1.5 * 2**30)), ("1048576", 1048576), (4096, 4096), ("10KiB", 10240)],
)
def test_sizes(text: object, expected: int) -> None:
    assert parse_size(text) == expected  # type: ignore[arg-type]


@pytest.mark.parametrize("text", ["12XB", "-1", "lots", "", "1e400", True])
def test_bad_sizes_say_how_to_fix(text: object) -> None:
    with pytest.raises(ValueError) as e:
        parse_size(text)  # type: ignore[arg-type]
    assert str(e.value)


@pytest.mark.parametrize("text,expected", [("500m", 500), ("0.5", 500), (2, 2000), ("2", 2000), (0.25, 250)])
def test_cpu(text: object, expected: int) -> None:
    assert parse_cpu(text) == expected  # type: ignore[arg-type]


@pytest.mark.parametrize("text,expected", [("30s", 30), ("5m", 300), ("1h30m", 5400), ("250ms", 0.25), (12, 12), ("1.5", 1.5)])
def test_durations(text: object, expected: float) -> None:
    assert parse_duration(text) == expected  # type: ignore[arg-type]


@pytest.mark.parametrize("text", ["5 minutes", "m5", "-3s", "", "1y"])
def test_bad_durations(text: str) -> None:
    with pytest.raises(ValueError, match="duration|non-negative"):
        parse_duration(text)
