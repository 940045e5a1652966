"""The node's materialization snapshots (seed MaterializationSnapshot): per backend it offers, what it
would materialize a task with — its kind and architecture, a digest of its runtime (the Python that
runs a process group; the container engine's name, version and API), of its toolchain (this agent and
the libraries it drives the backend with) and of the artifacts it holds (image digests). Sent in every
Hello; a runtime that changed is told by the server, which rechecks the attempts assigned under the
old one. Computed from the backends' fingerprints; nothing here talks to an engine."""

from __future__ import annotations

import hashlib
import os
import platform
import sys
from importlib import metadata

from podium import __version__
from podium.agent.backends.base import Fingerprint
from podium.proto.podium.v1 import agent_pb2 as pb

# Test knob, read when a snapshot is made: words added to the process backend's runtime, so a test
# can restart an agent "on another runtime" without installing one.
RUNTIME_ENV = "PODIUM_TEST_AGENT_RUNTIME"


def digest(*parts: str) -> str:
    return "sha256:" + hashlib.sha256("\n".join(parts).encode()).hexdigest()


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "-"


def _toolchain(kind: str) -> str:
    libs = ["grpcio", "protobuf"] + (["docker"] if kind == "container" else [])
    return digest(f"podium {__version__}", *(f"{lib} {_version(lib)}" for lib in libs))


def _runtime(fp: Fingerprint) -> str:
    if fp.kind == "process":
        return digest(sys.implementation.name, platform.python_version(), platform.machine(), os.environ.get(RUNTIME_ENV, ""))
    # the engine's own words for what it is (name, version, API), as its fingerprint records them
    return digest(fp.kind, fp.detail)


def snapshots(fingerprints: dict[str, Fingerprint], arch: str) -> list[pb.MaterializationSnapshot]:
    """One snapshot per available backend, in kind order."""
    return [
        pb.MaterializationSnapshot(
            backend_kind=fp.kind, architecture=arch, runtime_digest=_runtime(fp), toolchain_digest=_toolchain(fp.kind),
            digest=digest(*fp.artifacts) if fp.artifacts else "",
        )
        for _kind, fp in sorted(fingerprints.items())
        if fp.available
    ]


def runtimes(fingerprints: dict[str, Fingerprint]) -> tuple[tuple[str, str], ...]:
    """(kind, runtime digest) of the available backends: a change is told with a new Hello."""
    return tuple((fp.kind, _runtime(fp)) for _k, fp in sorted(fingerprints.items()) if fp.available)
