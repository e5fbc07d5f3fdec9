"""mac: keyed authentication of stored objects, bound to the object's name.

With a key (``KVFETCHER_OBJECT_KEY``, one per pool), the writer tags every object in two places,
each tag bound to the object's name (``kv/../<chunk key>/<preset>.kvfc``, so to its chunk key,
hence its prefix, namespace, tenant and preset):

* the *header tag* (HMAC-SHA256): over the prefix and the header, which holds every part's tag;
* a *part tag* per part (side information, each segment): over its bytes, so a reader checks each
  part as it arrives, in the thread or worker that read it, without the others. A part tag is a
  fresh random nonce and the AES-GMAC of the part under a key derived (HMAC-SHA256) from the object
  key, the name and the part's offset: GMAC because, with AES-NI and carry-less multiplication, it
  runs many times faster than HMAC-SHA256 or a keyed BLAKE (docs/security.md); the random nonce
  because a name's parts are written again (a re-store), and GMAC must never see one nonce twice
  under a key.

A reader with the key accepts an object only if the header tag and every part's tag verify under
the name it read the object from: an object forged without the key, altered, or copied under
another name (another prefix, tenant or preset) is refused before any of its bytes is decoded.
Messages are domain-separated and length-prefixed, so no tag of one kind verifies as another.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import struct
from dataclasses import dataclass, field

from cryptography.hazmat.primitives.ciphers.aead import AESGCM

TAG_SIZE = 32
#: a part tag: its nonce, then its GMAC
PART_NONCE_SIZE, PART_TAG_SIZE = 12, 12 + 16
# format v2's part tags were HMAC-SHA256 in the domain b"kvfetcher/part\0": part keys have their own,
# so no v2 tag (public, in stored headers) equals a part key
_HEADER, _PART_KEY = b"kvfetcher/header\0", b"kvfetcher/part-key\0"


def key_from(secret: str) -> bytes | None:
    """The MAC key for a configured secret (any length, e.g. a token from the pool's Secret), or
    None for no secret: objects are then written and read unauthenticated (CRC-32 only)."""
    if not secret:
        return None
    return hashlib.sha256(b"kvfetcher/object-key\0" + secret.encode()).digest()


def key_id(key: bytes) -> str:
    """A key's public name (16 hex digits): which key an object was tagged with, never the key."""
    return hashlib.sha256(b"kvfetcher/key-id\0" + key).hexdigest()[:16]


@dataclass(frozen=True)
class ObjectMAC:
    """Tags of the object stored at ``name``, under ``key`` (from :func:`key_from`); a reader also
    accepts tags made under the ``accepted`` keys (a key rotation's previous keys), never writes them."""

    key: bytes = field(repr=False)
    name: str
    accepted: tuple[bytes, ...] = field(default=(), repr=False)

    def _mac(self, domain: bytes, *parts, key: bytes | None = None) -> bytes:
        name = self.name.encode()
        m = hmac.new(key or self.key, domain + struct.pack("<I", len(name)) + name, hashlib.sha256)
        for p in parts:
            m.update(p)
        return m.digest()

    def header(self, prefix: bytes, header: bytes, key: bytes | None = None) -> bytes:
        """The header tag: over the prefix's fixed fields (``prefix``) and the header bytes."""
        return self._mac(_HEADER, struct.pack("<I", len(prefix)), prefix, header, key=key)

    def part(self, offset: int, data: bytes | memoryview) -> bytes:
        """A new tag of the part at ``offset`` (relative to the end of the header), under the key:
        a fresh random nonce, then the part's GMAC."""
        return self._part(offset, data, self.key, os.urandom(PART_NONCE_SIZE))

    def _part(self, offset: int, data: bytes | memoryview, key: bytes, nonce: bytes) -> bytes:
        gmac = AESGCM(self._mac(_PART_KEY, struct.pack("<Q", offset), key=key))
        return nonce + gmac.encrypt(nonce, b"", data)

    @property
    def key_id(self) -> str:
        """The writing key's id (written in the header)."""
        return key_id(self.key)

    def knows(self, kid: str) -> bool:
        """Whether ``kid`` names the key or an accepted one."""
        return any(key_id(k) == kid for k in (self.key, *self.accepted))

    def verify_header(self, prefix: bytes, header: bytes, tag: bytes) -> bool:
        """Whether ``tag`` is the header's under the key or an accepted one."""
        return any(self.same(self.header(prefix, header, k), tag) for k in (self.key, *self.accepted))

    def verify_part(self, offset: int, data: bytes | memoryview, tag: bytes | None) -> bool:
        """Whether ``tag`` is the part's under the key or an accepted one."""
        if tag is None or len(tag) != PART_TAG_SIZE:
            return False
        nonce = tag[:PART_NONCE_SIZE]
        return any(self.same(self._part(offset, data, k, nonce), tag) for k in (self.key, *self.accepted))

    @staticmethod
    def same(a: bytes, b: bytes | None) -> bool:
        """Constant-time comparison of two tags (False when ``b`` is missing)."""
        return b is not None and hmac.compare_digest(a, b)


_CALIBRATION = b"kvfetcher/calibration\0"


def calibration_tag(key: bytes, tag: str, name: str, doc: bytes, basis_sha256: bytes) -> bytes:
    """The tag of a calibration artefact: over its model ``tag``, its ``name`` (file stem), its
    canonical JSON ``doc`` (without the tag) and the sha256 of its basis file (``b""``: none)."""
    m = hmac.new(key, _CALIBRATION, hashlib.sha256)
    for part in (tag.encode(), name.encode(), doc, basis_sha256):
        m.update(struct.pack("<Q", len(part)))
        m.update(part)
    return m.digest()
