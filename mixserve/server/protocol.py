"""The OpenAI request bodies the server accepts (pydantic): what /openapi.json documents."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

# Seeds are handed to torch.Generator.manual_seed, which takes 64-bit values.
Seed = Annotated[int, Field(ge=-(2**63), le=2**64 - 1)]
TokenId = Annotated[int, Field(ge=0)]


class StreamOptions(BaseModel):
    """`stream_options`: `include_usage` adds a last chunk with empty choices and the usage."""

    include_usage: bool = False


class SamplingFields(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions (unknown fields are ignored)."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = Field(None, description="The served model's id (GET /v1/models); omitted = it.")
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1, description="0 or -1: off.")
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    seed: Seed | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    n: int = Field(1, ge=1, description="Only 1 is supported.")
    user: str | None = None


class CompletionRequest(SamplingFields):
    """POST /v1/completions: `prompt` as text or token ids (a list of one of either also works)."""

    prompt: str | list[TokenId] | list[str] | list[list[TokenId]]
    logprobs: int | None = Field(None, ge=0, le=20, description="Top log-probabilities per token.")
    echo: bool = False


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
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)


class ErrorDetail(BaseModel):
    """OpenAI's error object."""

    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """Every 4xx/5xx body: `{"error": {...}}`."""

    error: ErrorDetail
