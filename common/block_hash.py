"""Content hashes of full KV blocks, chained to their parent: the one implementation the
worker's prefix cache and the gateway's KV-aware router share.

A full block of ``block_size`` prompt/output tokens is identified by a hash of its
tokens chained to its parent block's hash and salted with the model identity, so equal
hashes mean equal whole prefixes, not just equal blocks (vLLM's "automatic prefix
caching" design: one hash per full block, chained). The worker registers these hashes
in its prefix cache (worker/engine/prefix_cache.py) and publishes them (its KV events);
the gateway computes the same hashes of a prompt to find the worker that holds the
longest prefix of it (gateway/routing/). No torch here: the gateway imports it.

The hash is a 128-bit BLAKE2b digest (``hashlib``), so accidental collisions are
negligible; it is stable across processes and machines (no ``hash()`` seed).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

#: Bytes of one block hash in its binary form (:func:`hash_bytes`).
HASH_BYTES = 16


def block_hash(parent: int | None, token_ids: Sequence[int], salt: str = "") -> int:
    """Hash of one full block: its tokens (int32 little-endian), chained to the parent
    block's hash (None for the first block) and salted with the model identity.

    Returns:
        An unsigned 128-bit integer.
    """
    h = hashlib.blake2b(digest_size=HASH_BYTES)
    h.update(salt.encode())
    h.update(b"|" if parent is None else parent.to_bytes(HASH_BYTES, "little"))
    h.update(b"".join(t.to_bytes(4, "little", signed=True) for t in token_ids))
    return int.from_bytes(h.digest(), "little")


def adapter_salt(salt: str, adapter: str = "") -> str:
    """The salt of the blocks computed with a LoRA adapter: the model's ``salt`` extended with
    the adapter's identity (``""``: the base model, ``salt`` unchanged), so KV blocks are never
    shared between adapters, nor between an adapter and the base model. The worker's identity
    of an adapter is ``name@digest`` (its name and a digest of its files,
    :attr:`worker.model.lora.LoraAdapter.digest`), so an adapter replaced under the same name
    shares nothing with its predecessor."""
    return f"{salt}|lora:{adapter}" if adapter else salt


def chain_hashes(token_ids: Sequence[int], block_size: int, num_blocks: int, salt: str = "",
                 start: int = 0, parent: int | None = None) -> list[int]:
    """Hashes of full blocks ``start .. num_blocks - 1`` of ``token_ids`` (blocks of
    ``block_size`` tokens), continuing the chain from ``parent`` (the hash of block
    ``start - 1``; None when ``start`` is 0)."""
    out = []
    for i in range(start, num_blocks):
        parent = block_hash(parent, token_ids[i * block_size:(i + 1) * block_size], salt)
        out.append(parent)
    return out


def prompt_block_hashes(token_ids: Sequence[int], block_size: int, salt: str = "") -> list[int]:
    """Hashes of every full block of ``token_ids`` that a worker could reuse from its
    prefix cache: the worker always computes the last token (it yields the logits), so
    only blocks within the first ``len - 1`` tokens count (as
    ``BlockManager.cached_prefix(token_ids, len - 1)``).

    Raises:
        ValueError: ``block_size`` < 1.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    return chain_hashes(token_ids, block_size, max(0, len(token_ids) - 1) // block_size, salt)


def hash_bytes(h: int) -> bytes:
    """The 16-byte little-endian form a hash takes in Redis (a set member)."""
    return h.to_bytes(HASH_BYTES, "little")
