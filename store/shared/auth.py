"""Fleet authentication of the shared tier: what the fleet secret keys, and how a reader checks it.

Anyone who can write to the server could otherwise swap another prompt's tensors into a published prefix and
recompute the record's XXH3 and the manifest's checksum (nothing in them is keyed), and anyone who can read it
would see every tenant's tokens. With a fleet secret (formats 3 and 4, ``keys.py``), three keys are derived from
it with BLAKE3's key derivation (each for one job):

* names: every key name's hex is ``keyed_blake3(kind || LMDB key)[:16]`` and a cluster hash tag
  ``keyed_blake3("group" || group key)[:8]``, so names reveal no namespace key, chain key or token hash, and a host
  with another secret computes other names (it finds nothing: a miss);
* records: every entry, chunk and drafter record is sealed with AES-256-GCM under a key derived from a random
  16-byte salt (``SEALED_V1 || salt || ciphertext || tag``), with the key name as associated data: a record
  cannot be read, altered or moved to another name without the secret;
* manifests: ``sum`` and each ``d:<id>`` field hold keyed digests of the record checksums they pin (bound to the
  manifest's name), and ``mac`` is a keyed BLAKE3 over the name, the namespace key and the fields a reader uses
  (``v``, ``len``, ``minr``, ``bytes``, ``sum``). Drafter ids are keyed digests of the drafter namespace.

A value that fails any check is ``Unauthentic``: the lookup treats it as a miss (never used, never promoted).
Without a secret (``PlainAuth``, a trusted network only) values pass unchanged: formats 1 and 2.
* signature set members: ``SIG_MEMBER_V1 || keyed_blake3("sig" || set name || signature)[:16] || signature``, so a
  member written without the secret is told from the fleet's own and ignored (and removed): 100 garbage members
  used to crowd the genuine one out of the 16 a lookup considers and hid the namespace from the whole fleet.
  Bare members (written by hosts before this scheme) are still read, after the authenticated ones.

Node hashes stay unkeyed hints (tail lengths): a forged one only costs a miss or a wasted round trip, as every
record it leads to is authenticated. ``fingerprint()`` names the secret in the tier's ``stats`` hash (a keyed
digest of a constant: it tells secrets apart, never reveals one), so ``shared-stats`` can say when a host's
secret is not the one its fleet publishes with.
"""

from __future__ import annotations

import hmac
import os

import blake3

from ..errors import CorruptRecord, StoreError

SEALED_V1 = b"\x01"  # the first byte of a sealed record (a later scheme takes another)
SALT_BYTES = 16
TAG_BYTES = 16
_NONCE = bytes(12)  # every record has its own derived key, so one fixed nonce is safe
NAME_BYTES = 16     # keyed name digests: 128 bits (32 hex digits)
MANIFEST_VERSION = b"3"
#: the first byte of an authenticated signature set member; a layer signature is a msgpack list (0x90-0x9f,
#: 0xdc, 0xdd) or empty, so a bare (older) member never starts with it
SIG_MEMBER_V1 = b"\x00"
SIG_MAC_BYTES = 16


class Unauthentic(StoreError):
    """A value on the server did not pass the fleet secret's check (tampered, or written without the secret)."""


class PlainAuth:
    """No secret (formats 1 and 2, a trusted network only): names carry the LMDB keys, values pass unchanged."""

    keyed = False

    def name_hex(self, kind: bytes, key: bytes) -> bytes:
        return key.hex().encode("ascii")

    def tag_hex(self, group: bytes) -> bytes:
        return group.hex().encode("ascii")

    def seal(self, name: bytes, record: bytes) -> bytes:
        return record

    def open(self, name: bytes, value):
        return value

    def drafter_id(self, drafter: str) -> str:
        return drafter

    def pin(self, name: bytes, what: bytes, checksum: bytes) -> bytes:
        """What a manifest stores for a record checksum (format 1: the checksum itself)."""
        return checksum

    def manifest_fields(self, name: bytes, ns: bytes, length: int, minr: int, pinned: bytes, nbytes: int) -> list:
        return [b"v", b"1", b"ns", ns, b"len", length, b"minr", minr, b"sum", pinned, b"bytes", nbytes]

    def check_manifest(self, name: bytes, ns_key: bytes, raw: dict) -> None:
        """``CorruptRecord`` if ``raw`` is no manifest of this format for ``ns_key`` (``Unauthentic`` when keyed)."""
        if raw.get(b"v") != b"1" or raw.get(b"ns") != ns_key:
            raise CorruptRecord("unknown version or another namespace")

    def sig_member(self, name: bytes, sig: bytes) -> bytes:
        """The member of signature set ``name`` that stands for layer signature ``sig`` (formats 1 and 2: itself)."""
        return sig

    def sig_of(self, name: bytes, member: bytes) -> tuple[bytes, str]:
        """``(signature, how)`` of a member of set ``name``; ``how`` is ``"ok"`` (authenticated, or unkeyed),
        ``"bare"`` (no MAC: an older writer or garbage; keyed formats read it last) or ``"forged"`` (a MAC that
        fails: never used, removable)."""
        return member, "ok"

    def fingerprint(self) -> str | None:
        """A short public name of the fleet secret (None without one): ``fp:<it>`` counts publishes in ``stats``."""
        return None


