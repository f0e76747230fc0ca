"""kvnet publisher node: computes prompts' KV caches and publishes their blocks through a relay.

``python -m publisher`` / ``kvnet-publisher`` is the one-shot command; ``kvnet.node.serve`` is the
long-running
node (``kvnet-node``) that serves HTTP completions and does both roles.
"""
