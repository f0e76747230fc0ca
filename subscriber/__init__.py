"""kvnet subscriber node: answers a prompt reusing every KV block it can find locally or through a relay.

``python -m subscriber`` / ``kvnet-subscriber`` is the one-shot command.
"""
