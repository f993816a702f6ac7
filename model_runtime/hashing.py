"""Block-hash chain: the identity of a full KV block, shared by workers, router and prefix index.

Runs in every process (torch-free on purpose: the router imports it).

A prompt is cut into blocks of `block_size` tokens. Only *full* blocks get a hash. Block i's
hash covers its parent's hash and its own token ids, so equal hashes mean equal whole prefixes::

    tokens:  [t0 .. t15][t16 .. t31][t32 .. t40]
    hashes:   h0 = H(ROOT, t0..t15)
              h1 = H(h0,   t16..t31)
              (partial last block: no hash)

Hashes are 128-bit BLAKE2b digests as Python ints, so collisions are out of practical reach, and
the function is stable across processes and Python versions (no `hash()` randomisation).
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

BlockHash = int
"""A 128-bit block hash (non-negative int)."""

ROOT_HASH: BlockHash = 0
"""Parent hash of the first block of every sequence."""

_DIGEST_BYTES = 16


def hash_block(parent: BlockHash, token_ids: Sequence[int], extra: bytes = b"") -> BlockHash:
    """Hash one full block given its parent's hash and its token ids.

    `extra` lets callers mix in anything else that changes the KV (e.g. a LoRA id); empty today.
    """
    h = hashlib.blake2b(digest_size=_DIGEST_BYTES)
    h.update(parent.to_bytes(_DIGEST_BYTES, "big"))
    h.update(array("q", token_ids).tobytes())
    h.update(extra)
    return int.from_bytes(h.digest(), "big")


def block_hash_chain(
    token_ids: Sequence[int], block_size: int, parent: BlockHash = ROOT_HASH
) -> list[BlockHash]:
    """Hashes of every full block of `token_ids`, in order (partial tail block excluded).

    Raises ValueError if `block_size` is not positive.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    hashes: list[BlockHash] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, token_ids[start : start + block_size])
        hashes.append(parent)
    return hashes


def hash_to_bytes(block_hash: BlockHash) -> bytes:
    """Fixed 16-byte big-endian encoding, for wire formats and Redis keys."""
    return block_hash.to_bytes(_DIGEST_BYTES, "big")


def hash_from_bytes(data: bytes) -> BlockHash:
    """Inverse of `hash_to_bytes`; raises ValueError on a wrong length."""
    if len(data) != _DIGEST_BYTES:
        raise ValueError(f"block hash must be {_DIGEST_BYTES} bytes, got {len(data)}")
    return int.from_bytes(data, "big")
