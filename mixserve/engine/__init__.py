"""The engine: LLMEngine (the step loop), LLM (offline API), AsyncEngine (the server's loop)."""

from mixserve.engine.llm_engine import EngineStats, LLMEngine, RequestError
from mixserve.engine.outputs import RequestMetrics, RequestOutput, RequestUpdate, TokenLogprobs
from mixserve.engine.sampling_params import SamplingParams

__all__ = [
    "EngineStats",
    "LLMEngine",
    "RequestError",
    "RequestMetrics",
    "RequestOutput",
    "RequestUpdate",
    "SamplingParams",
    "TokenLogprobs",
]
