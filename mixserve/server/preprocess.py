"""Request body -> (prompt token ids, SamplingParams): every check that turns bad input into a 400.

Tokenizing is model-sized work: it runs on a worker thread through the tokenizer's GIL-releasing call,
after a length bound that refuses a prompt far over the context without tokenizing it at all.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

from mixserve.engine.sampling_params import SamplingParams, StructuredOutput
from mixserve.engine.served_model import ServedModel
from mixserve.server.errors import APIError
from mixserve.server.protocol import ChatCompletionRequest, CompletionRequest, SamplingFields

logger = logging.getLogger(__name__)

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's legacy default for /v1/completions


def _check_length_bound(model: ServedModel, texts: list[str], param: str) -> None:
    """A 400 for text that must be over the context whatever it tokenizes to (each token is at most
    `max_token_bytes` bytes of it), before any tokenizing."""
    num_bytes = sum(len(t.encode("utf-8", "surrogatepass")) for t in texts)
    limit = model.context_limit
    at_least = -(-num_bytes // model.tokenizer.max_token_bytes)
    if at_least > limit:
        raise APIError(400, f"{param}: {num_bytes} bytes of text are at least {at_least} tokens, over the "
                            f"{limit}-token context of this server", param=param)


async def _encode(model: ServedModel, text: str, add_special_tokens: bool, param: str) -> list[int]:
    try:
        return list(await asyncio.to_thread(model.tokenizer.encode_releasing_gil, text, add_special_tokens))
    except (TypeError, ValueError) as exc:  # e.g. a lone UTF-16 surrogate, which no tokenizer takes
        raise APIError(400, f"The {param} cannot be tokenized: {exc}", param=param) from exc


async def completion_prompt(model: ServedModel, req: CompletionRequest) -> list[int]:
    """Text is tokenized (with the BOS the tokenizer adds); token ids pass as they are (validate checks)."""
    prompt: Any = req.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise APIError(400, "Only one prompt per request is supported.", param="prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        _check_length_bound(model, [prompt], "prompt")
        ids = await _encode(model, prompt, True, "prompt")
    else:
        ids = list(prompt)
    if not ids:
        raise APIError(400, "The prompt is empty.", param="prompt")
    return ids


async def chat_prompt(model: ServedModel, req: ChatCompletionRequest) -> list[int]:
    """The messages through the model's chat template, with the assistant's turn opened."""
    messages = [{"role": m.role, "content": m.text()} for m in req.messages]
    _check_length_bound(model, [m["content"] for m in messages], "messages")
    try:
        text = await asyncio.to_thread(model.tokenizer.render_chat, messages, True)
    except Exception as exc:  # a template may reject a conversation (roles out of order, ...)
        raise APIError(400, f"The chat template refused these messages: {exc}", param="messages") from exc
    ids = await _encode(model, text, False, "messages")
    if not ids:
        raise APIError(400, "The messages render to an empty prompt.", param="messages")
    return ids


# (field, the value that means "off"): known OpenAI fields this server does not implement
_UNSUPPORTED = (("suffix", ""), ("tools", []))


def refuse_unsupported(req: SamplingFields) -> None:
    """A 400 naming the first OpenAI parameter we know and do not implement; a log line for the fields
    nobody knows (ignored, as vLLM does)."""
    if req.best_of is not None and req.best_of != req.n:
        raise APIError(400, f"best_of is supported only equal to n ({req.n}), got {req.best_of}.",
                       param="best_of")
    for name, off in _UNSUPPORTED:
        value = getattr(req, name, None)
        if value is not None and value != off:
            raise APIError(400, f"{name} is not supported by this server (only {off!r}).", param=name)
    choice = getattr(req, "tool_choice", None)
    if choice is not None and choice != "none":
        raise APIError(400, "tool_choice is not supported (only 'none').", param="tool_choice")
    ignored = sorted(req.model_extra or {})
    if req.stream_options is not None:
        ignored += [f"stream_options.{k}" for k in sorted(req.stream_options.model_extra or {})]
    if ignored:
        logger.warning("ignored fields this server does not know: %s", ", ".join(ignored))


def sampling_params(model: ServedModel, req: SamplingFields, prompt_len: int, *, max_tokens: int | None,
                    default_max_tokens: int | None, num_logprobs: int | None) -> SamplingParams:
    """Build the engine's SamplingParams; its ValueError (naming the field) becomes a 400."""
    if max_tokens is None:
        # default: what is left of the context, so a chat answer is never cut by a guess
        room = model.context_limit - prompt_len
        max_tokens = default_max_tokens if default_max_tokens is not None else max(room, 1)
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    fields: dict[str, Any] = {**model.sampling_defaults, "max_tokens": max_tokens,
                              "ignore_eos": req.ignore_eos, "n": req.n}
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
    for name in ("presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens"):
        if getattr(req, name) is not None:
            fields[name] = getattr(req, name)
    if req.logit_bias:
        fields["logit_bias"] = _logit_bias(req.logit_bias)
    structured = structured_output(req)
    if structured is not None:
        fields["structured_output"] = structured
    try:
        return SamplingParams(**fields)
    except (ValueError, TypeError) as exc:
        # SamplingParams names the field first: "top_p: must be in (0, 1], got 0"
        field = str(exc).split(":", 1)[0]
        raise APIError(400, str(exc), param=field if field in fields else None) from exc


