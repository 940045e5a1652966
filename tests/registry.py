"""A real image registry for the suite, and test images pushed to it without any container engine.

The registry is Debian's `docker-registry` (the CNCF distribution registry) on a free loopback port,
with htpasswd credentials, storage in a temporary directory, started once per session and stopped
at its end. Images are built here byte by byte (a gzip'd layer tar, its config JSON and a Docker
schema-2 manifest) and pushed through the registry HTTP API v2, so a test can move a tag to another
image whenever it needs to.

Under `CI=true` a missing `docker-registry` or `htpasswd` fails the tests that need it; elsewhere
they are skipped with the reason. `scripts/test` installs both (and busybox-static) when it can.

Its fixtures are registered suite-wide (tests/conftest.py, pytest_plugins).
This module must never leave a registry process running after the session.
"""

from __future__ import annotations

import base64
import datetime
import gzip
import hashlib
import io
import json
import os
import platform
import secrets
import shutil
import struct
import subprocess
import tarfile
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import NoReturn
from urllib.parse import parse_qs, urlsplit

import httpx
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import padding, rsa
from cryptography.x509.oid import NameOID

from tests.harness import free_port, wait_for

MANIFEST_V2 = "application/vnd.docker.distribution.manifest.v2+json"
CONFIG_V1 = "application/vnd.docker.container.image.v1+json"
LAYER_TAR_GZIP = "application/vnd.docker.image.rootfs.diff.tar.gzip"
BUSYBOX = Path("/bin/busybox")
#: The applets the busybox image links: what the container tests run.
BUSYBOX_APPLETS = ("sh", "echo", "sleep", "cat", "true", "false", "env", "ls")

_GOARCH = {"x86_64": "amd64", "aarch64": "arm64", "arm64": "arm64", "armv7l": "arm", "ppc64le": "ppc64le", "s390x": "s390x"}


def sha256_digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def missing_tool(what: str, how: str) -> NoReturn:
    """Fail under CI (the suite promises to test this for real there), skip elsewhere, saying why."""
    message = f"{what} is not available ({how}; scripts/test installs it when run as root with apt-get)"
    if os.environ.get("CI") == "true":
        pytest.fail(message)
    pytest.skip(message)


# --- images, built without an engine ------------------------------------------------------------------


@dataclass(frozen=True)
class Image:
    """A single-layer image as a registry stores it: blobs by digest and the manifest naming them."""

    layer: bytes  # gzip'd tar
    config: bytes
    manifest: bytes

    @property
    def digest(self) -> str:
        """The manifest digest: what a tag resolves to and what `image@sha256:…` pins."""
        return sha256_digest(self.manifest)

    def blobs(self) -> list[bytes]:
        return [self.layer, self.config]


