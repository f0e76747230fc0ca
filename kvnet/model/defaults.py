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

DEFAULT_MAX_RUNNING_SEQUENCES: Final = 16
"""Sequences one scheduler computes together at most."""
