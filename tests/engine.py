"""A real container engine for the suite: podman's Docker-compatible service, started once per test
session in a temporary directory of its own, and the test image `localhost/busybox:test`.

How podman runs here (the host has a mixed cgroup v1/v2 layout that stops the OCI runtime as is):
the service runs in private mount and PID namespaces. First choice is cgroups enabled with the
cgroupfs manager, so CPU and memory limits are enforced: on a host with the v1 memory controller
mounted, the (controller-less) cgroup2 `unified` mount is hidden, leaving a plain v1 layout; on a pure
cgroup2 host with the memory controller, nothing is changed. If a probe container does not run that
way, the documented recipe follows: a pure cgroup2 mount with cgroups disabled, where limits are NOT
enforced (the engine's info then says MemoryLimit=false, and the container backend reports it).

Nothing outlives the session: the service is PID 1 of its own PID namespace, the `unshare` holding it
dies with the test process (PR_SET_PDEATHSIG) and takes the namespace with it (--kill-child), so even
a crashed session leaves no podman service or container behind. Storage, run and temp directories
are the session's own, so runs never share state.

PODIUM_TEST_ENGINE_CGROUPS=disabled runs the recipe only (to see the suite on an engine without
limits). PODIUM_TEST_CONTAINER_HOST=unix:///… uses an engine that is already running instead (Docker Engine
in CI, say). Under CI=true a missing engine fails the tests that need it; elsewhere they are skipped
with the reason.
"""

from __future__ import annotations

import contextlib
import ctypes
import io
import json
import os
import shutil
import signal
import subprocess
import tarfile
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import pytest

TEST_IMAGE = "localhost/busybox:test"
BUSYBOX = Path("/bin/busybox")  # from Debian's busybox-static: no shared libraries to carry along
START_TIMEOUT = 60.0  # seconds for the service to answer a ping
STOP_TIMEOUT = 15.0  # seconds for the service to exit on SIGTERM before the namespace is killed
_TMP_PREFIX = "podium-engine-"
_PR_SET_PDEATHSIG = 1


@dataclass
class Engine:
    """A running engine: its API URL, a client, and what it can enforce."""

    url: str
    client: object  # docker.DockerClient
    enforces_limits: bool
    mode: str  # how podman runs here, for skip messages and reports
    notes: list[str] = field(default_factory=list)  # what was tried and why it was not used

    @property
    def limits_reason(self) -> str:
        return f"limits not enforced by this engine ({self.mode}): " + "; ".join(self.notes or ["-"])


class EngineUnavailable(Exception):
    pass


def _pdeathsig() -> None:  # in the child between fork and exec: the service dies with the tests
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def _cgroup_modes() -> list[tuple[str, bool, str]]:
    """(name, cgroups enabled, shell prelude in the private mount namespace) to try, most capable
    first."""
    recipe = ("pure cgroup2 mount, cgroups disabled", False, "umount -l /sys/fs/cgroup && mount -t cgroup2 none /sys/fs/cgroup && ")
    if os.environ.get("PODIUM_TEST_ENGINE_CGROUPS") == "disabled":
        return [recipe]  # to run the suite the way an engine without limits runs it
    modes = []
    fs = Path("/sys/fs/cgroup")
    v2_controllers = (fs / "cgroup.controllers").read_text().split() if (fs / "cgroup.controllers").exists() else []
    if "memory" in v2_controllers and "cpu" in v2_controllers:
        modes.append(("cgroup2, cgroupfs", True, ""))
    elif (fs / "memory" / "memory.limit_in_bytes").exists() and (fs / "cpu").exists():
        # hide the controller-less cgroup2 mount of the hybrid layout: crun then sees plain cgroups v1
        modes.append(("cgroups v1, cgroupfs", True, "umount -l /sys/fs/cgroup/unified 2>/dev/null || true; "))
    modes.append(recipe)  # the documented recipe: runs anywhere here, enforces nothing
    return modes


def _image_tar() -> bytes:
    """An empty root with /bin/busybox and a symlink per applet (sh, echo, sleep, cat, nc, …)."""
    applets = subprocess.run([str(BUSYBOX), "--list"], capture_output=True, text=True, check=True).stdout.split()
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        data = BUSYBOX.read_bytes()
        for d in ("bin", "tmp"):
            ti = tarfile.TarInfo(d)
            ti.type, ti.mode = tarfile.DIRTYPE, 0o1777 if d == "tmp" else 0o755
            tar.addfile(ti)
        ti = tarfile.TarInfo("bin/busybox")
        ti.size, ti.mode = len(data), 0o755
        tar.addfile(ti, io.BytesIO(data))
        for name in applets:
            if name == "busybox" or "/" in name:
                continue
            ti = tarfile.TarInfo(f"bin/{name}")
            ti.type, ti.linkname = tarfile.SYMTYPE, "busybox"
            tar.addfile(ti)
    return buf.getvalue()