def build_image(
    files: Mapping[str, bytes | tuple[bytes, int]],
    *,
    symlinks: Mapping[str, str] | None = None,
    cmd: tuple[str, ...] = ("sh",),
    env: Mapping[str, str] | None = None,
) -> Image:
    """An image whose only layer holds `files` (path → content, or (content, mode)) and `symlinks`
    (path → target). Byte-for-byte deterministic: the same arguments give the same digest, and any
    difference in content gives another."""
    entries: dict[str, tarfile.TarInfo] = {}
    contents: dict[str, bytes] = {}

    def add_parents(path: str) -> None:
        parts = path.split("/")[:-1]
        for i in range(1, len(parts) + 1):
            d = "/".join(parts[:i])
            if d and d not in entries:
                info = tarfile.TarInfo(d)
                info.type, info.mode = tarfile.DIRTYPE, 0o755
                entries[d] = info

    for raw, spec in files.items():
        path = raw.lstrip("/")
        data, mode = spec if isinstance(spec, tuple) else (spec, 0o644)
        add_parents(path)
        info = tarfile.TarInfo(path)
        info.size, info.mode = len(data), mode
        entries[path], contents[path] = info, data
    for raw, target in (symlinks or {}).items():
        path = raw.lstrip("/")
        add_parents(path)
        info = tarfile.TarInfo(path)
        info.type, info.linkname, info.mode = tarfile.SYMTYPE, target, 0o777
        entries[path] = info

    tar_bytes = io.BytesIO()
    with tarfile.open(fileobj=tar_bytes, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for path in sorted(entries):  # parents sort before their children
            info = entries[path]
            info.mtime, info.uid, info.gid, info.uname, info.gname = 0, 0, 0, "root", "root"
            tar.addfile(info, io.BytesIO(contents[path]) if path in contents else None)
    diff = tar_bytes.getvalue()
    layer = gzip.compress(diff, mtime=0)

    config = json.dumps(
        {
            "architecture": _GOARCH.get(platform.machine(), platform.machine()),
            "os": "linux",
            "config": {
                "Env": [f"{k}={v}" for k, v in {"PATH": "/bin", **(env or {})}.items()],
                "Cmd": list(cmd),
            },
            "rootfs": {"type": "layers", "diff_ids": [sha256_digest(diff)]},
            "history": [{"created_by": "podium tests"}],
        },
        sort_keys=True,
        separators=(",", ":"),
    ).encode()
    manifest = json.dumps(
        {
            "schemaVersion": 2,
            "mediaType": MANIFEST_V2,
            "config": {"mediaType": CONFIG_V1, "size": len(config), "digest": sha256_digest(config)},
            "layers": [{"mediaType": LAYER_TAR_GZIP, "size": len(layer), "digest": sha256_digest(layer)}],
        },
        indent=3,
    ).encode()
    return Image(layer=layer, config=config, manifest=manifest)


def busybox_image(note: str = "") -> Image:
    """/bin/busybox (busybox-static) with its applets linked in /bin, and /etc/podium-image holding
    `note`: two notes make two images with different digests."""
    if not BUSYBOX.is_file() or not _is_static_elf(BUSYBOX.read_bytes()):
        missing_tool("a statically linked /bin/busybox", "Debian: apt-get install busybox-static")
    files: dict[str, bytes | tuple[bytes, int]] = {
        "bin/busybox": (BUSYBOX.read_bytes(), 0o755),
        "etc/podium-image": note.encode(),
    }
    return build_image(files, symlinks={f"bin/{a}": "busybox" for a in BUSYBOX_APPLETS})


def note_image(note: str) -> Image:
    """A tiny image of one file: enough for a registry, nothing to run."""
    return build_image({"etc/podium-image": note.encode()})


def _is_static_elf(data: bytes) -> bool:
    """True for a 64-bit little-endian ELF with no PT_INTERP (no dynamic loader): it runs in an empty root."""
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        return False
    phoff, = struct.unpack_from("<Q", data, 0x20)
    phentsize, phnum = struct.unpack_from("<HH", data, 0x36)
    return all(struct.unpack_from("<I", data, phoff + i * phentsize)[0] != 3 for i in range(phnum))  # 3: PT_INTERP


# --- the registry -------------------------------------------------------------------------------------


class TokenService:
    """A Docker token service (the Bearer flow Docker Hub, GHCR and Harbor use) for a `docker-registry`
    configured with `auth.token`: the registry sends clients here with `WWW-Authenticate: Bearer
    realm=…,service=…,scope=…`, and accepts only JWTs signed with this service's key.

    With the right Basic credentials a token grants the scopes asked for; without any it is an
    anonymous token that grants nothing (the registry then refuses, as Docker Hub does for a private
    image); with wrong ones the answer is 401 in the registry's error format."""

    SERVICE = "podium-test-registry"
    ISSUER = "podium-test-token-service"

    def __init__(self, home: Path, user: str, password: str) -> None:
        self.home, self.user, self.password = home, user, password
        self.port = free_port()
        self._server: ThreadingHTTPServer | None = None
        self._key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        now = datetime.datetime.now(datetime.UTC)
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, self.ISSUER)])
        self._cert = (
            x509.CertificateBuilder()
            .subject_name(name)
            .issuer_name(name)
            .public_key(self._key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(hours=1))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(self._key, hashes.SHA256())
        )

    @property
    def realm(self) -> str:
        return f"http://127.0.0.1:{self.port}/token"

    def registry_config(self) -> dict[str, str]:
        bundle = self.home / "token-ca.pem"
        bundle.write_bytes(self._cert.public_bytes(serialization.Encoding.PEM))
        return {"realm": self.realm, "service": self.SERVICE, "issuer": self.ISSUER, "rootcertbundle": str(bundle)}

    def issue(self, subject: str, access: list[tuple[str, str, list[str]]]) -> str:
        """A signed JWT granting `access` ([(type, name, actions)]), the x5c header naming the key."""

        def b64url(data: bytes) -> str:
            return base64.urlsafe_b64encode(data).rstrip(b"=").decode()

        now = int(time.time())
        header = {"typ": "JWT", "alg": "RS256", "x5c": [base64.b64encode(self._cert.public_bytes(serialization.Encoding.DER)).decode()]}
        claims = {
            "iss": self.ISSUER, "sub": subject, "aud": self.SERVICE, "jti": secrets.token_hex(8),
            "iat": now - 10, "nbf": now - 10, "exp": now + 300,
            "access": [{"type": t, "name": n, "actions": a} for t, n, a in access],
        }
        signing_input = b64url(json.dumps(header).encode()) + "." + b64url(json.dumps(claims).encode())
        signature = self._key.sign(signing_input.encode(), padding.PKCS1v15(), hashes.SHA256())
        return f"{signing_input}.{b64url(signature)}"

    def start(self) -> TokenService:
        service = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - the name http.server calls
                query = parse_qs(urlsplit(self.path).query)
                supplied = self.headers.get("Authorization", "")
                subject, access = "", []
                if supplied:
                    expected = "Basic " + base64.b64encode(f"{service.user}:{service.password}".encode()).decode()
                    if supplied != expected:
                        self.reply(401, {"errors": [{"code": "UNAUTHORIZED", "message": "incorrect username or password"}]})
                        return
                    subject = service.user
                    for scope in query.get("scope", []):
                        kind, _, rest = scope.partition(":")
                        name, _, actions = rest.rpartition(":")
                        access.append((kind, name, actions.split(",")))
                self.reply(200, {"token": service.issue(subject, access)})

            def reply(self, status: int, body: object) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - http.server's name
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        threading.Thread(target=self._server.serve_forever, name="token-service", daemon=True).start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


