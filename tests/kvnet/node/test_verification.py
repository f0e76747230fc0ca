"""What ``--verify`` reports (``kvnet.node.verification``), on a real node (tiny model, no relay).

A prefix whose K/V is not what this node would compute for it stands in for K/V loaded from a publisher
whose kernels rounded differently (a CPU with AMX computing bfloat16 in another batch shape): the loaded K/V
is imported into the node's cache exactly as a fetch imports it, and the request reuses it. ``verified``
then compares with the local-hit reference that holds the same K/V, ``equals_recompute`` with a cold
recompute, and the two fields diverge, on any CPU.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import torch

from kvnet.blocks.codecs import CODECS
from kvnet.cache.paged_cache import BlockKV, PagedKVCache
from kvnet.model.generate import generate
from kvnet.model.transformer import Transformer
from kvnet.node.node import Node, NodeConfig
from kvnet.node.verification import EXACT_RENDITIONS, PrefixBlock, Verification, kv_exact, run_alone

BLOCK = 16
PROMPT = "A shared document that several users ask about, long enough for a few blocks. Question?"
MAX_NEW = 8


@pytest.fixture
async def node() -> AsyncIterator[Node]:
    built = Node(NodeConfig(model="tiny", block_size=BLOCK, cache_blocks=64),
                 Transformer.from_name("tiny", device=torch.device("cpu")))
    try:
        yield built
    finally:
        await built.close()


def own_prefix(node: Node, ids: list[int], blocks: int) -> list[PrefixBlock]:
    """The K/V this node computes for the first ``blocks`` blocks of ``ids`` (the prompt alone)."""
    cache = PagedKVCache(node.cache.spec, blocks + 2, node.device)
    result = generate(node.model, cache, ids[: blocks * BLOCK + 1], 0, root=node.root, keep_sequence=True)
    return [PrefixBlock(h, cache.export_block(h)) for h in result.block_hashes[:blocks]]


def load(node: Node, prefix: list[PrefixBlock]) -> None:
    """Write ``prefix`` into the node's cache the way a fetch does: layer by layer, then made visible."""
    for block in prefix:
        assert node.cache.begin_import(block.block_hash)
        for layer in range(node.cache.spec.num_layers):
            node.cache.import_layer(block.block_hash, layer, block.kv.k[layer], block.kv.v[layer])
        node.cache.finish_import(block.block_hash)


def reference(node: Node, ids: list[int], prefix: list[PrefixBlock]) -> list[int]:
    """The node's output for ``ids`` run alone with ``prefix`` held in a fresh cache."""
    return run_alone(node.model, node.cache, root=node.root, config=node.engine.config, prompt_ids=ids,
                     max_new_tokens=MAX_NEW, prefix=prefix, stop_token_ids=(node.tokenizer.eos_id,))


def perturbed(prefix: list[PrefixBlock], how: str) -> list[PrefixBlock]:
    out = []
    for block in prefix:
        k, v = block.kv.k.clone(), block.kv.v.clone()
        if how == "last-bit":  # one ulp on every element: what another kernel's rounding does
            k, v = torch.nextafter(k, k + 1), torch.nextafter(v, v + 1)
        else:  # far off: enough to change what the model writes
            gen = torch.Generator().manual_seed(7)
            k = k + 2.0 * torch.randn(k.shape, generator=gen)
            v = v + 2.0 * torch.randn(v.shape, generator=gen)
        out.append(PrefixBlock(block.block_hash, BlockKV(k, v)))
    return out


async def test_cold_request_is_verified_and_equals_recompute(node: Node) -> None:
    report = await node.complete(PROMPT, MAX_NEW, verify=True)
    out = report.to_json()
    assert report.remote_hit_tokens == report.local_hit_tokens == 0
    assert out["kv_exact"] is True and out["verified"] is True and out["equals_recompute"] is True


async def test_without_verify_the_report_has_no_verdicts(node: Node) -> None:
    out = (await node.complete(PROMPT, MAX_NEW)).to_json()
    assert "verified" not in out and "equals_recompute" not in out and out["kv_exact"] is True


