"""Secrets at rest: AES-256-GCM under one key, with the secret's name as associated data so a
ciphertext cannot be moved to another name. The key comes from configuration
(PODIUM_SECRET_KEY_FILE, or PODIUM_SECRET_KEY as base64); the embedded default generates one in its
data directory, readable by its owner only. Several replicas must be given the same key."""

from __future__ import annotations

import base64
import hashlib
import os
from pathlib import Path

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from podium.errors import PodiumError

KEY_BYTES = 32


class SecretKeyError(PodiumError):
    """The secret key is missing or malformed."""


class SecretUnreadable(SecretKeyError):
    """A stored secret cannot be decrypted with this server's key."""

    def __init__(self, secret: str, key_id: str) -> None:
        # The name and the key id are details an operator needs (which secret to set again, which
        # replica holds which key); the value is never part of it.
        super().__init__(
            f"secret {secret!r} cannot be decrypted with this server's key {key_id} (was the key changed, "
            "or was it sealed by a replica given another key?)"
        )
        self.secret = secret
        self.key_id = key_id


class SecretBox:
    def __init__(self, key: bytes) -> None:
        if len(key) != KEY_BYTES:
            raise SecretKeyError(f"the secret key must be {KEY_BYTES} bytes, got {len(key)}")
        self._aead = AESGCM(key)
        # A short fingerprint, so that two replicas' keys can be compared without showing either:
        # 48 bits of a hash of a 256-bit random key tell nothing about the key.
        self.key_id = "k-" + hashlib.sha256(b"podium secret key id\0" + key).hexdigest()[:12]

    def seal(self, name: str, plaintext: bytes) -> tuple[bytes, bytes]:
        nonce = os.urandom(12)
        return nonce, self._aead.encrypt(nonce, plaintext, name.encode())

    def open(self, name: str, nonce: bytes, ciphertext: bytes) -> bytes:
        try:
            return self._aead.decrypt(bytes(nonce), bytes(ciphertext), name.encode())
        except InvalidTag:
            raise SecretUnreadable(name, self.key_id) from None


def load_key(data_dir: Path, environ: dict[str, str] | None = None) -> bytes:
    env = os.environ if environ is None else environ
    if env.get("PODIUM_SECRET_KEY"):
        try:
            key = base64.b64decode(env["PODIUM_SECRET_KEY"], validate=True)
        except ValueError:
            raise SecretKeyError("PODIUM_SECRET_KEY must be 32 bytes in base64") from None
        if len(key) != KEY_BYTES:
            raise SecretKeyError("PODIUM_SECRET_KEY must be 32 bytes in base64")
        return key
    path = Path(env["PODIUM_SECRET_KEY_FILE"]) if env.get("PODIUM_SECRET_KEY_FILE") else data_dir / "secret.key"
    if path.exists():
        raw = path.read_bytes().strip()
        try:
            key = base64.b64decode(raw, validate=True)
        except ValueError:
            raise SecretKeyError(f"{path} must hold 32 bytes in base64") from None
        if len(key) != KEY_BYTES:
            raise SecretKeyError(f"{path} must hold 32 bytes in base64")
        return key
    if env.get("PODIUM_SECRET_KEY_FILE"):
        raise SecretKeyError(f"PODIUM_SECRET_KEY_FILE names {path}, which does not exist")
    key = AESGCM.generate_key(bit_length=256)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_private(path, base64.b64encode(key) + b"\n")
    return key


def write_private(path: Path, data: bytes) -> None:
    """Write a file only its owner can read, never briefly readable by others."""
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)
    os.replace(tmp, path)
