"""Generation over the paged KV cache (greedy or seeded sampling) and the cache-free reference.

This module owns the inference loop: input validation, prefill of the uncached part of a prompt (chunked),
one-token decode steps, choosing each next token (`SamplingParams`: argmax at temperature 0, else seeded
temperature / top-p sampling), and registering a prompt's full blocks so they can be shared and exported.
It drives `kvnet.model.transformer.Transformer` and `kvnet.cache.paged_cache.PagedKVCache` through their
public APIs only and knows nothing about codecs or the network. Block hashes are chained from a
caller-supplied ``root`` (`prefix_root`), computed once per process because the fingerprint hashes all
weights.

Every public function validates its inputs before it touches the cache, and a failure after a sequence was
added frees that sequence again, so a bad request never leaves the cache in a half-written state.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from kvnet.cache.hashing import block_hashes, root_hash
from kvnet.cache.paged_cache import CacheSpec, PagedKVCache
from kvnet.errors import CacheUsageError, ContextLengthError, InvalidTokenError
from kvnet.model.defaults import DEFAULT_PREFILL_CHUNK
from kvnet.model.transformer import Transformer

TokenIdsLike = Sequence[int] | Tensor
"""Token ids as a sequence of ints or a 1-D integer tensor."""


@dataclass(frozen=True)
class PrefillResult:
    """What `prefill` did for one sequence."""

    logits: Tensor
    """[vocab] logits after the last prompt token (they choose the first generated token)."""
    cached_tokens: int
    """Leading prompt tokens whose K/V came from the cache (shared or imported blocks)."""
    computed_tokens: int
    """Prompt tokens run through the model (``len(prompt) - cached_tokens``)."""
    block_hashes: tuple[bytes, ...]
    """Chained hashes of the prompt's full blocks, in order."""


@dataclass(frozen=True)
class GenerationResult:
    """Outcome of `generate` for one prompt."""

    token_ids: list[int]
    """Generated ids, prompt excluded; ends with a stop id if one was produced."""
    prompt_tokens: int
    """Length of the prompt."""
    cached_tokens: int
    """Prompt tokens whose K/V came from the cache."""
    computed_tokens: int
    """Prompt tokens prefilled by the model."""
    block_hashes: tuple[bytes, ...]
    """Hashes of the prompt's full blocks (committed to the cache when ``commit_prompt`` was set)."""
    prefill_seconds: float
    """Wall time of prefill and prompt-block commit."""
    decode_seconds: float
    """Wall time of the decode steps."""

    @property
    def decode_tokens_per_second(self) -> float:
        """Generated tokens after the first, per second of decoding (0.0 when there were none)."""
        steps = max(len(self.token_ids) - 1, 0)
        return steps / self.decode_seconds if steps and self.decode_seconds > 0 else 0.0


