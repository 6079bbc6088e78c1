"""Models built from megapp's parallel layers."""

from megapp.models.gpt import GPTConfig, GPTModel, build_gpt_chunks

__all__ = ["GPTConfig", "GPTModel", "build_gpt_chunks"]
