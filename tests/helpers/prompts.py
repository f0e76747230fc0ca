"""A publisher's signed prompt, shared by tests and benchmarks: seeded random K/V in a paged cache, the
blocks' identities and their objects (lossless unless asked otherwise) signed by a fresh key."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvnet.blocks.identity import BlockIdentity, prompt_blocks
from kvnet.cache.hashing import block_hashes, root_hash
from kvnet.cache.paged_cache import CacheSpec, PagedKVCache
from kvnet.exchange.blockstore import StoredBlock
from kvnet.exchange.publishing import encode_blocks
from kvnet.security.signing import Signer, TrustStore

__all__ = ["SignedPrompt", "prompt_identities", "signed_prompt"]


@dataclass
class SignedPrompt:
    """What a publisher computed and serves for one prompt."""

    spec: CacheSpec
    source: PagedKVCache
    """The K/V the objects were encoded from (what a verified fetch must reproduce bit for bit)."""
    hashes: list[bytes]
    identities: list[BlockIdentity]
    blocks: list[StoredBlock]
    """One entry per block (lossless unless asked otherwise), in chain order."""
    signer: Signer

    @property
    def tokens(self) -> int:
        return len(self.blocks) * self.spec.block_size

    @property
    def wire_bytes(self) -> int:
        return sum(b.nbytes for b in self.blocks)

    def trust(self) -> TrustStore:
        """A trust store holding the signer's key."""
        trust = TrustStore()
        trust.add(self.signer.public_key)
        return trust


def prompt_identities(
    block_size: int, n_blocks: int, *, fingerprint: bytes, salt: bytes
) -> tuple[list[bytes], list[BlockIdentity]]:
    """Block hashes and identities of the ``n_blocks``-block prompt: what a subscriber computes from its
    own prompt, without the KV."""
    token_ids = [(7 * i + 3) % 32000 for i in range(n_blocks * block_size + 1)]
    root = root_hash(fingerprint, salt)
    hashes = block_hashes(token_ids, block_size, root)
    return hashes, prompt_blocks(token_ids, block_size, hashes, root, 0, len(hashes))


def signed_prompt(
    spec: CacheSpec, n_blocks: int, *, fingerprint: bytes, salt: bytes, seed: int, rendition: str = "lossless"
) -> SignedPrompt:
    """Seeded random K/V (``spec.dtype``) for ``n_blocks`` blocks, encoded in ``rendition`` and signed."""
    hashes, identities = prompt_identities(spec.block_size, n_blocks, fingerprint=fingerprint, salt=salt)
    source = PagedKVCache(spec, num_blocks=n_blocks, device=torch.device("cpu"))
    gen = torch.Generator().manual_seed(seed)
    layer_shape = (spec.block_size, spec.num_kv_heads, spec.head_dim)
    for block_hash in hashes:
        assert source.begin_import(block_hash)
        for layer in range(spec.num_layers):
            k, v = (torch.randn(layer_shape, generator=gen).to(spec.dtype) for _ in range(2))
            source.import_layer(block_hash, layer, k, v)
        source.finish_import(block_hash)
    signer = Signer.generate()
    blocks = encode_blocks(
        source, identities, fingerprint=fingerprint, renditions=(rendition,), signer=signer
    )
    return SignedPrompt(spec, source, hashes, identities, blocks, signer)
