"""The identity of a prompt prefix, block by block: the same in every process and machine.

The engine's prefix cache names each full block of ``block_size`` tokens by
a hash of its tokens chained with its parent block's hash, so equal hashes
mean equal prefixes. A request can only be placed where its prefix is
cached if the API computes the same names as the engine, so the hash must
not depend on the process: Python's ``hash`` of a tuple does (``None``'s
hash is its address before Python 3.12), and it is 64 bits with no
resistance to collisions, which a client could search for to be served
another prompt's cached keys and values. A block's hash is therefore a
128-bit BLAKE2b digest of the parent's digest and the tokens as
little-endian unsigned 32-bit integers, read as an int.

An image's tokens are placeholders that every image shares, so a block that
holds any of them also hashes the digests of the images it overlaps: the
same image in the same place hits the cache, another image does not.
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

DIGEST_BYTES = 16
_ROOT = bytes(DIGEST_BYTES)  # the parent of a prompt's first block
_LITTLE_ENDIAN = sys.byteorder == "little"


@dataclass(frozen=True, slots=True)
class ImageSpan:
    """The prompt positions ``[start, end)`` an image's tokens fill, and its pixels' digest."""

    start: int
    end: int
    digest: bytes


def chain_hash(parent: int | None, tokens: Sequence[int], images: bytes = b"") -> int:
    """The hash of a block of ``tokens`` whose preceding block hashed to ``parent``.

    ``images`` is the digests of the images the block overlaps (``images_in``).
    """
    packed = array("I", tokens)
    if not _LITTLE_ENDIAN:
        packed.byteswap()
    prefix = _ROOT if parent is None else parent.to_bytes(DIGEST_BYTES, "little")
    digest = hashlib.blake2b(prefix, digest_size=DIGEST_BYTES)
    digest.update(packed.tobytes())
    if images:
        digest.update(images)
    return int.from_bytes(digest.digest(), "little")


def images_in(spans: Sequence[ImageSpan], start: int, end: int) -> bytes:
    """The digests of the images overlapping positions ``[start, end)``, in prompt order."""
    if not spans:  # a text prompt: every block of every prompt asks
        return b""
    return b"".join(span.digest for span in spans if span.start < end and start < span.end)


def prefix_hashes(
    token_ids: Sequence[int], block_size: int, images: Sequence[ImageSpan] = ()
) -> list[int]:
    """The chain of a prompt's full blocks, as the engine's prefix cache names them."""
    hashes: list[int] = []
    parent: int | None = None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        end = start + block_size
        parent = chain_hash(parent, token_ids[start:end], images_in(images, start, end))
        hashes.append(parent)
    return hashes


def digest(block_hash: int) -> bytes:
    """A block hash as the 16 bytes a worker's cache summary holds (``keys.cache_summary``)."""
    return block_hash.to_bytes(DIGEST_BYTES, "little")
