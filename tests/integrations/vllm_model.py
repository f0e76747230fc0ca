"""Make a small Llama checkpoint that vLLM can load, with no download: ``python vllm_model.py OUT_DIR``
(``--hidden``, ``--layers``, ``--max-positions`` make a larger one for benchmarks; ``--mla`` a small
DeepSeek-V2, whose attention is MLA, with the latent size vLLM's CPU MLA kernels take).

Runs in the vLLM environment (``scripts/setup-vllm``): ``tokenizers`` trains a byte-level BPE on the
repository's own documents and ``transformers`` writes a randomly initialised (seeded) Llama in bf16.
Deterministic for a given checkout, so every process fingerprints the same weights.
"""

from __future__ import annotations

import argparse
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
VOCAB = 1024


def make_model(
    out: Path, hidden: int = 256, layers: int = 4, max_positions: int = 4096, mla: bool = False
) -> None:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import (
        DeepseekV2Config,
        DeepseekV2ForCausalLM,
        LlamaConfig,
        LlamaForCausalLM,
        PreTrainedTokenizerFast,
    )

    sources = [*sorted(REPO.glob("docs/*.md")), REPO / "README.md"]
    texts = [p.read_text(encoding="utf-8") for p in sources]
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(out)

    torch.manual_seed(0)
    vocab_size = -(-len(fast) // 64) * 64
    if mla:
        # vLLM's CPU MLA kernels take a latent of 512 + 64 (kv_lora_rank + qk_rope_head_dim) only; every
        # layer dense (first_k_dense_replace), so no MoE kernel is involved.
        mla_config = DeepseekV2Config(
            vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden,
            moe_intermediate_size=hidden, num_hidden_layers=layers, num_attention_heads=hidden // 64,
            num_key_value_heads=hidden // 64,
            kv_lora_rank=512, q_lora_rank=None, qk_rope_head_dim=64, qk_nope_head_dim=64, v_head_dim=64,
            first_k_dense_replace=layers, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
            max_position_embeddings=max_positions, bos_token_id=fast.bos_token_id,
            eos_token_id=fast.eos_token_id, tie_word_embeddings=False,
        )
        mla_model = DeepseekV2ForCausalLM(mla_config).to(torch.bfloat16)  # type: ignore[arg-type]
        mla_model.save_pretrained(out, safe_serialization=True)
        return
    config = LlamaConfig(
        vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden,
        num_hidden_layers=layers, num_attention_heads=hidden // 64, num_key_value_heads=max(hidden // 128, 1),
        head_dim=64, max_position_embeddings=max_positions,
        bos_token_id=fast.bos_token_id, eos_token_id=fast.eos_token_id, tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config).to(torch.bfloat16)  # type: ignore[arg-type]  # transformers' stub for .to() is wrong
    model.save_pretrained(out, safe_serialization=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("out", type=Path)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--max-positions", type=int, default=4096)
    parser.add_argument("--mla", action="store_true")
    args = parser.parse_args()
    make_model(args.out, args.hidden, args.layers, args.max_positions, args.mla)
