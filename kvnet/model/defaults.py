"""The model room's names and defaults that commands show in ``--help`` and check before torch loads.

Owns the names of the built-in random-weight presets (`kvnet.model.transformer.transformer_configs` holds
their shapes) and the batching defaults (`kvnet.model.batching`, `kvnet.model.generate` use them). Imports
nothing, so a command parses and checks its flags in well under a second: torch takes seconds to import.
"""

from __future__ import annotations

from typing import Final

PRESET_NAMES: Final = ("tiny", "small", "bench")
"""The built-in presets of seeded random weights, by name (their shapes: ``transformer_configs``)."""

DEFAULT_PREFILL_CHUNK: Final = 512
"""Prompt tokens per prefill forward pass: bounds the [T, S] attention mask and activations."""

HEAD_PREFILL_CHUNK: Final = 128
"""Prompt tokens per prefill forward of a head whose limit moves while it runs (`SequenceRequest.
prefill_chunk`, rounded down to whole blocks, at least one). Smaller stops it closer to a limit lowered
mid-way (up to a chunk is computed past it), larger costs fewer forwards: each forward costs about 4 ms of
CPU besides its tokens on the ``small`` preset (1024 tokens: ~0.175 s in 512- or 256-token chunks, ~0.19 s
in 128, ~0.235 s in 64). Summing a forward's overhead per chunk and half a chunk of overshoot, a head of ~512
tokens at ~0.17 ms a token does best near sqrt(2 * 4 ms * 512 / 0.17 ms) ~ 150 tokens."""

DEFAULT_MAX_RUNNING_SEQUENCES: Final = 16
"""Sequences one scheduler computes together at most."""
