"""The OpenAI request bodies a replica accepts (completions and chat), validated the same way for every
engine: the fields each accepts, their bounds, and the one-line message a 400 carries.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import (BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, ValidationError, field_validator,
                      model_validator)

from ckptdelta.loader.engines.base import ReplicaAPIError

MAX_N = 64
MAX_STOP = 16
MAX_TOP_LOGPROBS = 20


# --- request schemas -----------------------------------------------------------------

class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: StrictBool = False


class SamplingFields(BaseModel):
    model_config = ConfigDict(extra="ignore")  # OpenAI clients send fields we do not use (user, ...)

    model: str | None = None
    max_tokens: StrictInt = Field(16, ge=1, le=1 << 16)
    temperature: float = Field(1.0, ge=0.0, le=100.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    n: StrictInt = Field(1, ge=1, le=MAX_N)
    seed: StrictInt | None = Field(None, ge=0, lt=1 << 63)
    stop: StrictStr | list[StrictStr] | None = None
    ignore_eos: StrictBool = False
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    score_logprobs: StrictBool = False  # logprobs from one full-sequence scoring pass (ckptdelta.loader.hf_model.score_logprobs)
    top_k: StrictInt = Field(-1, ge=-1)  # as vLLM: -1 or 0 is off
    stop_token_ids: list[StrictInt] = Field(default_factory=list, max_length=MAX_STOP)  # as vLLM's

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: str | list[str] | None) -> list[str]:
        stops = [v] if isinstance(v, str) else list(v or [])
        if len(stops) > MAX_STOP or any(not s or len(s) > 256 for s in stops):
            raise ValueError(f"stop: at most {MAX_STOP} non-empty strings of up to 256 characters")
        return stops



class CompletionRequest(SamplingFields):
    prompt: StrictStr | list[StrictInt] = Field(..., min_length=1)
    logprobs: StrictInt | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    # as vLLM's: each prompt token's logprob and k alternatives, on every choice (not with stream)
    prompt_logprobs: StrictInt | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)

    @model_validator(mode="after")
    def _no_prompt_logprobs_streamed(self) -> "CompletionRequest":
        if self.prompt_logprobs is not None and self.stream:
            raise ValueError("prompt_logprobs is not available with stream=true")
        return self


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: StrictStr = Field(..., max_length=1 << 20)


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(..., min_length=1)
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    max_completion_tokens: StrictInt | None = Field(None, ge=1, le=1 << 16)

    @model_validator(mode="after")
    def _top_needs_logprobs(self) -> "ChatCompletionRequest":
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs=true")
        return self


def validation_message(exc: Any) -> str:
    """One line naming each bad field (pydantic's and FastAPI's validation errors alike)."""
    parts = []
    for e in exc.errors()[:8]:
        loc = ".".join(str(x) for x in e.get("loc", ()) if x != "body") or "body"
        parts.append(f"{loc}: {e.get('msg')}")
    return "; ".join(parts) or "invalid request"


def parse(model: type[BaseModel], body: dict[str, Any]) -> Any:
    try:
        return model.model_validate(body)
    except ValidationError as e:
        raise ReplicaAPIError(400, "invalid_request_error", validation_message(e)) from None
