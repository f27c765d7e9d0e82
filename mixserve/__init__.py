"""mixserve: a readable LLM serving engine built around chunked prefill.

The torch-side names are exported lazily (PEP 562) so that `import mixserve.core` never imports torch.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# public name -> module that defines it
_LAZY = {
    "ModelRunner": "mixserve.runner.model_runner",
    "SamplingParams": "mixserve.engine.sampling_params",
    "LLM": "mixserve.engine.llm",
    "RequestOutput": "mixserve.engine.outputs",
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'mixserve' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # cache: later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