@dataclass(frozen=True)
class SamplingParams:
    """How the next token is chosen from the logits.

    Temperature 0 is greedy (argmax, bit-exact with `generate_reference`); above 0 the logits are divided
    by the temperature, the smallest set of tokens whose probabilities reach `top_p` is kept, and one is
    drawn with a generator seeded from `seed` (so a seeded request repeats exactly).
    """

    temperature: float = 0.0
    """0 for greedy; otherwise > 0."""
    top_p: float = 1.0
    """Nucleus mass in (0, 1]."""
    seed: int | None = None
    """Seed of the sampling generator; None draws a fresh one."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.temperature <= 100.0:
            raise ValueError(f"temperature must be in [0, 100], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


GREEDY = SamplingParams()


class TokenSampler:
    """Chooses next tokens for one sequence under `SamplingParams` (owns its seeded generator)."""

    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        self._generator: torch.Generator | None = None
        if not params.greedy:
            self._generator = torch.Generator(device="cpu")
            if params.seed is None:
                self._generator.seed()
            else:
                self._generator.manual_seed(params.seed)

    def __call__(self, logits: Tensor) -> int:
        """The next token id from ``[vocab]`` logits."""
        if self._generator is None:
            return int(logits.argmax())
        # Sample on the CPU in float32 so a seed gives the same draw whatever the model's device/dtype.
        scaled = logits.detach().to(device="cpu", dtype=torch.float32) / self.params.temperature
        probs = torch.softmax(scaled, dim=-1)  # [vocab]
        if self.params.top_p < 1.0:
            sorted_probs, order = torch.sort(probs, descending=True)
            # Keep every token whose preceding mass is below top_p (the first one always).
            keep = (torch.cumsum(sorted_probs, dim=-1) - sorted_probs) < self.params.top_p
            kept = torch.zeros_like(probs)
            kept[order[keep]] = sorted_probs[keep]
            probs = kept
        return int(torch.multinomial(probs, 1, generator=self._generator))


TokenCallback = Callable[[int], bool]
"""Called with each generated id as soon as it is chosen; returning False ends generation there."""


def cache_spec_for(model: Transformer, block_size: int) -> CacheSpec:
    """The `CacheSpec` whose K/V layout and dtype match `model`."""
    args = model.args
    return CacheSpec(
        num_layers=args.n_layers,
        num_kv_heads=args.n_kv_heads,
        head_dim=args.head_dim,
        block_size=block_size,
        dtype=model.dtype,
    )


def prefix_root(model: Transformer, block_size: int, salt: bytes = b"") -> bytes:
    """Root of the block-hash chain for `model` with `block_size` and a tenant `salt` (hashes all weights)."""
    return root_hash(model.fingerprint(block_size), salt)


def validate_token_ids(model: Transformer, token_ids: TokenIdsLike, what: str = "prompt") -> Tensor:
    """`token_ids` as a 1-D int64 tensor on the model's device; `InvalidTokenError` if any is unusable."""
    vocab_size = model.args.vocab_size
    if isinstance(token_ids, Tensor):
        if token_ids.ndim != 1:
            raise InvalidTokenError(f"{what} token ids must be 1-D, got shape {tuple(token_ids.shape)}")
        if token_ids.dtype.is_floating_point or token_ids.dtype.is_complex or token_ids.dtype == torch.bool:
            raise InvalidTokenError(f"{what} token ids must be integers, got dtype {token_ids.dtype}")
        ids = token_ids.to(device=model.device, dtype=torch.int64)
    else:
        for index, token_id in enumerate(token_ids):
            if isinstance(token_id, bool) or not isinstance(token_id, int):
                raise InvalidTokenError(f"{what} token {index} is not an int: {token_id!r}")
        ids = torch.tensor(list(token_ids), dtype=torch.int64, device=model.device)
    if ids.numel() == 0:
        raise InvalidTokenError(f"{what} must contain at least one token")
    out_of_range = (ids < 0) | (ids >= vocab_size)
    if bool(out_of_range.any()):
        index = int(out_of_range.nonzero()[0, 0])
        raise InvalidTokenError(
            f"{what} token {index} has id {int(ids[index])}, outside the vocabulary [0, {vocab_size})"
        )
    return ids


def check_context_length(model: Transformer, num_prompt_tokens: int, max_new_tokens: int) -> None:
    """`ContextLengthError` unless the prompt plus `max_new_tokens` fits in ``max_seq_len``."""
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be a non-negative int, got {max_new_tokens!r}")
    limit = model.args.max_seq_len
    if num_prompt_tokens + max_new_tokens > limit:
        raise ContextLengthError(
            f"prompt of {num_prompt_tokens} tokens plus {max_new_tokens} new tokens exceeds the model's "
            f"max_seq_len of {limit}"
        )


def check_cache_matches(model: Transformer, cache: PagedKVCache) -> None:
    """`CacheUsageError` unless `cache` stores K/V of `model`'s shape and dtype on its device."""
    expected = cache_spec_for(model, cache.spec.block_size)
    if cache.spec != expected:
        raise CacheUsageError(f"cache spec {cache.spec} does not match the model (expected {expected})")
    if cache.device != model.device:
        raise CacheUsageError(f"cache is on {cache.device} but the model is on {model.device}")


@torch.no_grad()
def prefill(
    model: Transformer,
    cache: PagedKVCache,
    seq_id: int,
    token_ids: TokenIdsLike,
    *,
    root: bytes,
    chunk_size: int = DEFAULT_PREFILL_CHUNK,
) -> PrefillResult:
    """Start sequence `seq_id` for a prompt and compute the K/V of its uncached part.

    The longest cached run of the prompt's full blocks (hashes chained from `root`) is shared; only the
    remaining tokens go through the model, `chunk_size` at a time. Raises `InvalidTokenError` /
    `ContextLengthError` before touching the cache; on any later failure the sequence is freed again.
    """
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size <= 0:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    check_cache_matches(model, cache)
    ids = validate_token_ids(model, token_ids)  # [P]
    num_prompt_tokens = ids.shape[0]
    check_context_length(model, num_prompt_tokens, 0)
    hashes = tuple(block_hashes(ids.cpu().numpy(), cache.spec.block_size, root))
    cached_tokens = cache.add_sequence(seq_id, ids, hashes)
    try:
        if cached_tokens >= num_prompt_tokens:
            # add_sequence always leaves the last prompt token uncached: its logits pick the next token.
            raise CacheUsageError(f"cache reported all {num_prompt_tokens} prompt tokens as cached")
        for start in range(cached_tokens, num_prompt_tokens, chunk_size):
            end = min(start + chunk_size, num_prompt_tokens)
            slot_mapping = cache.append_slots(seq_id, end - start)  # [end - start]
            positions = torch.arange(start, end, device=model.device)
            logits = model(ids[start:end], positions, cache, cache.block_table(seq_id), slot_mapping, end)
    except BaseException:
        cache.free_sequence(seq_id)
        raise
    return PrefillResult(
        logits=logits[-1],
        cached_tokens=cached_tokens,
        computed_tokens=num_prompt_tokens - cached_tokens,
        block_hashes=hashes,
    )


