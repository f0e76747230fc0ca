"""What ``--verify`` checks of a completion, and the references it compares the output with.

A completion is ``verified`` when both hold:

* ``kv_exact``: every block it loaded from a relay is a trusted publisher's K/V bit for bit. Each layer's
  payload matched the digest in the publisher's signed manifest as it arrived (``kvnet.exchange.fetching``: a
  block that fails is refused and recomputed, never loaded), the signer is in the trust store (a block
  accepted only under ``--trust-any`` is its signer's, not a trusted publisher's), and it came in a
  bit-exact rendition (``Codec.lossless``: ``lossless`` and ``plain``; ``int8`` and ``int4`` are
  approximations by design).
* The output equals the **local-hit reference**: this node's own output with the same prefix held locally.
  A fresh cache holds exactly the prefix blocks the request reused (local and remote hits, the very K/V it
  attended to; with fetch and compute at once, ``kvnet.node.overlap``, also the head this node computed
  while the tail was fetched, since the request found it in the cache like any hit), then the rest of the
  prompt is prefilled and the output decoded by the same scheduler, step budget and sampling the request
  ran with. It is the reference a vLLM engine gives for its own prefix-cache
  hit: reuse is correct when the output is what this node computes from that K/V.

``equals_recompute`` is reported beside them, and is not verification: the output equals a cold recompute
(an empty cache, the whole prompt prefilled here). Where the kernels give each row the same bits whatever
the batch shape it is True whenever ``verified`` is: float32 on the CPUs the suite has run on (AMD EPYC with
AVX2, Intel Xeon with AMX), bfloat16 on the AVX2 one. On CPUs with AMX, bfloat16 prefill rounds differently
for a different number of rows: the publisher computed the prefix as part of its own prompt, the cold
recompute as part of this longer one, so the prefix K/V differs in the last bits and the outputs may differ
although the loaded K/V is exactly the publisher's.

The references run the request alone. A request the engine batched with other requests had other batch
shapes; on shape-dependent kernels its output may then differ from the reference, and ``verified`` says so.
The references sample as the request did, so only greedy or seeded sampling gives a comparable output.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

import torch

from kvnet.blocks.codecs import CODECS
from kvnet.cache.paged_cache import BlockKV, PagedKVCache
from kvnet.errors import KVCacheError
from kvnet.model.batching import (
    BatchScheduler,
    SchedulerConfig,
    SequenceFailed,
    SequenceFinished,
    SequenceRequest,
)
from kvnet.model.generate import GREEDY, SamplingParams
from kvnet.model.transformer import Transformer

EXACT_RENDITIONS: frozenset[str] = frozenset(name for name, codec in CODECS.items() if codec.lossless)
"""The renditions whose decoded K/V is the publisher's bit for bit (``lossless``, ``plain``)."""


class VerificationError(KVCacheError):
    """A reference output could not be computed as specified (a bug, not a property of the output)."""


@dataclass(frozen=True)
class PrefixBlock:
    """One cached block a request reused, copied out of the cache before anything can evict it."""

    block_hash: bytes
    kv: BlockKV


@dataclass(frozen=True)
class Verification:
    """What ``--verify`` found for one completion (the report's ``kv_exact``, ``verified``,
    ``equals_recompute``)."""

    kv_exact: bool
    equals_local_hit: bool
    """The output equals the local-hit reference."""
    equals_recompute: bool
    """The output equals a cold recompute (not part of ``verified``; see the module docstring)."""

    @property
    def verified(self) -> bool:
        return self.kv_exact and self.equals_local_hit


def kv_exact(renditions: Mapping[str, int], untrusted: int = 0) -> bool:
    """Whether the blocks a fetch loaded (rendition -> count and blocks from untrusted signers, as in
    ``FetchOutcome``) are a trusted publisher's K/V bit for bit: their digests were checked on arrival, so
    it is a matter of rendition and signer."""
    exact = all(name in EXACT_RENDITIONS for name, count in renditions.items() if count > 0)
    return exact and untrusted == 0


def snapshot_prefix(cache: PagedKVCache, hashes: Sequence[bytes]) -> list[PrefixBlock]:
    """Copies of the cached blocks ``hashes`` (a sequence that still references them keeps them cached)."""
    return [PrefixBlock(h, cache.export_block(h)) for h in hashes]


def run_alone(
    model: Transformer,
    cache_like: PagedKVCache,
    *,
    root: bytes,
    config: SchedulerConfig,
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    prefix: Sequence[PrefixBlock] = (),
    sampling: SamplingParams = GREEDY,
    stop_token_ids: Collection[int] = (),
) -> list[int]:
    """The tokens a scheduler with ``config`` generates for the prompt alone, in a fresh cache shaped like
    ``cache_like`` that holds exactly ``prefix`` (which the prompt's hashes then reuse)."""
    block_size = cache_like.spec.block_size
    num_blocks = len(prefix) + -(-(len(prompt_ids) + max_new_tokens) // block_size) + 1
    fresh = PagedKVCache(cache_like.spec, num_blocks, cache_like.device)
    for block in prefix:
        fresh.import_block(block.block_hash, block.kv)
    scheduler = BatchScheduler(model, fresh, root=root, config=config)
    request = SequenceRequest(
        tuple(prompt_ids), max_new_tokens, sampling, frozenset(stop_token_ids), commit_prompt=False
    )
    scheduler.add(0, request)
    with torch.no_grad():
        while scheduler.has_work():
            for event in scheduler.step():
                if isinstance(event, SequenceFailed):
                    raise event.error
                if isinstance(event, SequenceFinished):
                    reused = event.result.cached_tokens
                    if reused != len(prefix) * block_size:  # the reference must reuse exactly the prefix
                        raise VerificationError(
                            f"the reference reused {reused} tokens, not the {len(prefix)} blocks it holds"
                        )
                    return list(event.result.token_ids)
    raise VerificationError("the reference sequence never finished")
