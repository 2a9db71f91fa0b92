"""specjax: lossless speculative decoding for LLMs in JAX."""
from specjax.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams"]


def __getattr__(name):
    if name == "LLM":
        from specjax.llm import LLM
        return LLM
    raise AttributeError(name)
