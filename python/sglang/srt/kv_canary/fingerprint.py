"""The fingerprint a KV slot carries, and the packed "who wrote it" word beside it.

    fp(tag, pos, token, salt) = mix64(mix64((pos << 32) ^ (token & 0xffffffff) ^ salt) ^ tag) | 1

tag   the row's identity: the request's hash (radix cache off) or 0 (content identity, when KV
      is shared between requests through the prefix cache)
pos   the KV position the slot holds
token the token id whose K/V sits there: token at pos (target) or at pos + 1 (EAGLE draft)
salt  one per fingerprint group (KV pool), so a forward bound to another pool's buffers shows

Every real fingerprint is odd; the even values 0 and 2 are sentinels for "never written" and
"freed". Everything is signed int64 arithmetic that wraps, with logical right shifts spelled as
shift-and-mask, so torch (reference) and triton (kernels.py) compute the same bits.
"""

from __future__ import annotations

import hashlib

import torch

NEVER_WRITTEN = 0
FREED = 2

# splitmix64's finaliser constants, as signed int64.
_C1 = 0xBF58476D1CE4E5B9 - (1 << 64)
_C2 = 0x94D049BB133111EB - (1 << 64)
_LOW32 = 0xFFFFFFFF


def _srl(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of an int64 tensor."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def mix64(x: torch.Tensor) -> torch.Tensor:
    x = x ^ _srl(x, 30)
    x = x * _C1
    x = x ^ _srl(x, 27)
    x = x * _C2
    return x ^ _srl(x, 31)


def fingerprint(
    tag: torch.Tensor, pos: torch.Tensor, token: torch.Tensor, salt: int
) -> torch.Tensor:
    """Elementwise fingerprints; all inputs broadcast, computed in int64."""
    pos = pos.to(torch.int64)
    token = token.to(torch.int64)
    inner = mix64((pos << 32) ^ (token & _LOW32) ^ salt)
    return mix64(inner ^ tag.to(torch.int64)) | 1


def pack_writer(row: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """The req_to_token row and KV position of a write, in one int64 (for reports only)."""
    return (row.to(torch.int64) << 32) | (pos.to(torch.int64) & _LOW32)


def unpack_writer(word: int) -> tuple[int, int]:
    return word >> 32, word & _LOW32


def group_salt(group_index: int) -> int:
    """A well-spread signed int64 per fingerprint group."""
    return int(mix64(torch.tensor([group_index + 1], dtype=torch.int64))[0])


def request_tag(rid: str) -> int:
    """Stable signed int64 hash of a request id (same in every process, unlike hash())."""
    digest = hashlib.blake2b(str(rid).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True)
