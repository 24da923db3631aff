"""Sealed reasoning: how a stateless Responses client (`store: false`, `include:
["reasoning.encrypted_content"]`) carries a reply's reasoning to its next turn without the server
keeping it. The reasoning text is sealed with AES-256-GCM under the server's key, so the client can
neither read nor alter it; a sealed item that was tampered with, or sealed by another key, does not
open and is refused."""
from __future__ import annotations

import base64
import binascii
import hashlib
import os
import secrets

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

PREFIX = "bie1."                         # the format's version: a future format gets another
LABEL = b"bie-trt sealed reasoning v1"   # bound into the tag: the key seals nothing else under this label
KEY_ENV = "BIE_TRT_REASONING_KEY"


class SealError(ValueError):
    """A sealed item that does not open here: altered, truncated, or sealed under another key."""


def new_key() -> str:
    """A random key (what a server uses when it is given none)."""
    return secrets.token_urlsafe(32)


class ReasoningSeal:
    """Seals and opens reasoning text under one key (any string: it is hashed to 256 bits)."""

    def __init__(self, key: str):
        if not key:
            raise ValueError("the reasoning key must not be empty")
        self._aead = AESGCM(hashlib.sha256(key.encode()).digest())

    @classmethod
    def from_environment(cls, key: str | None) -> "ReasoningSeal":
        """The given key, else $BIE_TRT_REASONING_KEY, else a random one (sealed items then open only in
        this process, until it restarts)."""
        return cls(key or os.environ.get(KEY_ENV) or new_key())

    def seal(self, text: str) -> str:
        nonce = os.urandom(12)
        sealed = nonce + self._aead.encrypt(nonce, text.encode(), LABEL)
        return PREFIX + base64.urlsafe_b64encode(sealed).decode()

    def open(self, sealed: str) -> str:
        if not sealed.startswith(PREFIX):
            raise SealError("it was not sealed by this server (another service's encrypted reasoning cannot "
                            "be read here)")
        try:
            raw = base64.urlsafe_b64decode(sealed[len(PREFIX):].encode())
            return self._aead.decrypt(raw[:12], raw[12:], LABEL).decode()
        except (binascii.Error, ValueError, InvalidTag):
            raise SealError("it does not open under this server's key: it was altered, or sealed by another "
                            "server (one started with another --reasoning-key, or restarted without one)") from None
