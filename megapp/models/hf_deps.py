"""The optional packages of Hugging Face interop, imported on use with a one-line error."""

from __future__ import annotations

from typing import Any


def _require(module: str, package: str) -> Any:
    try:
        return __import__(module)
    except ImportError:
        raise ImportError(
            f"Hugging Face interop needs the `{package}` package: pip install {package} "
            '(or pip install -e ".[hf]")'
        ) from None


def __getattr__(name: str) -> Any:
    if name == "safetensors":
        _require("safetensors", "safetensors")
        import safetensors.torch

        return safetensors
    if name == "transformers":
        return _require("transformers", "transformers")
    raise AttributeError(name)