def _logit_bias(bias: dict[str, float]) -> dict[int, float]:
    try:
        return {int(token): value for token, value in bias.items()}
    except ValueError:
        raise APIError(400, "logit_bias: keys must be token ids (integers as strings).",
                       param="logit_bias") from None


def structured_output(req: SamplingFields) -> StructuredOutput | None:
    """The grammar a request asks for (`response_format`, or vLLM's `guided_json`/`guided_regex`/
    `guided_choice`), as a StructuredOutput; None for free text. At most one may be given."""
    guided = ("guided_json", "guided_regex", "guided_choice")
    asked = [name for name in guided if getattr(req, name) is not None]
    fmt = req.response_format or {}
    kind = fmt.get("type", "text")
    if kind != "text":
        asked.insert(0, "response_format")
    if len(asked) > 1:
        raise APIError(400, f"Only one of {', '.join(asked)} may be given.", param=asked[1])
    try:
        if kind == "json_object":
            return StructuredOutput("json_object")
        if kind == "json_schema":
            schema = (fmt.get("json_schema") or {}).get("schema")
            if not isinstance(schema, dict):
                raise ValueError("response_format.json_schema.schema must be a JSON schema object")
            return StructuredOutput("json_schema", json.dumps(schema))
        if kind != "text":
            raise ValueError(f"response_format type {kind!r} is not one of text, json_object, json_schema")
        if req.guided_json is not None:
            schema_text = req.guided_json if isinstance(req.guided_json, str) else json.dumps(req.guided_json)
            return StructuredOutput("json_schema", schema_text)
        if req.guided_regex is not None:
            return StructuredOutput("regex", req.guided_regex)
        if req.guided_choice is not None:
            return StructuredOutput("choice", choices=tuple(req.guided_choice))
    except ValueError as exc:
        raise APIError(400, str(exc), param=asked[0] if asked else "response_format") from None
    return None


async def validate(model: ServedModel, prompt_token_ids: list[int], params: SamplingParams,
                   prompt_param: str) -> None:
    """The engine's own check (context length, KV cache room, parameters) as a 400 naming the param.
    With a grammar it compiles it (milliseconds for a schema; half a second for the first one, which
    builds the tokenizer's table): on a worker thread then, so the event loop never waits for it."""
    try:
        if params.structured_output is not None:
            await asyncio.to_thread(model.validate, prompt_token_ids, params)
        else:
            model.validate(prompt_token_ids, params)
    except ValueError as exc:
        param = getattr(exc, "param", None)
        if param == "prompt":
            param = prompt_param
        raise APIError(400, str(exc), param=param) from exc
