"""A model's kvtc tables calibrated on text (kvnet.node.kvtc_calibration): the steps' allocation by the
model's measured sensitivity, on the ``tiny`` preset (2 layers, float32)."""

from __future__ import annotations

import pytest
import torch

from kvnet.blocks.codecs import CodecError
from kvnet.model.tokenizer import ByteTokenizer
from kvnet.model.transformer import Transformer, rope_inv_freq
from kvnet.node.kvtc_calibration import (
    calibrate_model_tables,
    measure_step_scale,
    prefill_kv,
    prefill_positions,
    tokens_to_predict,
)

BLOCK = 16
TEXT = ("Relays cache named objects; nodes fetch the longest prefix they share, verify it and load it. "
        "A node that finds fetching slower than computing recomputes instead. ") * 4


@pytest.fixture(scope="module")
def model() -> Transformer:
    return Transformer.from_name("tiny", device=torch.device("cpu"), dtype=torch.float32, seed=0).eval()


def test_steps_are_allocated_per_layer_group_by_measured_sensitivity(model: Transformer) -> None:
    """Each (layer group, K/V) gets its own factor on the equal relative step, within [1/4, 4], the
    geometric mean about 1 (the rate stays where it was); the calibration text's last tokens are scored,
    not calibrated on, and its tokens are coded with the steps per token a node would give them."""
    ids = ByteTokenizer().tokenize(TEXT)
    equal = calibrate_model_tables(model, ids, BLOCK, 0.1)
    held = len(ids) // 5
    before = calibrate_model_tables(model, ids[:-held], BLOCK, 0.1)
    k, v = prefill_kv(model, ids[:-held], BLOCK)
    scale = measure_step_scale(model, model, k, v, ids[-held:], BLOCK, before, group=1,
                               prefix_ids=ids[:-held])
    assert scale.shape == (2, 2) and bool(((scale >= 0.25) & (scale <= 4.0)).all())
    assert float(scale.log().mean().exp()) == pytest.approx(1.0, rel=0.05)
    assert float(scale.max() / scale.min()) > 1.05  # the model is not equally sensitive everywhere
    allocated = calibrate_model_tables(model, ids, BLOCK, 0.1, layer_group=1)
    assert allocated.fingerprint == equal.fingerprint
    torch.testing.assert_close(allocated.step, before.step * scale[:, :, None])


def test_too_little_text_to_allocate_is_one_line(model: Transformer) -> None:
    ids = ByteTokenizer().tokenize(TEXT)[:BLOCK + 4]
    with pytest.raises(CodecError, match="needs") as caught:
        calibrate_model_tables(model, ids, BLOCK, 0.1, layer_group=1)
    assert "\n" not in str(caught.value)


def test_enough_text_predicts_each_layer_from_the_one_before(model: Transformer) -> None:
    """With a few thousand tokens layer 1 is predicted from layer 0, through the model's own rotary
    frequencies and each row's position in its prefill window (windows restart at position 0); with
    fewer than ``tokens_to_predict`` it is not, and the tables say so."""
    ids = ByteTokenizer().tokenize(TEXT * 8)
    k, _ = prefill_kv(model, ids, BLOCK)
    positions = prefill_positions(model, len(ids), BLOCK)
    window = (model.args.max_seq_len - 1) // BLOCK * BLOCK
    assert positions.shape == (k.shape[1],) and int(positions.max()) == min(window, k.shape[1]) - 1
    assert positions[:window].tolist() == list(range(window))
    tables = calibrate_model_tables(model, ids, BLOCK, 0.1)
    assert tables.predicted_layers == (False, True) and len(ids) >= tokens_to_predict(tables)
    torch.testing.assert_close(tables.rope_inv_freq, rope_inv_freq(model.args, torch.device("cpu")))
    short = calibrate_model_tables(model, ids[:tokens_to_predict(tables) - 300], BLOCK, 0.1)
    assert short.predicted_layers == (False, False)