def build_test_image(client: object) -> str:
    """Import the busybox root through the Docker API and tag it TEST_IMAGE; return its id."""
    api = client.api  # type: ignore[attr-defined]
    out = api.import_image_from_data(_image_tar(), repository="localhost/busybox", tag="test")
    # podman's compat import ignores the tag it is given: tag the imported id explicitly
    image_id = json.loads(out.strip().splitlines()[-1])["id"] if isinstance(out, str) else out["status"]
    api.tag(image_id, "localhost/busybox", "test")
    api.inspect_image(TEST_IMAGE)
    return str(image_id)


class PodmanService:
    """One `podman system service` in its own namespaces and directories."""

    def __init__(self, base: Path, mode: tuple[str, bool, str]) -> None:
        self.base = base
        self.mode_name, cgroups, prelude = mode
        self.sock = base / "podman.sock"
        self.url = f"unix://{self.sock}"
        (base / "libpod").mkdir(parents=True, exist_ok=True)
        (base / "networks").mkdir(exist_ok=True)
        # the engine's scratch (exit files, events, network config) stays in this run's directory too
        conf = ['[containers]', 'default_ulimits = ["nofile=1024:1024", "nproc=1024:1024"]']
        conf += [] if cgroups else ['cgroups = "disabled"']
        conf += ["[engine]", f'tmp_dir = "{base}/libpod"']
        conf += ['cgroup_manager = "cgroupfs"'] if cgroups else []
        conf += ["[network]", f'network_config_dir = "{base}/networks"']
        (base / "containers.conf").write_text("\n".join(conf) + "\n")
        # Docker Engine speaks plain http to a registry on loopback by default; podman only to one
        # listed as insecure. A location is a prefix ending at ':', so these cover every port: the
        # suite's registries (tests/registry.py) listen on 127.0.0.1.
        self.registries_conf = base / "registries.conf"
        self.registries_conf.write_text(
            '[[registry]]\nlocation = "127.0.0.1"\ninsecure = true\n\n[[registry]]\nlocation = "localhost"\ninsecure = true\n'
        )
        self.log_path = base / "service.log"
        podman = shutil.which("podman") or "podman"
        script = (
            f"{prelude}exec {podman} --root {base}/storage --runroot {base}/run "
            f"system service --time=0 {self.url}"
        )
        env = dict(os.environ, CONTAINERS_CONF=str(base / "containers.conf"), CONTAINERS_REGISTRIES_CONF=str(self.registries_conf))
        env.pop("CONTAINER_HOST", None)
        env.pop("DOCKER_HOST", None)
        with open(self.log_path, "wb") as logf:
            # the service is PID 1 of a fresh PID namespace: when it or `unshare` dies, so does every
            # conmon and container it started
            self.proc = subprocess.Popen(
                ["unshare", "--mount", "--propagation", "private", "--pid", "--fork", "--mount-proc",
                 "--kill-child=SIGKILL", "sh", "-c", script],  # fmt: skip
                stdin=subprocess.DEVNULL,
                stdout=logf,
                stderr=subprocess.STDOUT,
                env=env,
                # conmon writes its marker files (e.g. `oom`) into the service's working directory
                cwd=base,
                preexec_fn=_pdeathsig,
            )
        (base / "owner.pid").write_text(f"{os.getpid()}\n")

    def log_tail(self) -> str:
        with contextlib.suppress(OSError):
            return self.log_path.read_text(errors="replace")[-2000:]
        return ""

    def wait_ready(self) -> object:
        """A client once the service answers a ping (the SDK asks the API version on creation)."""
        import docker

        deadline = time.monotonic() + START_TIMEOUT
        last: Exception | None = None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise EngineUnavailable(f"podman service exited ({self.proc.returncode}): {self.log_tail()}")
            if self.sock.exists():
                try:
                    client = docker.DockerClient(base_url=self.url, timeout=120)
                except docker.errors.DockerException as e:  # not up yet
                    last = e
                else:
                    if client.ping():
                        return client
                    client.close()
            time.sleep(0.05)
        raise EngineUnavailable(f"podman service did not answer within {START_TIMEOUT:g}s ({last}): {self.log_tail()}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            # SIGTERM to podman itself (the namespace's PID 1, our child's child) lets it clean up;
            # unshare ignores SIGTERM, and killing it kills the whole namespace
            with contextlib.suppress(psutil.Error):
                for child in psutil.Process(self.proc.pid).children():
                    child.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _remove_stale_dirs() -> None:
    """Directories of earlier sessions that crashed (their owner is gone): their services died with
    them, only files remain."""
    for d in Path(tempfile.gettempdir()).glob(f"{_TMP_PREFIX}*"):
        try:
            owner = int((d / "owner.pid").read_text())
        except (OSError, ValueError):
            continue
        if not psutil.pid_exists(owner):
            shutil.rmtree(d, ignore_errors=True)


def _probe(client: object, limits: bool) -> None:
    """Run one container the way the tests will; raise with the engine's words if it cannot."""
    kw = {"mem_limit": 64 * 2**20, "nano_cpus": 500_000_000} if limits else {}
    # No network: the probe asks about limits. With one, podman 4.3's netavark sometimes fails the start
    # ("iptables: Chain already exists", its own teardown racing the setup), and that read as "this
    # mode cannot run containers": the next, limit-less mode was taken and the limit tests skipped.
    c = client.containers.create(TEST_IMAGE, ["true"], network_mode="none", **kw)  # type: ignore[attr-defined]
    try:
        c.start()
        code = c.wait(timeout=60)["StatusCode"]
        if code != 0:
            raise EngineUnavailable(f"a probe container exited {code}: {c.logs()!r}")
    finally:
        c.remove(force=True)


@contextlib.contextmanager
def running_engine() -> Iterator[Engine]:
    import docker  # the product's dependency; imported here so a broken install reads as a reason

    external = os.environ.get("PODIUM_TEST_CONTAINER_HOST")
    if external:
        client = docker.DockerClient(base_url=external)
        try:
            build_test_image(client)
            info = client.api.info()
            limits = bool(info.get("MemoryLimit")) and bool(info.get("CpuCfsQuota"))
            yield Engine(external, client, limits, f"external engine at {external}")
        finally:
            client.close()
        return

    missing = [p for p in ("podman", "unshare", "conmon") if shutil.which(p) is None]
    if not BUSYBOX.exists():
        missing.append(str(BUSYBOX) + " (busybox-static)")
    if missing:
        raise EngineUnavailable(f"not installed: {', '.join(missing)} (scripts/test installs them as root)")
    if os.geteuid() != 0:
        raise EngineUnavailable("the podman service needs root here (private mount namespaces)")
    _remove_stale_dirs()
    notes: list[str] = []
    for i, mode in enumerate(modes := _cgroup_modes()):
        base = Path(tempfile.mkdtemp(prefix=_TMP_PREFIX))
        svc = PodmanService(base, mode)
        client = None
        ok = False
        try:
            try:
                client = svc.wait_ready()
                build_test_image(client)
                info = client.api.info()
                limits = bool(info.get("MemoryLimit")) and bool(info.get("CpuCfsQuota"))
                _probe(client, limits)
            except Exception as e:
                notes.append(f"{svc.mode_name}: {e}")
                if i == len(modes) - 1:
                    raise EngineUnavailable("podman could not run a container: " + "; ".join(notes)) from e
                continue
            ok = True
            if not limits:
                notes.append("the engine's info reports MemoryLimit/CpuCfsQuota false")
            yield Engine(svc.url, client, limits, svc.mode_name, notes)
        finally:
            if client is not None:
                if ok:
                    with contextlib.suppress(Exception):
                        for c in client.containers.list(all=True):  # type: ignore[attr-defined]
                            c.remove(force=True)
                client.close()
            svc.stop()
            shutil.rmtree(base, ignore_errors=True)
        return


def unavailable(reason: str) -> None:
    """Fail under CI (a missing engine is a broken pipeline), skip with the reason elsewhere."""
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"container engine required under CI=true: {reason}", pytrace=False)
    pytest.skip(f"no container engine: {reason}")


@pytest.fixture(scope="session")
def engine() -> Iterator[Engine]:
    """The session's engine (started on first use, stopped at the end)."""
    try:
        cm = running_engine()
        eng = cm.__enter__()
    except EngineUnavailable as e:
        unavailable(str(e))
        raise  # unreachable: unavailable() raises
    try:
        yield eng
    finally:
        cm.__exit__(None, None, None)