async def test_a_reused_prefix_unlike_recompute_is_verified_against_the_local_hit(node: Node) -> None:
    ids = node.tokenize_prompt(PROMPT)
    blocks = (len(ids) - 1) // BLOCK
    assert blocks >= 3
    own = own_prefix(node, ids, blocks)
    loaded = perturbed(own, "far")
    load(node, loaded)
    report = await node.complete(PROMPT, MAX_NEW, verify=True)
    assert report.local_hit_tokens == blocks * BLOCK and report.computed_tokens == len(ids) - blocks * BLOCK
    # The verdicts are what the two references give: the one holding the K/V the request reused, and the
    # cold one computing it afresh.
    local_hit, cold = reference(node, ids, loaded), reference(node, ids, [])
    assert local_hit != cold, "the perturbation must change the output for the fields to differ"
    assert report.output_token_ids == local_hit
    out = report.to_json()
    assert out["verified"] is True and out["kv_exact"] is True and out["equals_recompute"] is False


async def test_a_last_bit_difference_in_the_prefix_still_verifies(node: Node) -> None:
    ids = node.tokenize_prompt(PROMPT)
    blocks = (len(ids) - 1) // BLOCK
    own = own_prefix(node, ids, blocks)
    loaded = perturbed(own, "last-bit")
    assert all(not torch.equal(a.kv.k, b.kv.k) for a, b in zip(own, loaded, strict=True))
    load(node, loaded)
    report = await node.complete(PROMPT, MAX_NEW, verify=True)
    assert report.local_hit_tokens == blocks * BLOCK and report.verified is True


async def test_a_wrong_output_is_not_verified(node: Node) -> None:
    ids = node.tokenize_prompt(PROMPT)
    report = await node.complete(PROMPT, MAX_NEW, verify=True)
    wrong = [(t + 1) % node.model.args.vocab_size for t in report.output_token_ids]
    found = node.verify_output(ids, MAX_NEW, wrong)
    assert found == Verification(kv_exact=True, equals_local_hit=False, equals_recompute=False)
    assert not found.verified


def test_kv_exact_only_for_bit_exact_blocks_of_trusted_signers() -> None:
    assert {"lossless", "plain"} == EXACT_RENDITIONS
    assert kv_exact({}) and kv_exact({"lossless": 3}) and kv_exact({"plain": 2})
    assert kv_exact({"lossless": 2, "plain": 1}) and kv_exact({"int8": 0, "plain": 1})
    assert not kv_exact({"lossless": 2, "int8": 1}) and not kv_exact({"plain": 2, "int4": 1})
    assert not kv_exact({"int4": 1}) and not kv_exact({"unknown": 1})
    assert not kv_exact({"lossless": 3}, untrusted=1) and not kv_exact({"plain": 3}, untrusted=1)
    assert not Verification(kv_exact=False, equals_local_hit=True, equals_recompute=True).verified
    assert Verification(kv_exact=True, equals_local_hit=True, equals_recompute=False).verified


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_exact_renditions_are_the_codecs_that_decode_bit_for_bit(dtype: torch.dtype) -> None:
    """``kv_exact`` trusts the codecs' own ``lossless`` flag: each codec's round trip of one layer (with a
    negative zero, a subnormal and a large value) agrees with it."""
    gen = torch.Generator().manual_seed(7)
    k, v = (torch.randn(BLOCK, 2, 32, generator=gen).to(dtype) for _ in range(2))
    k[0, 0, :3] = torch.tensor([-0.0, torch.finfo(dtype).tiny / 4, 1e30]).to(dtype)
    for name, codec in CODECS.items():
        dk, dv = codec.decode(codec.encode(k, v), (BLOCK, 2, 32), dtype)
        same = all(torch.equal(a.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                               b.view(torch.int16 if dtype == torch.bfloat16 else torch.int32))
                   for a, b in ((dk, k), (dv, v)))
        assert same == (name in EXACT_RENDITIONS), name
