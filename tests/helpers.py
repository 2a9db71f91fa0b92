"""Shared test helpers: tiny random models, a stand-in tokenizer, the default model (or a skip),
torch on one thread."""
from __future__ import annotations

import contextlib
import importlib.util
import math
import os
import threading

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from specjax.background_compile import BackgroundCompiles
from specjax.config import ModelConfig
from specjax.models.llama import Llama


def tiny_config(arch="LlamaForCausalLM", **kw) -> ModelConfig:
    d = dict(architectures=[arch], vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=8, rope_theta=10000.0,
             tie_word_embeddings=False, eos_token_id=96)
    d.update(kw)
    return ModelConfig.from_hf_dict(d)


def tiny_model(cfg: ModelConfig, seed=0, dtype=jnp.float32, std=0.3) -> Llama:
    m = Llama(cfg, dtype, nnx.Rngs(seed))
    # larger weights than the init default so that argmax paths differ between tokens
    for _, p in nnx.iter_graph(m):
        if isinstance(p, nnx.Param) and p[...].ndim > 1:
            p[...] = p[...] * (std / 0.02)
    return m


class IdTokenizer:
    """Tokenizer stand-in for engine tests: token i <-> f"<{i}>"."""
    eos_token_id = None
    chat_template = None

    def encode(self, text, add_special_tokens=False):
        return [int(t) for t in text.replace("<", " ").replace(">", " ").split()]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(f"<{i}>" for i in ids)


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("true", "1", "yes")


def default_model_or_skip():
    """The default model's directory (ensure_default). Where it cannot be loaded (an offline machine
    without the cached model) the test skips, except in CI (env CI=true), where it fails: a CI run
    must not go green having checked nothing of the real model."""
    from specjax.default_model import ensure_default
    try:
        return ensure_default()
    except Exception as e:  # noqa: BLE001 - any reason the model is unavailable
        why = f"default model unavailable: {type(e).__name__}: {e}"
        if in_ci():
            pytest.fail(f"CI=true: {why}", pytrace=False)
        pytest.skip(why)


@contextlib.contextmanager
def one_torch_thread():
    """torch on one thread inside the block (the real model's references through transformers).
    Under `pytest -n 2` on 2 cores the other worker keeps the second core busy and torch's two
    threads wait on each other: with both cores busy, HF greedy 32 tokens of one SmolLM2 prompt took
    19 s on two threads against 5 s on one (3 s against 2 s on an idle machine)."""
    import torch
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def prefill_kv(eng, req):
    """Run req through the engine until its first token and return the K/V of its prompt entries in
    its slot at that point (first layer: target [n, 2, Hkv, D] and draft, None without one); then
    run the engine to the end."""
    import numpy as np
    eng.add_request(req)
    while not req.token_ids:
        eng.step()
    pages, n = eng.alloc.owned[req.slot], len(req.prompt_ids)
    kvs = [eng.state.cache.kv] + ([eng.state.draft_kv] if hasattr(eng.state, "draft_kv") else [])
    out = [np.asarray(x[0])[pages].reshape((-1,) + x[0].shape[2:])[:n] for x in kvs]
    while eng.has_unfinished():
        eng.step()
    return out[0], (out[1] if len(out) > 1 else None)


def chi2_pvalue(counts, probs):
    """Pearson chi-square with the cells of expected count < 5 pooled; Wilson-Hilferty tail."""
    exp = probs * counts.sum()
    small = exp < 5
    o = np.append(counts[~small], counts[small].sum())
    e = np.append(exp[~small], exp[small].sum())
    keep = e > 0
    stat = float(((o[keep] - e[keep]) ** 2 / e[keep]).sum())
    k = int(keep.sum()) - 1
    z = ((stat / k) ** (1 / 3) - (1 - 2 / (9 * k))) / math.sqrt(2 / (9 * k))
    return 0.5 * math.erfc(z / math.sqrt(2))


class Recording:
    """An engine program (adaptive steps tests) that records the K of each call; otherwise the
    program (lowered by the background worker)."""
    def __init__(self, program, used):
        self.program, self.used = program, used

    def __call__(self, *args, **kwargs):
        self.used.append(kwargs["num_steps"])
        return self.program(*args, **kwargs)

    def __getattr__(self, name):  # lower (the worker), _cache_size (Engine.num_compiled)
        return getattr(self.program, name)


class Held(BackgroundCompiles):
    """A background compile worker that starts compiling only once `gate` is set."""
    def __init__(self):
        super().__init__()
        self.gate = threading.Event()

    def _run(self):
        self.gate.wait()
        super()._run()


def load_script(name: str):
    """scripts/<name>.py imported as a module (the scripts folder is not a package)."""
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts", f"{name}.py")
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def draft_setup(lengths) -> tuple:
    """(cfg, target, other_cfg, other, prompts) for speculative engine tests: a tiny target, a one-layer
    draft that is often wrong, random prompts of these lengths (ids < 96)."""
    cfg = tiny_config()
    other_cfg = tiny_config(num_hidden_layers=1)
    rng = np.random.default_rng(1)
    prompts = [[int(t) for t in rng.integers(0, 96, size=n)] for n in lengths]
    return cfg, tiny_model(cfg, seed=0), other_cfg, tiny_model(other_cfg, seed=5), prompts


def draft_of(setup, kind: str | None):
    """The Draft of draft_setup's models: "self" (the target as a chain draft), "other" (the wrong draft
    as a tree) or None (plain decoding)."""
    from specjax.drafter import DraftInfo
    from specjax.engine import Draft
    from specjax.tree import SpecConfig
    cfg, target, other_cfg, other, _ = setup
    if kind == "self":
        return Draft(target, cfg, DraftInfo("draft"), SpecConfig(method="draft", num_steps=3, topk=1))
    if kind == "other":
        return Draft(other, other_cfg, DraftInfo("draft"), SpecConfig(method="draft", num_steps=3, topk=2,
                                                                       num_draft_tokens=6))
    return None
