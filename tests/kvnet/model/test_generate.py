"""Greedy generation through the paged cache equals full recomputation, with and without prefix reuse."""

from __future__ import annotations

import pytest
import torch

from kvnet.cache.paged_cache import PagedKVCache
from kvnet.errors import CacheUsageError, ContextLengthError, InvalidTokenError, PoolExhaustedError
from kvnet.model.generate import (
    SamplingParams,
    TokenSampler,
    cache_spec_for,
    commit_prompt_blocks,
    decode_one_token,
    generate,
    generate_reference,
    prefill,
    prefix_root,
)
from kvnet.model.transformer import Transformer

CPU = torch.device("cpu")
BLOCK_SIZE = 16
NUM_NEW_TOKENS = 64


def new_cache(model: Transformer, num_blocks: int = 64) -> PagedKVCache:
    return PagedKVCache(cache_spec_for(model, BLOCK_SIZE), num_blocks, CPU)


def random_prompt(length: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


SHARED_PREFIX = random_prompt(50, seed=1)  # 3 full blocks + 2 tokens
PROMPT_A = [*SHARED_PREFIX, *random_prompt(13, seed=2)]
PROMPT_B = [*SHARED_PREFIX, *random_prompt(9, seed=3)]


@pytest.fixture(scope="module")
def expected(model: Transformer) -> dict[str, list[int]]:
    return {
        "a": generate_reference(model, PROMPT_A, NUM_NEW_TOKENS),
        "b": generate_reference(model, PROMPT_B, NUM_NEW_TOKENS),
    }


def test_generation_equals_full_recompute(
    model: Transformer, root: bytes, expected: dict[str, list[int]]
) -> None:
    cache = new_cache(model)
    result = generate(model, cache, PROMPT_A, NUM_NEW_TOKENS, root=root, chunk_size=24)
    assert result.token_ids == expected["a"]
    assert len(set(result.token_ids)) > 4  # the model's output depends on context, not a constant
    assert (result.prompt_tokens, result.cached_tokens) == (len(PROMPT_A), 0)
    assert result.computed_tokens == len(PROMPT_A)
    assert len(result.block_hashes) == len(PROMPT_A) // BLOCK_SIZE
    assert result.prefill_seconds > 0 and result.decode_seconds > 0 and result.decode_tokens_per_second > 0
    stats = cache.stats()
    assert stats.num_sequences == 0 and stats.cached_blocks == len(result.block_hashes)


def test_prefix_hit_reuses_cached_blocks(
    model: Transformer, root: bytes, expected: dict[str, list[int]]
) -> None:
    cache = new_cache(model)
    generate(model, cache, PROMPT_A, 4, root=root)
    result = generate(model, cache, PROMPT_B, NUM_NEW_TOKENS, root=root, seq_id=1)
    assert result.cached_tokens == 48 and result.computed_tokens == len(PROMPT_B) - 48
    assert result.token_ids == expected["b"]
    # The same prompt again: every full block hits, but the last block is recomputed for its logits.
    again = generate(model, cache, PROMPT_B, NUM_NEW_TOKENS, root=root, seq_id=2)
    assert again.cached_tokens == 48 and again.token_ids == expected["b"]


def test_prompt_of_whole_blocks_fully_cached(model: Transformer, root: bytes) -> None:
    prompt = SHARED_PREFIX[:48]
    reference = generate_reference(model, prompt, 16)
    cache = new_cache(model)
    assert generate(model, cache, prompt, 16, root=root).token_ids == reference
    again = generate(model, cache, prompt, 16, root=root)
    assert again.cached_tokens == 32 and again.computed_tokens == 16 and again.token_ids == reference


def test_imported_prefix_blocks(model: Transformer, root: bytes, expected: dict[str, list[int]]) -> None:
    publisher = new_cache(model)
    published = generate(model, publisher, PROMPT_A, 0, root=root)  # prefill + commit only
    assert published.token_ids == []
    subscriber = new_cache(model)
    for block_hash in published.block_hashes:
        subscriber.import_block(block_hash, publisher.export_block(block_hash))
    result = generate(model, subscriber, PROMPT_B, NUM_NEW_TOKENS, root=root)
    assert result.cached_tokens == 48
    assert result.token_ids == expected["b"]


def test_different_root_never_hits(model: Transformer, root: bytes) -> None:
    cache = new_cache(model)
    generate(model, cache, PROMPT_A, 1, root=root)
    salted = prefix_root(model, BLOCK_SIZE, salt=b"tenant-2")
    assert generate(model, cache, PROMPT_A, 1, root=salted).cached_tokens == 0


def test_concurrent_sequences_sharing_a_prefix(
    model: Transformer, root: bytes, expected: dict[str, list[int]]
) -> None:
    prompts = [PROMPT_A, PROMPT_B, PROMPT_A, [*SHARED_PREFIX, 7, 7, 7]]
    alone = [expected["a"], expected["b"], expected["a"], generate_reference(model, prompts[3], 24)]
    cache = new_cache(model)
    next_tokens: list[int] = []
    for seq_id, prompt in enumerate(prompts):
        result = prefill(model, cache, seq_id, prompt, root=root)
        commit_prompt_blocks(cache, seq_id, result.block_hashes)
        assert result.cached_tokens == (0 if seq_id == 0 else 48)
        next_tokens.append(int(result.logits.argmax()))
    tables = [cache.block_table(seq_id)[:3].tolist() for seq_id in range(len(prompts))]
    assert all(table == tables[0] for table in tables)  # one physical copy of the shared prefix
    outputs: list[list[int]] = [[] for _ in prompts]
    for _ in range(24):  # round-robin decode: all sequences live in the cache at once
        for seq_id in range(len(prompts)):
            outputs[seq_id].append(next_tokens[seq_id])
            next_tokens[seq_id] = int(decode_one_token(model, cache, seq_id, next_tokens[seq_id]).argmax())
    for output, reference in zip(outputs, alone, strict=True):
        assert output == reference[:24]
    for seq_id in range(len(prompts)):
        cache.free_sequence(seq_id)
    assert cache.stats().used_blocks == 0


def test_stop_token_ends_generation(model: Transformer, root: bytes, expected: dict[str, list[int]]) -> None:
    stop = expected["a"][5]
    result = generate(model, new_cache(model), PROMPT_A, NUM_NEW_TOKENS, root=root, stop_token_ids={stop})
    assert result.token_ids == expected["a"][: expected["a"].index(stop) + 1]
    assert generate_reference(model, PROMPT_A, NUM_NEW_TOKENS, stop_token_ids={stop}) == result.token_ids


def test_temperature_zero_is_bit_exact_greedy(
    model: Transformer, root: bytes, expected: dict[str, list[int]]
) -> None:
    params = SamplingParams(temperature=0.0, top_p=0.5, seed=7)
    result = generate(model, new_cache(model), PROMPT_A, NUM_NEW_TOKENS, root=root, sampling=params)
    assert result.token_ids == expected["a"]


def test_seeded_sampling_repeats_and_seeds_differ(model: Transformer, root: bytes) -> None:
    def run(seed: int) -> list[int]:
        params = SamplingParams(temperature=1.5, seed=seed)
        return generate(model, new_cache(model), PROMPT_A, 24, root=root, sampling=params).token_ids

    first = run(1)
    assert first == run(1)
    assert first != run(2)


def test_top_p_keeps_only_the_nucleus() -> None:
    # Probabilities 0.5, 0.3, 0.2 (after softmax of log-probs): top_p 0.6 keeps the first two only.
    logits = torch.log(torch.tensor([0.2, 0.5, 0.3]))
    sampler = TokenSampler(SamplingParams(temperature=1.0, top_p=0.6, seed=0))
    drawn = {sampler(logits) for _ in range(200)}
    assert drawn == {1, 2}
    tiny = TokenSampler(SamplingParams(temperature=1.0, top_p=1e-6, seed=0))
    assert {tiny(logits) for _ in range(20)} == {1}


@pytest.mark.parametrize(("temperature", "top_p"), [(-0.1, 1.0), (1.0, 0.0), (1.0, 1.5), (101.0, 1.0)])
def test_sampling_params_refuse_out_of_range(temperature: float, top_p: float) -> None:
    with pytest.raises(ValueError, match="must be in"):
        SamplingParams(temperature=temperature, top_p=top_p)


def test_on_token_false_ends_generation(
    model: Transformer, root: bytes, expected: dict[str, list[int]]
) -> None:
    seen: list[int] = []

    def on_token(token: int) -> bool:
        seen.append(token)
        return len(seen) < 3

    result = generate(model, new_cache(model), PROMPT_A, NUM_NEW_TOKENS, root=root, on_token=on_token)
    assert result.token_ids == seen == expected["a"][:3]


@pytest.mark.parametrize(
    ("prompt", "error", "message"),
    [
        ([1, 2, 259], InvalidTokenError, r"token 2 has id 259, outside the vocabulary \[0, 259\)"),
        ([-1, 2], InvalidTokenError, "token 0 has id -1"),
        ([], InvalidTokenError, "at least one token"),
        ([1, 2.5], InvalidTokenError, "token 1 is not an int"),
        (torch.tensor([1.0, 2.0]), InvalidTokenError, "must be integers"),
        (torch.tensor([[1, 2]]), InvalidTokenError, "must be 1-D"),
        ([1] * 2000, ContextLengthError, "exceeds the model's max_seq_len of 2048"),
    ],
)
def test_bad_input_leaves_cache_usable(
    model: Transformer, root: bytes, expected: dict[str, list[int]], prompt: object, error: type, message: str
) -> None:
    cache = new_cache(model)
    generate(model, cache, PROMPT_A, 1, root=root)
    before = cache.stats()
    with pytest.raises(error, match=message):
        generate(model, cache, prompt, NUM_NEW_TOKENS, root=root)  # type: ignore[arg-type]
    assert cache.stats() == before
    assert generate(model, cache, PROMPT_B, NUM_NEW_TOKENS, root=root).token_ids == expected["b"]


def test_pool_exhaustion_frees_the_sequence(model: Transformer, root: bytes) -> None:
    cache = new_cache(model, num_blocks=3)
    with pytest.raises(PoolExhaustedError):
        prefill(model, cache, 0, PROMPT_A, root=root)  # needs 4 blocks
    assert not cache.has_sequence(0) and cache.stats().used_blocks == 0
    reference = generate_reference(model, PROMPT_A[:20], 4)
    assert generate(model, cache, PROMPT_A[:20], 4, root=root).token_ids == reference


def test_decode_past_max_seq_len_raises(model: Transformer, root: bytes) -> None:
    cache = new_cache(model, num_blocks=130)
    prefill(model, cache, 0, [1] * 2048, root=root, chunk_size=1024)
    with pytest.raises(ContextLengthError, match="max_seq_len"):
        decode_one_token(model, cache, 0, 1)
    assert cache.num_tokens(0) == 2048


def test_cache_must_match_model(model: Transformer, root: bytes) -> None:
    bf16_model = Transformer.from_name("tiny", device=CPU, dtype=torch.bfloat16)
    bf16_cache = PagedKVCache(cache_spec_for(bf16_model, BLOCK_SIZE), 8, CPU)
    with pytest.raises(CacheUsageError, match="does not match the model"):
        generate(model, bf16_cache, PROMPT_A, 1, root=root)
    assert bf16_cache.stats().num_sequences == 0
