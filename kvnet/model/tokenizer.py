"""Tokenizers: the `Tokenizer` protocol and the built-in byte-level tokenizer.

This module owns the mapping between text and token ids and the identity string that goes into the model
fingerprint (two tokenizers that map text differently must never share KV blocks). It knows nothing about
the model, the cache or the network. A real tokenizer (e.g. one loaded from a checkpoint directory) can be
plugged in by anything that satisfies `Tokenizer`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from kvnet.errors import InvalidTokenError

NUM_BYTE_TOKENS = 256
"""Ids 0..255 are the raw bytes of the UTF-8 text."""


@runtime_checkable
class Tokenizer(Protocol):
    """What the model, the generation loop and the fingerprint need from a tokenizer."""

    @property
    def vocab_size(self) -> int:
        """Number of distinct token ids (ids are 0..vocab_size-1)."""
        ...

    @property
    def bos_id(self) -> int:
        """Beginning-of-sequence id."""
        ...

    @property
    def eos_id(self) -> int:
        """End-of-sequence id; generation may stop on it."""
        ...

    def encode(self, text: str, *, bos: bool = True) -> list[int]:
        """Token ids of `text`, prefixed with `bos_id` when `bos` is true."""
        ...

    def decode(self, token_ids: Sequence[int]) -> str:
        """Text of `token_ids`; special ids are dropped."""
        ...

    def identity(self) -> str:
        """A stable string naming this exact text-to-ids mapping, for the model fingerprint."""
        ...


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255, then BOS=256, EOS=257, PAD=258 (vocab 259).

    Deterministic and dependency-free, so every node maps a prompt to the same ids without any files.
    """

    bos_id: int = NUM_BYTE_TOKENS
    eos_id: int = NUM_BYTE_TOKENS + 1
    pad_id: int = NUM_BYTE_TOKENS + 2
    vocab_size: int = NUM_BYTE_TOKENS + 3

    def encode(self, text: str, *, bos: bool = True) -> list[int]:
        ids = list(text.encode("utf-8"))
        return [self.bos_id, *ids] if bos else ids

    def decode(self, token_ids: Sequence[int]) -> str:
        for token_id in token_ids:
            if not 0 <= token_id < self.vocab_size:
                raise InvalidTokenError(f"token id {token_id} outside [0, {self.vocab_size})")
        # A model may emit a byte sequence that is not valid UTF-8 mid-generation; replace, never raise.
        return bytes(t for t in token_ids if t < NUM_BYTE_TOKENS).decode("utf-8", errors="replace")

    def identity(self) -> str:
        # Any change to the id layout must change this string (and so the fingerprint).
        return (
            f"kvnet-bytes-v1:bytes=0-{NUM_BYTE_TOKENS - 1},bos={self.bos_id},eos={self.eos_id},"
            f"pad={self.pad_id},vocab={self.vocab_size}"
        )