@torch.no_grad()
def decode_one_token(model: Transformer, cache: PagedKVCache, seq_id: int, token_id: int) -> Tensor:
    """Append `token_id` to sequence `seq_id` and return the next-token logits ``[vocab]``."""
    position = cache.num_tokens(seq_id)
    if position >= model.args.max_seq_len:
        raise ContextLengthError(
            f"sequence {seq_id} already holds {position} tokens, the model's max_seq_len"
        )
    token = validate_token_ids(model, [token_id], what="decode")  # [1]
    slot_mapping = cache.append_slots(seq_id, 1)  # [1]
    positions = torch.tensor([position], device=model.device)
    logits = model(token, positions, cache, cache.block_table(seq_id), slot_mapping, position + 1)
    return logits[0]


def commit_prompt_blocks(cache: PagedKVCache, seq_id: int, prompt_block_hashes: Sequence[bytes]) -> int:
    """Register the sequence's written full prompt blocks under their hashes (shareable, exportable).

    Only blocks whose every position has been written are committed. Returns how many became newly cached.
    """
    num_written_blocks = cache.num_tokens(seq_id) // cache.spec.block_size
    return cache.commit_full_blocks(seq_id, prompt_block_hashes[:num_written_blocks])


@torch.no_grad()
def generate(
    model: Transformer,
    cache: PagedKVCache,
    prompt_ids: TokenIdsLike,
    max_new_tokens: int,
    *,
    root: bytes,
    seq_id: int = 0,
    stop_token_ids: Collection[int] = (),
    chunk_size: int = DEFAULT_PREFILL_CHUNK,
    commit_prompt: bool = True,
    keep_sequence: bool = False,
    sampling: SamplingParams = GREEDY,
    on_token: TokenCallback | None = None,
) -> GenerationResult:
    """Up to `max_new_tokens` ids after `prompt_ids` chosen by `sampling`, through the paged cache.

    Prefills only the uncached part of the prompt, commits its full blocks (`commit_prompt`) so later
    prompts and peers can reuse them, then decodes one token at a time, stopping early after a token in
    `stop_token_ids` or when `on_token` returns False. The sequence is freed at the end unless
    `keep_sequence`. Raises `InvalidTokenError` and `ContextLengthError` before the cache is touched.
    """
    ids = validate_token_ids(model, prompt_ids)
    check_context_length(model, ids.shape[0], max_new_tokens)
    started = time.perf_counter()
    sample = TokenSampler(sampling)
    result = prefill(model, cache, seq_id, ids, root=root, chunk_size=chunk_size)
    generated: list[int] = []
    try:
        if commit_prompt:
            commit_prompt_blocks(cache, seq_id, result.block_hashes)
        next_token = sample(result.logits)
        prefill_done = time.perf_counter()
        while len(generated) < max_new_tokens:
            generated.append(next_token)
            wanted = on_token is None or on_token(next_token)
            if not wanted or next_token in stop_token_ids or len(generated) == max_new_tokens:
                break  # the last token's K/V is never needed
            next_token = sample(decode_one_token(model, cache, seq_id, next_token))
        finished = time.perf_counter()
    finally:
        if not keep_sequence:
            cache.free_sequence(seq_id)
    return GenerationResult(
        token_ids=generated,
        prompt_tokens=ids.shape[0],
        cached_tokens=result.cached_tokens,
        computed_tokens=result.computed_tokens,
        block_hashes=result.block_hashes,
        prefill_seconds=prefill_done - started,
        decode_seconds=finished - prefill_done,
    )


@torch.no_grad()
def generate_reference(
    model: Transformer,
    prompt_ids: TokenIdsLike,
    max_new_tokens: int,
    *,
    stop_token_ids: Collection[int] = (),
) -> list[int]:
    """Greedy ids from full recomputation (`Transformer.forward_full`) at every step: no cache at all.

    Quadratic in the output length; meant for verifying `generate`.
    """
    ids = validate_token_ids(model, prompt_ids)
    check_context_length(model, ids.shape[0], max_new_tokens)
    generated: list[int] = []
    while len(generated) < max_new_tokens:
        next_token = int(model.forward_full(ids)[-1].argmax())
        generated.append(next_token)
        if next_token in stop_token_ids:
            break
        ids = torch.cat((ids, ids.new_tensor([next_token])))
    return generated
