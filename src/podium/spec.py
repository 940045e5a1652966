"""What a task asks for: the spec an operator submits, validated once at the edge.

Specs are stored as the JSON of the validated model, so what a node receives is what was accepted.
Every validator raises ValueError with a sentence naming what was wrong and how to fix it; the API
turns these into 422 responses that name the field.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    WithJsonSchema,
    field_serializer,
    field_validator,
    model_validator,
)  # fmt: skip

from podium.images import parse_image
from podium.units import parse_cpu, parse_duration, parse_size

_LABEL_KEY = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9_.\-/]{0,62}[A-Za-z0-9])?$")
_LABEL_VALUE = re.compile(r"^[A-Za-z0-9_.\-/:]{0,128}$")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,127}$")
#: The network egress a task may require: none at all, or an open network.
EGRESS_CONTEXTS = ("none", "open")

MAX_ATTEMPTS_LIMIT = 100
MAX_BATCH = 1000  # tasks in one batch submission
DEFAULT_MAX_ATTEMPTS = 3


def _millis(v: Any) -> int:
    return parse_cpu(v)


def _bytes(v: Any) -> int:
    return parse_size(v)


def _seconds(v: Any) -> float | None:
    return None if v is None else parse_duration(v)


# The JSON schema says what is accepted (a number or a string with a unit), not the parsed type.
_NUMBER_OR_TEXT = {"anyOf": [{"type": "number", "minimum": 0}, {"type": "string", "maxLength": 64}]}
CpuMillis = Annotated[int, BeforeValidator(_millis), WithJsonSchema({**_NUMBER_OR_TEXT, "description": "cores (0.5) or millicores (500m)"})]
Bytes = Annotated[int, BeforeValidator(_bytes), WithJsonSchema({**_NUMBER_OR_TEXT, "description": "bytes, or 512Mi / 2G"})]
Seconds = Annotated[
    float | None,
    BeforeValidator(_seconds),
    WithJsonSchema({"anyOf": [*_NUMBER_OR_TEXT["anyOf"], {"type": "null"}], "description": "seconds, or 30s / 5m / 1h30m"}),
]


def validate_labels(labels: dict[str, str], what: str = "label") -> dict[str, str]:
    if len(labels) > 64:
        raise ValueError(f"at most 64 {what}s are allowed, got {len(labels)}")
    for k, v in labels.items():
        if not _LABEL_KEY.match(k):
            raise ValueError(
                f"{what} key {k!r} is not valid; use letters, digits, '-', '_', '.', '/' (1-64 characters, "
                "starting and ending with a letter or digit)"
            )
        if not isinstance(v, str) or not _LABEL_VALUE.match(v):
            raise ValueError(f"{what} {k}={v!r} has an invalid value; use up to 128 letters, digits or -_.:/")
    return labels


def validate_name(v: str, what: str = "name") -> str:
    if not _NAME.match(v):
        raise ValueError(f"{what} {v!r} is not valid; use letters, digits, '-', '_', '.' (up to 128, starting with a letter or digit)")
    return v


def parse_label_pairs(pairs: list[str]) -> dict[str, str]:
    """`["gpu=a100", "zone=eu-1"]` → dict, for CLI flags."""
    out: dict[str, str] = {}
    for p in pairs:
        if "=" not in p:
            raise ValueError(f"label {p!r} must be written key=value")
        k, v = p.split("=", 1)
        out[k.strip()] = v.strip()
    return validate_labels(out)


class ResourceSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    cpu: CpuMillis = Field(default=100, description="CPU in millicores; accepts 0.5, 2 or 500m")
    memory: Bytes = Field(default=64 * 2**20, description="memory in bytes; accepts 512Mi, 2G or plain bytes")
    disk: Bytes = Field(default=0, description="scratch disk in bytes; accepts 10Gi, 500M or plain bytes")
    gpus: int = Field(default=0, ge=0, le=64)

    @field_serializer("cpu")
    def _cpu_out(self, v: int) -> str:
        # Stored and re-read specs must mean the same: a bare number would be read back as cores.
        return f"{v}m"


class SecretRef(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(description="the secret's name, as stored with `podium secret set`")
    env: str = Field(description="the environment variable the value becomes on the node")

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not _NAME.match(v):
            raise ValueError(f"secret name {v!r} is not valid; use letters, digits, '-', '_', '.'")
        return v

    @field_validator("env")
    @classmethod
    def _env(cls, v: str) -> str:
        if not _ENV_NAME.match(v):
            raise ValueError(f"{v!r} is not a valid environment variable name")
        return v


class TaskSpec(BaseModel):
    """A task: a command (process backend) or an image (container backend), and what it needs."""

    model_config = ConfigDict(extra="forbid")

    name: str | None = Field(default=None, max_length=128)
    backend: Literal["process", "container"] = "process"
    command: list[str] = Field(default_factory=list, max_length=4096)
    image: str | None = Field(default=None, max_length=512)
    env: dict[str, str] = Field(default_factory=dict)
    resources: ResourceSpec = Field(default_factory=ResourceSpec)
    labels: dict[str, str] = Field(default_factory=dict, description="every label here must be carried by the node")
    pool: str | None = Field(default=None, max_length=64)
    arch: str | None = Field(default=None, max_length=32)
    capabilities: list[str] = Field(default_factory=list, max_length=64)
    protocol: int = Field(default=1, ge=1, le=1000)
    preferred_artifacts: list[str] = Field(default_factory=list, max_length=64)
    home_node: str | None = Field(default=None, max_length=128)
    timeout: Seconds = Field(default=None, description="seconds, or 30s / 5m / 1h30m; none means no limit")
    max_attempts: int = Field(default=DEFAULT_MAX_ATTEMPTS, ge=1, le=MAX_ATTEMPTS_LIMIT)
    requeue_on_node_loss: bool = True
    priority: int = Field(default=0, ge=-1000, le=1000)
    secrets: list[SecretRef] = Field(default_factory=list, max_length=64)
    egress: Literal["none", "open"] | None = Field(
        default=None, description="the network the task needs: none (no network at all) or open; leave it out for no requirement"
    )

    @field_validator("command")
    @classmethod
    def _command(cls, v: list[str]) -> list[str]:
        for arg in v:
            if "\x00" in arg:
                raise ValueError("command arguments may not contain NUL bytes")
        if sum(len(a) for a in v) > 256 * 1024:
            raise ValueError("the command is longer than 256 KiB")
        return v

    @field_validator("env")
    @classmethod
    def _env(cls, v: dict[str, str]) -> dict[str, str]:
        if len(v) > 512:
            raise ValueError("at most 512 environment variables are allowed")
        for k, val in v.items():
            if not _ENV_NAME.match(k):
                raise ValueError(f"{k!r} is not a valid environment variable name")
            if "\x00" in val:
                raise ValueError(f"environment variable {k} may not contain NUL bytes")
        return v

    @field_validator("labels")
    @classmethod
    def _labels(cls, v: dict[str, str]) -> dict[str, str]:
        return validate_labels(v)

    @field_validator("name", "pool", "home_node")
    @classmethod
    def _names(cls, v: str | None) -> str | None:
        if v is not None and not _NAME.match(v):
            raise ValueError(f"{v!r} is not valid; use letters, digits, '-', '_', '.' (up to 128, starting with a letter or digit)")
        return v

    @field_validator("capabilities")
    @classmethod
    def _caps(cls, v: list[str]) -> list[str]:
        for c in v:
            if not _NAME.match(c):
                raise ValueError(f"capability {c!r} is not valid; use letters, digits, '-', '_', '.'")
        return sorted(set(v))

    @field_validator("image")
    @classmethod
    def _image(cls, v: str | None) -> str | None:
        if v is not None:
            try:
                parse_image(v)
            except ValueError as e:
                # images.parse_image names the part that is wrong; the example says how to write one
                what = str(e).removeprefix(f"image {v!r}: ")
                raise ValueError(
                    f"{v!r} is not an image reference: {what}; write it like registry.example.com/team/app:1.4, "
                    "busybox, or app@sha256:<digest>"
                ) from None
        return v

    @field_validator("timeout")
    @classmethod
    def _timeout(cls, v: float | None) -> float | None:
        if v is not None and v <= 0:
            raise ValueError("timeout must be positive; leave it out for no limit")
        return v

    @model_validator(mode="after")
    def _backend_fields(self) -> TaskSpec:
        if self.backend == "process":
            if not self.command:
                raise ValueError("a process task needs a command: a non-empty list of arguments")
            if self.image is not None:
                raise ValueError("image is only for the container backend; set backend to container or drop image")
            if self.egress == "none":
                raise ValueError(
                    "egress none is only for the container backend: a process cannot be cut off from the network; "
                    "use an image (backend container) or drop egress"
                )
        elif not self.image:
            raise ValueError("a container task needs an image")
        envs = [s.env for s in self.secrets]
        if len(envs) != len(set(envs)):
            raise ValueError("two secrets are mapped to the same environment variable")
        return self


def image_digest(image: str) -> str | None:
    """The digest an image reference is already pinned to (`app@sha256:…`), or None for a tag."""
    try:
        return parse_image(image).digest
    except ValueError:
        return None


def pinned_image(image: str, digest: str) -> str:
    """The reference that can only ever mean one image: the repository at `digest`, its tag dropped
    (an engine would ignore the tag beside a digest anyway; leaving it out says so). The name is
    kept as the user wrote it (`busybox`, not docker.io/library/busybox)."""
    parse_image(image)  # a ValueError naming what is wrong
    rest = image.partition("@")[0]
    colon = rest.rfind(":")  # the tag's ":" follows the last "/"; one before it is a registry's port
    name = rest[:colon] if colon > rest.rfind("/") else rest
    return f"{name}@{digest}"


class SubmitRequest(TaskSpec):
    """A spec plus how to submit it. A retried submission with the same idempotency key returns the
    task the first one created instead of making a second."""

    idempotency_key: str | None = Field(default=None, min_length=1, max_length=200)

    def task_spec(self) -> TaskSpec:
        # Every field was validated already, by TaskSpec's own validators (this class adds only the
        # key): the same values make a valid TaskSpec without validating them again, which cost 31.9
        # µs a task of the ~55 the API's own steps took for a batch, measured alone (issue 17).
        return TaskSpec.model_construct(self.model_fields_set - {"idempotency_key"}, **{k: getattr(self, k) for k in TaskSpec.model_fields})
