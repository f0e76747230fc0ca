"""Byte-level tokenizer: round trips, specials, errors, identity."""

from __future__ import annotations

import pytest

from kvnet.errors import InvalidTokenError
from kvnet.model.tokenizer import ByteTokenizer, Tokenizer
from kvnet.model.transformer import transformer_configs


def test_round_trip_utf8() -> None:
    tokenizer = ByteTokenizer()
    text = "KV caché ✓ 日本"
    ids = tokenizer.tokenize(text)
    assert ids[0] == tokenizer.bos_id == 256
    assert ids[1:] == list(text.encode("utf-8"))
    assert tokenizer.detokenize(ids) == text
    assert tokenizer.tokenize(text, bos=False) == ids[1:]


def test_specials_are_dropped_and_bad_bytes_replaced() -> None:
    tokenizer = ByteTokenizer()
    assert tokenizer.detokenize([tokenizer.bos_id, 104, 105, tokenizer.eos_id, tokenizer.pad_id]) == "hi"
    assert tokenizer.detokenize([0xFF, 104]) == "\ufffdh"


@pytest.mark.parametrize("bad_id", [-1, 259, 10_000])
def test_decode_rejects_ids_outside_vocab(bad_id: int) -> None:
    with pytest.raises(InvalidTokenError, match=str(bad_id)):
        ByteTokenizer().detokenize([104, bad_id])


def test_identity_and_protocol() -> None:
    tokenizer = ByteTokenizer()
    assert isinstance(tokenizer, Tokenizer)
    assert tokenizer.identity() == ByteTokenizer().identity()
    assert "vocab=259" in tokenizer.identity()
    # The built-in presets are built for this tokenizer.
    for args in transformer_configs.values():
        assert args.vocab_size == tokenizer.vocab_size and args.tokenizer_identity == tokenizer.identity()
