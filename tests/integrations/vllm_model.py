"""Make a small Llama checkpoint that vLLM can load, with no download: ``python vllm_model.py OUT_DIR``.

Runs in the vLLM environment (``scripts/setup-vllm``): ``tokenizers`` trains a byte-level BPE on the
repository's own documents and ``transformers`` writes a randomly initialised (seeded) Llama in bf16.
Deterministic for a given checkout, so every process fingerprints the same weights.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
VOCAB = 1024


def make_model(out: Path) -> None:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

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
    config = LlamaConfig(
        vocab_size=-(-len(fast) // 64) * 64, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=4096,
        bos_token_id=fast.bos_token_id, eos_token_id=fast.eos_token_id, tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)


if __name__ == "__main__":
    make_model(Path(sys.argv[1]))
