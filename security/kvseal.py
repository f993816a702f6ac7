"""`RecordSeal`: the cluster secret applied to the KV rendezvous. Torch-free.

Runs in prefill and decode workers, in the KV transport's helper threads (`kvtransfer.rendezvous`
uses it). The rendezvous store (a TCPStore) answers anyone who can reach it, so what it carries
is made useless to a peer without the cluster secret:

- every control record (join, xfer, cancel, stop) carries ``mac``: HMAC-SHA256 under the
  records key over the record's canonical JSON (sorted keys, without ``mac``); a receiver
  acts on no other record, so no one else can join a pair, announce or cancel a transfer;
- a join's shared-memory offer travels encrypted (AES-GCM under the offer key, with the
  sender and generation as associated data): only a receiver with the secret learns where the
  sender's cache is;
- a join's verdict carries a MAC over (sender, generation, verdict), so a sender trusts only
  the real receiver's answer;
- a pair's process-group keys live under a prefix derived from the records key, so no one
  without it can find them in the store (and take a rank of the pair).

What it does not cover (`docs/security.md`): gloo's own sockets, which carry the KV bytes
unencrypted and unauthenticated, and a peer that deletes or overwrites store keys (denial of
service). The KV plane belongs on a private network.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import os
from typing import Any

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from security.secret import KV_OFFER, KV_RECORDS, ClusterSecret

MAC = "mac"
_NONCE_BYTES = 12


def canonical(record: dict[str, Any]) -> bytes:
    """The bytes a record's MAC covers: its JSON without ``mac``, keys sorted, no spaces."""
    body = {k: v for k, v in record.items() if k != MAC}
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


class RecordSeal:
    """Signs and checks rendezvous records, seals shared-memory offers (module docstring)."""

    def __init__(self, secret: ClusterSecret) -> None:
        self._key = secret.derive(KV_RECORDS)
        self._aead = AESGCM(secret.derive(KV_OFFER))

    def _mac(self, data: bytes) -> str:
        return hmac.new(self._key, data, hashlib.sha256).hexdigest()

    def sign(self, record: dict[str, Any]) -> dict[str, Any]:
        """`record` with its ``mac``."""
        return {**record, MAC: self._mac(canonical(record))}

    def verify(self, record: dict[str, Any]) -> bool:
        """True when `record` carries a valid ``mac``."""
        mac = record.get(MAC)
        if not isinstance(mac, str):
            return False
        return hmac.compare_digest(mac, self._mac(canonical(record)))

    @staticmethod
    def _aad(sender: str, gen: int) -> bytes:
        return f"kvx-offer/{sender}/{gen}".encode()

    def seal_offer(self, offer: dict[str, Any], sender: str, gen: int) -> str:
        """A shared-memory offer as base64(nonce + AES-GCM ciphertext) for one join."""
        nonce = os.urandom(_NONCE_BYTES)
        data = json.dumps(offer, separators=(",", ":")).encode()
        return base64.b64encode(nonce + self._aead.encrypt(nonce, data, self._aad(sender, gen)))\
            .decode()  # fmt: skip

    def open_offer(self, sealed: str, sender: str, gen: int) -> dict[str, Any]:
        """Inverse of `seal_offer`; ValueError when it was not sealed for (sender, gen) with
        this secret."""
        try:
            raw = base64.b64decode(sealed, validate=True)
            data = self._aead.decrypt(
                raw[:_NONCE_BYTES], raw[_NONCE_BYTES:], self._aad(sender, gen)
            )
        except (InvalidTag, ValueError) as exc:
            raise ValueError("shared-memory offer not sealed with this cluster's secret") from exc
        offer = json.loads(data)
        if not isinstance(offer, dict):
            raise ValueError("shared-memory offer is not an object")
        return offer

    def _verdict_mac(self, verdict: str, sender: str, gen: int) -> str:
        return self._mac(f"kvx-verdict/{sender}/{gen}/{verdict}".encode())

    def sign_verdict(self, verdict: str, sender: str, gen: int) -> str:
        """``<verdict>|mac:<hex>``."""
        return f"{verdict}|mac:{self._verdict_mac(verdict, sender, gen)}"

    def open_verdict(self, text: str, sender: str, gen: int) -> str | None:
        """The verdict of `sign_verdict`'s text, or None when its MAC does not check out."""
        verdict, sep, mac = text.rpartition("|mac:")
        if not sep or not hmac.compare_digest(mac, self._verdict_mac(verdict, sender, gen)):
            return None
        return verdict

    def pair_tag(self, sender: str, gen: int) -> str:
        """The secret part of a pair's store prefix (128 bits, hex)."""
        return self._mac(f"kvx-pair/{sender}/{gen}".encode())[:32]
