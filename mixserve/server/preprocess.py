"""Request body -> (prompt token ids, SamplingParams): every check that turns bad input into a 400."""

from __future__ import annotations

from typing import Any

from mixserve.server.errors import APIError
from mixserve.server.protocol import ChatCompletionRequest, CompletionRequest, SamplingFields

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's legacy default for /v1/completions


def context_limit(llm: Any) -> int:
    """The most tokens (prompt + output) one request may hold: the model's context and the KV cache."""
    runner = llm.runner
    context = getattr(llm, "max_model_len", None) or runner.max_model_len  # the engine's may be shorter
    return min(context, runner.num_blocks * runner.block_size)


def completion_prompt(llm: Any, req: CompletionRequest) -> list[int]:
    """Text is tokenized (with the BOS the tokenizer adds); token ids pass as they are (validate checks)."""
    prompt: Any = req.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise APIError(400, "Only one prompt per request is supported.", param="prompt")
        prompt = prompt[0]
    try:
        ids = list(llm.tokenizer.encode(prompt)) if isinstance(prompt, str) else list(prompt)
    except (TypeError, ValueError) as exc:  # e.g. a lone UTF-16 surrogate, which no tokenizer takes
        raise APIError(400, f"The prompt cannot be tokenized: {exc}", param="prompt") from exc
    if not ids:
        raise APIError(400, "The prompt is empty.", param="prompt")
    return ids


def chat_prompt(llm: Any, req: ChatCompletionRequest) -> list[int]:
    """The messages through the model's chat template, with the assistant's turn opened."""
    messages = [{"role": m.role, "content": m.text()} for m in req.messages]
    try:
        ids = list(llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True))
    except Exception as exc:  # a template may reject a conversation (roles out of order, ...)
        raise APIError(400, f"The chat template refused these messages: {exc}", param="messages") from exc
    if not ids:
        raise APIError(400, "The messages render to an empty prompt.", param="messages")
    return ids


def sampling_params(llm: Any, req: SamplingFields, prompt_len: int, *, max_tokens: int | None,
                    default_max_tokens: int | None, num_logprobs: int | None) -> Any:
    """Build the engine's SamplingParams; its ValueError (naming the field) becomes a 400."""
    from mixserve.engine.sampling_params import SamplingParams

    if req.n != 1:
        raise APIError(400, "Only n = 1 is supported.", param="n")
    if max_tokens is None:
        # default: what is left of the context, so a chat answer is never cut by a guess
        room = context_limit(llm) - prompt_len
        max_tokens = default_max_tokens if default_max_tokens is not None else max(room, 1)
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    fields: dict[str, Any] = {"max_tokens": max_tokens, "ignore_eos": req.ignore_eos}
    if req.temperature is not None:
        fields["temperature"] = req.temperature
    if req.top_p is not None:
        fields["top_p"] = req.top_p
    if req.top_k is not None:
        fields["top_k"] = max(req.top_k, 0)  # OpenAI-style -1 means off, as 0 does here
    if req.min_p is not None:
        fields["min_p"] = req.min_p
    if req.seed is not None:
        fields["seed"] = req.seed % 2**63  # torch generators take non-negative 64-bit seeds
    if stop:
        fields["stop"] = stop
    if num_logprobs is not None:
        fields["logprobs"] = num_logprobs
    try:
        return SamplingParams(**fields)
    except (ValueError, TypeError) as exc:
        # SamplingParams names the field first: "top_p: must be in (0, 1], got 0"
        field = str(exc).split(":", 1)[0]
        raise APIError(400, str(exc), param=field if field in fields else None) from exc


def validate(llm: Any, prompt_token_ids: list[int], params: Any, prompt_param: str) -> None:
    """The engine's own check (context length, KV cache room, parameters) as a 400 naming the param."""
    try:
        llm.validate(prompt_token_ids, params)
    except ValueError as exc:
        param = getattr(exc, "param", None)
        if param == "prompt":
            param = prompt_param
        raise APIError(400, str(exc), param=param) from exc