@dataclass
class RegistryServer:
    """One `docker-registry serve` on 127.0.0.1. `auth` is "htpasswd" (Basic), "token" (Bearer tokens
    from a TokenService of its own, which takes the same user and password) or None (no auth)."""

    home: Path
    auth: str | None = "htpasswd"
    user: str = "podium-test"
    password: str = field(default_factory=lambda: secrets.token_urlsafe(12))
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None
    tokens: TokenService | None = None

    @property
    def host(self) -> str:
        """`127.0.0.1:PORT`: the registry part of an image reference."""
        return f"127.0.0.1:{self.port}"

    @property
    def credentials(self) -> tuple[str, str]:
        return (self.user, self.password)

    @property
    def log_path(self) -> Path:
        return self.home / "registry.log"

    def start(self) -> RegistryServer:
        binary = shutil.which("docker-registry")
        if binary is None:
            missing_tool("docker-registry", "Debian: apt-get install docker-registry")
        self.home.mkdir(parents=True, exist_ok=True)
        config: dict[str, object] = {
            "version": 0.1,
            "log": {"level": "info", "accesslog": {"disabled": True}},
            "storage": {"filesystem": {"rootdirectory": str(self.home / "storage")}},
            "http": {"addr": self.host, "secret": secrets.token_hex(16)},
        }
        if self.auth == "token":
            self.tokens = TokenService(self.home, self.user, self.password).start()
            config["auth"] = {"token": self.tokens.registry_config()}
        elif self.auth == "htpasswd":
            htpasswd = shutil.which("htpasswd")
            if htpasswd is None:
                missing_tool("htpasswd", "Debian: apt-get install apache2-utils")
            line = subprocess.run(
                [htpasswd, "-Bbn", self.user, self.password], check=True, capture_output=True
            ).stdout
            (self.home / "htpasswd").write_bytes(line)
            config["auth"] = {"htpasswd": {"realm": "podium-test", "path": str(self.home / "htpasswd")}}
        # JSON is YAML, and needs nothing but the standard library to write.
        (self.home / "config.yml").write_text(json.dumps(config))
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [binary, "serve", str(self.home / "config.yml")],
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            )
        expected = 401 if self.auth else 200

        def ready() -> bool:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(f"docker-registry exited with {self.proc.returncode}:\n{self.log_path.read_text()[-2000:]}")
            return httpx.get(f"http://{self.host}/v2/", timeout=2, trust_env=False).status_code == expected

        try:
            wait_for(ready, timeout=30, what=f"the registry on {self.host} to answer /v2/ with {expected}")
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        if self.tokens is not None:
            self.tokens.stop()
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)

    def unique_repo(self, prefix: str = "podium/test") -> str:
        """A repository no other test uses: tests share one registry and must not see each other's tags."""
        return f"{prefix}-{secrets.token_hex(4)}"

    def push(self, repository: str, tag: str, image: Image) -> str:
        """Upload the image's blobs (monolithically) and put its manifest under `tag`, moving the tag
        if it named another image. Returns the manifest digest the registry reports."""
        auth = self.credentials if self.auth == "htpasswd" else None
        headers = {}
        if self.tokens is not None:
            headers["Authorization"] = "Bearer " + self.tokens.issue(self.user, [("repository", repository, ["pull", "push"])])
        with httpx.Client(base_url=f"http://{self.host}", auth=auth, headers=headers, timeout=30, trust_env=False) as c:
            for blob in image.blobs():
                digest = sha256_digest(blob)
                if c.head(f"/v2/{repository}/blobs/{digest}").status_code == 200:
                    continue
                started = _expect(c.post(f"/v2/{repository}/blobs/uploads/"), 202)
                upload = c.base_url.join(started.headers["location"]).copy_merge_params({"digest": digest})
                _expect(c.put(upload, content=blob, headers={"Content-Type": "application/octet-stream"}), 201)
            put = _expect(
                c.put(f"/v2/{repository}/manifests/{tag}", content=image.manifest, headers={"Content-Type": MANIFEST_V2}),
                201,
            )
        digest = put.headers["docker-content-digest"]
        assert digest == image.digest, (digest, image.digest)
        return digest


def _expect(r: httpx.Response, status: int) -> httpx.Response:
    if r.status_code != status:
        raise AssertionError(f"{r.request.method} {r.request.url}: expected {status}, got {r.status_code}: {r.text[:500]}")
    return r


@pytest.fixture(scope="session")
def registry() -> Iterator[RegistryServer]:
    """The session's registry, with credentials (`registry.credentials`)."""
    home = Path(tempfile.mkdtemp(prefix="podium-test-registry-"))
    server = RegistryServer(home)
    try:
        yield server.start()
    finally:
        server.stop()
        shutil.rmtree(home, ignore_errors=True)


@pytest.fixture
def registry_factory(tmp_path: Path) -> Iterator[Callable[..., RegistryServer]]:
    """Start more registries for one test (one to stop, one without auth); all are stopped after it."""
    started: list[RegistryServer] = []

    def start(*, auth: str | None = "htpasswd") -> RegistryServer:
        server = RegistryServer(tmp_path / f"registry-{len(started)}", auth=auth)
        started.append(server)
        return server.start()

    try:
        yield start
    finally:
        for server in started:
            server.stop()
