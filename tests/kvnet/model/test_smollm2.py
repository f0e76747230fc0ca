"""kvnet on a real trained model (SmolLM2-135M-Instruct, converted from its GGUF) against Hugging Face
transformers reading the same GGUF file on its own, and bf16 KV that survives the lossless codec."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from kvnet.blocks.codecs import get_codec
from kvnet.cache.paged_cache import BlockKV, PagedKVCache
from kvnet.model.checkpoint import load_checkpoint
from kvnet.model.generate import cache_spec_for, generate, prefix_root
from kvnet.model.registry import MODELS, packaged_file
from kvnet.model.tokenizer import HFTokenizer, load_tokenizer
from kvnet.model.transformer import Transformer

CPU = torch.device("cpu")
DOCUMENTS = Path(__file__).resolve().parents[3] / "benchmarks" / "documents"
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir: Path) -> HFTokenizer:
    loaded = load_tokenizer(smollm2_dir)
    assert isinstance(loaded, HFTokenizer)
    return loaded


@pytest.fixture(scope="module")
def prompts(tokenizer: HFTokenizer) -> dict[str, list[int]]:
    documents = "\n\n".join((DOCUMENTS / name).read_text() for name in ("lighthouse.txt", "caching.txt"))
    chat = [
        {"role": "system", "content": "You answer questions about the documents below.\n\n" + documents},
        {"role": "user", "content": "When was the lighthouse automated, and why can prompts share KV?"},
    ]
    return {
        "france": tokenizer.tokenize("The capital of France is"),
        "code": tokenizer.tokenize("def fibonacci(n):\n    "),
        "chat-2k": tokenizer.tokenize_chat(chat),
    }


@pytest.fixture(scope="module")
def reference() -> Any:
    """transformers' LlamaForCausalLM loaded from the GGUF file directly (its own dequantizer)."""
    transformers = pytest.importorskip("transformers", reason="transformers is in the test extras")
    pytest.importorskip("accelerate", reason="transformers needs accelerate to read GGUF weights")
    gguf_file = packaged_file(MODELS["smollm2"])
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(gguf_file.parent), gguf_file=gguf_file.name, dtype=torch.float32
    )
    return model.eval()


@pytest.fixture(scope="module")
def fp32_model(smollm2_dir: Path, tokenizer: HFTokenizer) -> Transformer:
    identity = tokenizer.identity()
    return load_checkpoint(smollm2_dir, device=CPU, dtype=torch.float32, tokenizer_identity=identity)


def test_chat_prompt_is_about_2k_tokens(prompts: dict[str, list[int]]) -> None:
    assert 1800 <= len(prompts["chat-2k"]) <= 2600


@pytest.mark.parametrize("name", ["france", "code", pytest.param("chat-2k", marks=pytest.mark.slow)])
def test_fp32_greedy_tokens_and_logits_equal_transformers(
    fp32_model: Transformer, reference: Any, tokenizer: HFTokenizer, prompts: dict[str, list[int]], name: str
) -> None:
    ids = prompts[name]
    cache = PagedKVCache(cache_spec_for(fp32_model, 64), -(-(len(ids) + NEW_TOKENS) // 64) + 1, CPU)
    root = prefix_root(fp32_model, 64)
    ours = generate(fp32_model, cache, ids, NEW_TOKENS, root=root, keep_sequence=True)
    with torch.no_grad():
        # Teacher-forced logits over the prompt plus what kvnet generated: transformers' greedy choice at
        # every step equals kvnet's token exactly when its argmax there does (one pass, not a generate loop).
        full = torch.tensor(ids + ours.token_ids)
        their_logits = reference(full[None]).logits[0]
        our_logits = fp32_model.forward_full(full)
    theirs = their_logits[len(ids) - 1 : -1].argmax(-1).tolist()
    assert ours.token_ids == theirs
    if name == "france":
        assert tokenizer.detokenize(ours.token_ids).startswith(" Paris")
    torch.testing.assert_close(our_logits, their_logits, rtol=0, atol=1e-4)


@pytest.mark.slow
def test_bf16_kv_through_lossless_codec_is_the_publishers_bit_for_bit(
    smollm2_dir: Path, tokenizer: HFTokenizer, prompts: dict[str, list[int]]
) -> None:
    # Compared with the publisher's own K/V and with the publisher's K/V held locally, never with a
    # recompute of the longer prompt: on a CPU with AMX, bfloat16 prefill rounds by batch shape, so the
    # same tokens computed inside another prompt differ in the last bits (docs/nodes.md).
    model = load_checkpoint(smollm2_dir, device=CPU, tokenizer_identity=tokenizer.identity())
    assert model.dtype == torch.bfloat16  # the model's own dtype: KV is kept as engines keep it
    block = 16
    shared = prompts["chat-2k"][:64]
    question = tokenizer.tokenize("\nWhat is this about?", bos=False)
    spec = cache_spec_for(model, block)
    root = prefix_root(model, block)
    publisher = PagedKVCache(spec, 16, CPU)
    published = generate(model, publisher, shared, 1, root=root)
    codec = get_codec("lossless")
    subscriber = PagedKVCache(spec, 32, CPU)
    block_shape = (spec.block_size, spec.num_kv_heads, spec.head_dim)
    for block_hash in published.block_hashes:
        kv = publisher.export_block(block_hash)
        layers = [
            codec.decode(codec.encode(kv.k[layer], kv.v[layer]), block_shape, model.dtype)
            for layer in range(spec.num_layers)
        ]
        subscriber.import_block(
            block_hash, BlockKV(torch.stack([k for k, _ in layers]), torch.stack([v for _, v in layers]))
        )
    remote = generate(model, subscriber, shared + question, 4, root=root, keep_sequence=True)
    assert remote.cached_tokens == len(shared) // block * block
    local_hit_cache = PagedKVCache(spec, 32, CPU)
    for block_hash in published.block_hashes:
        local_hit_cache.import_block(block_hash, publisher.export_block(block_hash))
    local_hit = generate(model, local_hit_cache, shared + question, 4, root=root)
    assert local_hit.cached_tokens == remote.cached_tokens and remote.token_ids == local_hit.token_ids
    for block_hash in published.block_hashes:
        fetched, own = subscriber.export_block(block_hash), publisher.export_block(block_hash)
        assert torch.equal(fetched.k.view(torch.int16), own.k.view(torch.int16))
        assert torch.equal(fetched.v.view(torch.int16), own.v.view(torch.int16))
