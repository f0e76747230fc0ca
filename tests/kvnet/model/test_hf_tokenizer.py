"""Hugging Face tokenizers behind kvnet's Tokenizer protocol, checked against transformers on SmolLM2."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from kvnet.errors import InvalidTokenError
from kvnet.model.registry import MODELS, packaged_file
from kvnet.model.tokenizer import (
    ByteTokenizer,
    HFTokenizer,
    Tokenizer,
    TokenizerError,
    load_tokenizer,
)

TEXTS = {
    "prose": "The quick brown fox jumps over the lazy dog. It wasn't the fox's first time, either!",
    "digits": "Order #12345 costs $1,299.99 (or 1.3e3 EUR) on 2026-11-23 at 09:41; pi ~ 3.14159265.",
    "code": 'def fib(n: int) -> int:\n    """Fibonacci."""\n\treturn n if n < 2 else fib(n-1) + fib(n-2)\n',
    "emoji": "Caches 🚀🔥 are fun 👩‍💻 — naïve café, 日本語のテキスト, Ελληνικά, עברית.",
    "whitespace": "  two leading spaces\n\n\nthree newlines   and trailing  ",
    "specials": "<|im_start|>user\nhello<|im_end|>\n",
}
MESSAGES = [
    [{"role": "user", "content": "What is a KV cache?"}],
    [
        {"role": "system", "content": "You answer in one sentence."},
        {"role": "user", "content": "Name a prime."},
        {"role": "assistant", "content": "Seven."},
        {"role": "user", "content": "Another one?"},
    ],
]


@pytest.fixture(scope="module")
def smollm2(smollm2_dir: Path) -> HFTokenizer:
    tokenizer = load_tokenizer(smollm2_dir)
    assert isinstance(tokenizer, HFTokenizer)
    return tokenizer


@pytest.fixture(scope="module")
def reference() -> Any:
    """transformers' own tokenizer read straight from the GGUF file (not from kvnet's conversion)."""
    transformers = pytest.importorskip("transformers", reason="transformers is in the test extras")
    gguf_file = packaged_file(MODELS["smollm2"])
    return transformers.AutoTokenizer.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name)


def test_satisfies_protocol_with_the_models_specials(smollm2: HFTokenizer) -> None:
    assert isinstance(smollm2, Tokenizer)
    assert (smollm2.bos_id, smollm2.eos_id, smollm2.vocab_size) == (1, 2, 49152)
    assert smollm2.identity().startswith("hf-files-sha256:")
    assert smollm2.identity() != ByteTokenizer().identity()


@pytest.mark.parametrize("kind", sorted(TEXTS))
def test_ids_equal_transformers_and_decode_round_trips(
    smollm2: HFTokenizer, reference: Any, kind: str
) -> None:
    text = TEXTS[kind]
    ids = smollm2.tokenize(text)
    assert ids == reference(text).input_ids
    assert smollm2.tokenize(text, bos=False) == ids  # add_bos_token is false for SmolLM2
    if kind != "specials":  # special tokens are dropped on decode, as in transformers
        assert smollm2.detokenize(ids) == text


@pytest.mark.parametrize("messages", MESSAGES)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_renders_as_transformers_does(
    smollm2: HFTokenizer, reference: Any, messages: list[dict[str, str]], add_generation_prompt: bool
) -> None:
    text = smollm2.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    expected = reference.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    assert text == expected
    expected_ids = reference.apply_chat_template(
        messages, tokenize=True, add_generation_prompt=add_generation_prompt, return_dict=False
    )
    assert smollm2.tokenize_chat(messages, add_generation_prompt=add_generation_prompt) == list(expected_ids)


def _copy_with_config(source: Path, target: Path, **changes: Any) -> Path:
    target.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        shutil.copy(source / name, target / name)
    config = json.loads((target / "tokenizer_config.json").read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    (target / "tokenizer_config.json").write_text(json.dumps(config))
    return target


def test_bos_follows_the_tokenizer_config(smollm2_dir: Path, smollm2: HFTokenizer, tmp_path: Path) -> None:
    plain = smollm2.tokenize("hello world", bos=False)
    assert smollm2.tokenize("hello world") == plain
    with_bos = HFTokenizer(_copy_with_config(smollm2_dir, tmp_path / "bos", add_bos_token=True))
    assert with_bos.tokenize("hello world") == [1, *plain]
    assert with_bos.tokenize("hello world", bos=False) == plain
    assert with_bos.identity() != smollm2.identity()  # the config is part of the tokenizer's name
    # Without add_bos_token the tokenizer.json post-processor decides (byte-level adds nothing).
    unset = HFTokenizer(_copy_with_config(smollm2_dir, tmp_path / "unset", add_bos_token=None))
    assert unset.tokenize("hello world") == plain
    # EOS comes from the config too: the model stops on it.
    eos = HFTokenizer(_copy_with_config(smollm2_dir, tmp_path / "eos", eos_token="<|endoftext|>"))
    assert eos.eos_id == 0


def test_bad_input_fails_clearly(smollm2_dir: Path, smollm2: HFTokenizer, tmp_path: Path) -> None:
    with pytest.raises(InvalidTokenError, match="49152"):
        smollm2.detokenize([49152])
    with pytest.raises(TokenizerError, match="eos_token"):
        HFTokenizer(_copy_with_config(smollm2_dir, tmp_path / "badeos", eos_token="<|no such token|>"))
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "tokenizer.json").write_text("{not json")
    with pytest.raises(TokenizerError, match=r"tokenizer\.json"):
        load_tokenizer(broken)
    with pytest.raises(TokenizerError, match=r"no tokenizer\.json"):
        load_tokenizer(tmp_path)


def test_chat_template_raise_exception_and_sandbox(smollm2_dir: Path, tmp_path: Path) -> None:
    strict = (
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('user turn first') }}{% endif %}"
    )
    tokenizer = HFTokenizer(_copy_with_config(smollm2_dir, tmp_path / "strict", chat_template=strict))
    with pytest.raises(TokenizerError, match="user turn first"):
        tokenizer.apply_chat_template([{"role": "assistant", "content": "hi"}])
    escape = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    sandboxed = HFTokenizer(_copy_with_config(smollm2_dir, tmp_path / "escape", chat_template=escape))
    with pytest.raises(TokenizerError, match="chat template"):
        sandboxed.apply_chat_template([{"role": "user", "content": "hi"}])
    none = HFTokenizer(_copy_with_config(smollm2_dir, tmp_path / "none", chat_template=None))
    with pytest.raises(TokenizerError, match="no chat template"):
        none.apply_chat_template([{"role": "user", "content": "hi"}])


def test_byte_tokenizer_checkpoints_keep_the_byte_tokenizer(tmp_path: Path) -> None:
    config = {"kvnet_tokenizer_identity": ByteTokenizer().identity()}
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert isinstance(load_tokenizer(tmp_path), ByteTokenizer)
