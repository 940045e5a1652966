"""The agent's backends: one interface (base.Backend, Nomad's driver verbs) and one file per way of
running a task (process.py: a process group; container.py: a container through the Docker Engine
API). Importing this package imports no backend's client library; pick a backend by importing its
module."""

from podium.agent.backends.base import (
    EGRESS_NONE,
    EGRESS_OPEN,
    FAILURE_CANCELLED,
    FAILURE_CLASSES,
    FAILURE_EXIT,
    FAILURE_INTERNAL,
    FAILURE_NODE_LOST,
    FAILURE_NOT_ACCEPTED,
    FAILURE_OOM,
    FAILURE_PROVISIONING,
    FAILURE_TIMEOUT,
    Backend,
    ExitResult,
    Fingerprint,
    Handle,
    OutputSink,
    Recovered,
    RegistryAuth,
    ReleaseProof,
    RunSpec,
    StartFailed,
)

__all__ = [
    "EGRESS_NONE",
    "EGRESS_OPEN",
    "FAILURE_CANCELLED",
    "FAILURE_CLASSES",
    "FAILURE_EXIT",
    "FAILURE_INTERNAL",
    "FAILURE_NODE_LOST",
    "FAILURE_NOT_ACCEPTED",
    "FAILURE_OOM",
    "FAILURE_PROVISIONING",
    "FAILURE_TIMEOUT",
    "Backend",
    "ExitResult",
    "Fingerprint",
    "Handle",
    "OutputSink",
    "Recovered",
    "RegistryAuth",
    "ReleaseProof",
    "RunSpec",
    "StartFailed",
]
