import pytest
from pydantic import ValidationError

from podium.spec import SubmitRequest, TaskSpec


def test_spec_round_trips_through_its_stored_json() -> None:
    spec = TaskSpec(command=["true"], resources={"cpu": "500m", "memory": "1Gi"}, timeout="1m30s")
    again = TaskSpec.model_validate_json(spec.model_dump_json())
    assert again == spec
    assert again.resources.cpu == 500 and again.resources.memory == 2**30 and again.timeout == 90


@pytest.mark.parametrize(
    "body,field,words",
    [
        ({"command": []}, "", "needs a command"),
        ({"command": ["x"], "resources": {"memory": "12XB"}}, "resources.memory", "unknown unit"),
        ({"command": ["x"], "labels": {"bad key!": "v"}}, "labels", "not valid"),
        ({"command": ["x"], "max_attempts": 0}, "max_attempts", "greater than or equal to 1"),
        ({"command": ["x"], "timeout": "soon"}, "timeout", "not a duration"),
        ({"command": ["x"], "bogus": 1}, "bogus", "Extra inputs"),
        ({"command": ["x"], "env": {"1X": "y"}}, "env", "not a valid environment variable"),
        ({"backend": "container"}, "", "needs an image"),
    ],
)
def test_bad_specs_name_the_field_and_the_problem(body: dict, field: str, words: str) -> None:
    with pytest.raises(ValidationError) as e:
        SubmitRequest.model_validate(body)
    errors = e.value.errors()
    locs = [".".join(str(p) for p in x["loc"]) for x in errors]
    assert any(loc.startswith(field) for loc in locs), locs
    assert any(words in x["msg"] for x in errors), errors


def test_idempotency_key_is_not_part_of_the_spec() -> None:
    req = SubmitRequest(command=["true"], idempotency_key="abc")
    assert "idempotency_key" not in req.task_spec().model_dump()
