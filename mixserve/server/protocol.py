"""The OpenAI request bodies the server accepts (pydantic): what /openapi.json documents."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, Strict

# Strict: a JSON true is not the integer 1 (the schema says integer, so the server must mean it);
# a strict float still takes a JSON integer.
Int = Annotated[int, Strict()]
Float = Annotated[float, Strict()]
# Seeds are handed to torch.Generator.manual_seed, which takes 64-bit values.
Seed = Annotated[int, Strict(), Field(ge=-(2**63), le=2**64 - 1)]
TokenId = Annotated[int, Strict(), Field(ge=0)]
# OpenAI's and TGI's limits: a long stop list is checked against every new token of the batch
MAX_STOPS = 4
MAX_STOP_CHARS = 1000
StopString = Annotated[str, Field(max_length=MAX_STOP_CHARS)]


class StreamOptions(BaseModel):
    """`stream_options`: `include_usage` adds a last chunk with empty choices and the usage; with it,
    `continuous_usage_stats` (vLLM's) puts the usage so far on every chunk. Other keys are ignored with a
    log line."""

    model_config = ConfigDict(extra="allow")

    include_usage: Annotated[bool, Strict()] = False
    continuous_usage_stats: Annotated[bool, Strict()] = False


class SamplingFields(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions. Fields nobody knows are ignored with
    a log line (as vLLM does); known OpenAI fields this server does not implement are a 400 naming them
    (preprocess.refuse_unsupported), never silently ignored."""

    model_config = ConfigDict(extra="allow")

    model: str | None = Field(None, description="The served model's id (GET /v1/models); omitted = it.")
    max_tokens: Int | None = Field(None, ge=1)
    temperature: Float | None = Field(None, ge=0.0, le=2.0)
    top_p: Float | None = Field(None, gt=0.0, le=1.0)
    top_k: Int | None = Field(None, ge=-1, description="0 or -1: off.")
    min_p: Float | None = Field(None, ge=0.0, le=1.0)
    seed: Seed | None = None
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOPS)] | None = Field(
        None, description=f"Up to {MAX_STOPS} strings of up to {MAX_STOP_CHARS} characters.")
    stream: Annotated[bool, Strict()] = False
    stream_options: StreamOptions | None = None
    ignore_eos: Annotated[bool, Strict()] = False
    n: Int = Field(1, ge=1, le=128, description="Choices sharing the prompt; choice i samples with seed + i.")
    user: str | None = None
    presence_penalty: Float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: Float | None = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: Float | None = Field(None, gt=0.0, description="HF's definition; 1 = off.")
    logit_bias: dict[str, Annotated[float, Strict(), Field(ge=-100.0, le=100.0)]] | None = Field(
        None, description="Token id (as a string) -> bias added to its logit.")
    min_tokens: Int | None = Field(None, ge=0, description="No stop before this many tokens (vLLM's).")
    response_format: dict[str, Any] | None = Field(
        None, description='{"type": "text" | "json_object" | "json_schema", "json_schema": {"schema": ...}}')
    guided_json: dict[str, Any] | str | None = Field(None, description="vLLM's: a JSON schema to follow.")
    guided_regex: str | None = Field(None, description="vLLM's: a regular expression to follow.")
    guided_choice: list[str] | None = Field(None, description="vLLM's: answer exactly one of these.")
    # OpenAI fields not implemented: accepted by the schema so that the answer is a 400 naming them
    best_of: Int | None = Field(None, ge=1, description="Only equal to n is supported.")


class CompletionRequest(SamplingFields):
    """POST /v1/completions: `prompt` as text or token ids (a list of one of either also works)."""

    prompt: str | list[TokenId] | list[str] | list[list[TokenId]]
    logprobs: Int | None = Field(None, ge=0, le=20, description="Top log-probabilities per token.")
    echo: Annotated[bool, Strict()] = False
    suffix: str | None = Field(None, description="Not supported (400 unless empty).")


class ChatContentPart(BaseModel):
    """One part of a message's content; only text parts are understood."""

    type: Literal["text"] = "text"
    text: str


class ChatMessage(BaseModel):
    """One chat message; its content goes through the model's chat template."""

    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ChatContentPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatCompletionRequest(SamplingFields):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Int | None = Field(None, ge=1)
    logprobs: Annotated[bool, Strict()] = False
    top_logprobs: Int | None = Field(None, ge=0, le=20)
    tools: list[dict[str, Any]] | None = Field(None, description="Not supported (400 unless empty).")
    tool_choice: str | dict[str, Any] | None = Field(None, description="Only \"none\".")


class ErrorDetail(BaseModel):
    """OpenAI's error object."""

    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """Every 4xx/5xx body: `{"error": {...}}`."""

    error: ErrorDetail
