"""What the server needs to know of the engine's model: read once, fixed after load, safe from any thread."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mixserve.engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class ServedModel:
    """The model as the server sees it. `validate` is the engine's own pure check (context length, KV
    cache room, vocabulary, grammar), which raises a ValueError naming the field at fault."""

    name: str
    tokenizer: Any  # mixserve.model.tokenizer.Tokenizer: encode_releasing_gil, render_chat, decode, ...
    context_limit: int  # the most tokens (prompt + output) one request may hold
    validate: Callable[[list[int], SamplingParams], None]
    # the checkpoint's sampling defaults (model/generation_config.py) for fields a request leaves unset
    sampling_defaults: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def of(cls, llm: Any) -> ServedModel:
        """From an LLMEngine (or anything with the same four facts, and optionally `sampling_defaults`)."""
        defaults = dict(getattr(llm, "sampling_defaults", {}))
        if defaults:
            logging.getLogger("mixserve").info("requests that leave them unset get the checkpoint's sampling "
                                               "defaults: %s", defaults)
        return cls(llm.model_name, llm.tokenizer, llm.context_limit, llm.validate, defaults)
