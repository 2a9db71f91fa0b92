"""specjax: lossless speculative decoding for LLMs in JAX."""
from specjax.sampling_params import SamplingParams

__all__ = ["AsyncLLM", "LLM", "SamplingParams"]


def __getattr__(name):
    if name == "LLM":
        from specjax.llm import LLM
        return LLM
    if name == "AsyncLLM":
        from specjax.async_llm import AsyncLLM
        return AsyncLLM
    raise AttributeError(name)
