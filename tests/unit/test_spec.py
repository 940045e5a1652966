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
        ({"backend": "container", "image": "Team/App"}, "image", "not an image reference"),
        ({"backend": "container", "image": "app:"}, "image", "not an image reference"),
        ({"backend": "container", "image": "app@sha256:12"}, "image", "not an image reference"),
        ({"backend": "container", "image": "app", "egress": "closed"}, "egress", "'none' or 'open'"),
        ({"command": ["x"], "egress": "none"}, "", "egress none is only for the container backend"),
        ({"command": ["x"], "image": "busybox"}, "", "image is only for the container backend"),
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


def test_the_spec_of_a_submission_is_the_spec_its_fields_validate_to() -> None:
    # task_spec() reuses the fields the request validated: it must be exactly the TaskSpec that
    # validating them again gives, stored as the same JSON
    body = {"command": ["sh", "-c", "echo $A"], "name": "n-1", "env": {"X": "1"}, "labels": {"zone": "a"},
            "resources": {"cpu": "250m", "memory": "64Mi", "disk": "1Gi"}, "capabilities": ["b", "a", "a"],
            "timeout": "1m30s", "max_attempts": 2, "priority": 5, "secrets": [{"name": "db", "env": "A"}],
            "requeue_on_node_loss": False, "idempotency_key": "k"}  # fmt: skip
    spec = SubmitRequest.model_validate(body).task_spec()
    again = TaskSpec.model_validate({k: v for k, v in body.items() if k != "idempotency_key"})
    assert type(spec) is TaskSpec
    assert spec == again and spec.model_dump_json() == again.model_dump_json()
    assert spec.capabilities == ["a", "b"] and spec.timeout == 90 and spec.resources.memory == 64 * 2**20


@pytest.mark.parametrize(
    "image",
    ["busybox", "busybox:1.36", "library/busybox", "registry.example.com/team/app:1.4", "localhost:5000/app",
     "127.0.0.1:5000/a/b-c_d.e:v1.2-rc", "[::1]:5000/x:1", "app@sha256:" + "a" * 64, "app:tag@sha256:" + "b" * 64],
)
def test_good_image_references_are_accepted(image: str) -> None:
    spec = TaskSpec(backend="container", image=image)
    assert spec.image == image and spec.command == []


def test_egress_is_optional_and_open_is_fine_for_a_process() -> None:
    assert TaskSpec(command=["x"]).egress is None
    assert TaskSpec(command=["x"], egress="open").egress == "open"
    assert TaskSpec(backend="container", image="app", egress="none").egress == "none"


@pytest.mark.parametrize(
    "image,digest,pinned",
    [
        ("busybox", None, "busybox@sha256:" + "c" * 64),
        ("registry.example.com/team/app:1.4", None, "registry.example.com/team/app@sha256:" + "c" * 64),
        ("localhost:5000/app", None, "localhost:5000/app@sha256:" + "c" * 64),
        ("[::1]:5000/x:1", None, "[::1]:5000/x@sha256:" + "c" * 64),
        ("app:t@sha256:" + "b" * 64, "sha256:" + "b" * 64, "app@sha256:" + "c" * 64),
    ],
)
def test_an_image_is_pinned_to_its_repository_at_a_digest(image: str, digest: str | None, pinned: str) -> None:
    from podium.spec import image_digest, pinned_image

    assert image_digest(image) == digest
    assert pinned_image(image, "sha256:" + "c" * 64) == pinned