class FleetAuth(PlainAuth):
    """Keys derived from the fleet secret (formats 3 and 4); see the module doc."""

    keyed = True

    def __init__(self, secret: bytes):
        try:
            from cryptography.hazmat.primitives.ciphers.aead import AESGCM
        except ImportError as exc:  # a declared dependency; only a broken install lacks it
            raise StoreError(f"the shared tier's fleet secret needs the cryptography package ({exc})") from None
        self._aead = AESGCM
        self._names = blake3.blake3(secret, derive_key_context="spec-cache 2026-12 shared tier key names").digest()
        self._seal = blake3.blake3(secret, derive_key_context="spec-cache 2026-12 shared tier records").digest()
        self._mac = blake3.blake3(secret, derive_key_context="spec-cache 2026-12 shared tier manifests").digest()

    # --- names ---------------------------------------------------------------------------------------
    def name_hex(self, kind: bytes, key: bytes) -> bytes:
        return blake3.blake3(kind + b"\0" + key, key=self._names).digest(NAME_BYTES).hex().encode("ascii")

    def tag_hex(self, group: bytes) -> bytes:
        return blake3.blake3(b"group\0" + group, key=self._names).digest(8).hex().encode("ascii")

    # --- records -------------------------------------------------------------------------------------
    def _record_key(self, salt) -> bytes:
        return blake3.blake3(salt, key=self._seal).digest()

    def seal(self, name: bytes, record: bytes) -> bytes:
        salt = os.urandom(SALT_BYTES)
        return SEALED_V1 + salt + self._aead(self._record_key(salt)).encrypt(_NONCE, record, name)

    def open(self, name: bytes, value):
        """The record inside a sealed value; raises ``Unauthentic`` for anything else."""
        if not isinstance(value, bytes):
            return value  # a missing key or an error reply: the caller's business
        if len(value) < 1 + SALT_BYTES + TAG_BYTES or value[:1] != SEALED_V1:
            raise Unauthentic("not a sealed record")
        view = memoryview(value)
        try:
            return self._aead(self._record_key(view[1:1 + SALT_BYTES])).decrypt(_NONCE, view[1 + SALT_BYTES:], name)
        except Exception:  # cryptography's InvalidTag: altered, moved, or sealed under another secret
            raise Unauthentic("record authentication failed") from None

    # --- manifests -----------------------------------------------------------------------------------
    def _digest(self, *parts: bytes) -> bytes:
        h = blake3.blake3(key=self._mac)
        for part in parts:
            h.update(len(part).to_bytes(4, "little"))
            h.update(part)
        return h.digest()

    def drafter_id(self, drafter: str) -> str:
        return self._digest(b"drafter", drafter.encode("utf-8")).hex()[:32]

    def pin(self, name: bytes, what: bytes, checksum: bytes) -> bytes:
        return self._digest(b"pin", name, what, checksum)

    def manifest_fields(self, name: bytes, ns: bytes, length: int, minr: int, pinned: bytes, nbytes: int) -> list:
        fields = {b"v": MANIFEST_VERSION, b"len": str(length).encode(), b"minr": str(minr).encode(),
                  b"bytes": str(nbytes).encode(), b"sum": pinned}
        mac = self._manifest_mac(name, ns, fields)
        return [item for pair in fields.items() for item in pair] + [b"mac", mac]

    def _manifest_mac(self, name: bytes, ns: bytes, fields: dict) -> bytes:
        return self._digest(b"manifest", name, ns, *(fields.get(k, b"") or b"" for k in
                                                     (b"v", b"len", b"minr", b"bytes", b"sum")))

    def check_manifest(self, name: bytes, ns_key: bytes, raw: dict) -> None:
        if raw.get(b"v") != MANIFEST_VERSION:
            raise CorruptRecord("unknown manifest version")
        mac = raw.get(b"mac")
        if not isinstance(mac, bytes) or not hmac.compare_digest(mac, self._manifest_mac(name, ns_key, raw)):
            raise Unauthentic("manifest authentication failed")


    # --- signature sets --------------------------------------------------------------------------------
    def sig_member(self, name: bytes, sig: bytes) -> bytes:
        return SIG_MEMBER_V1 + self._digest(b"sig", name, sig)[:SIG_MAC_BYTES] + sig

    def sig_of(self, name: bytes, member: bytes) -> tuple[bytes, str]:
        if member[:1] != SIG_MEMBER_V1:
            return member, "bare"
        sig = member[1 + SIG_MAC_BYTES:]
        if len(member) < 1 + SIG_MAC_BYTES or not hmac.compare_digest(member, self.sig_member(name, sig)):
            return sig, "forged"
        return sig, "ok"

    def fingerprint(self) -> str:
        return self._digest(b"fleet fingerprint").hex()[:16]


def auth_for(key_material: bytes | None) -> PlainAuth:
    """``FleetAuth`` for a secret, ``PlainAuth`` without one."""
    return PlainAuth() if key_material is None else FleetAuth(key_material)
