"""The user-facing Python API: `LLM(...).generate(prompts, SamplingParams(...))`."""
from __future__ import annotations

import random
from pathlib import Path

import jax.numpy as jnp

from specjax.engine import BatchOptions, CacheOptions, Engine
from specjax.request import Request, RequestOutput
from specjax.sampling_params import SamplingParams

DTYPES = {"bfloat16": jnp.bfloat16, "float32": jnp.float32}


class PromptError(ValueError):
    """A prompt that cannot be served (empty, too long, bad token ids)."""


def draft_method(draft) -> str:
    """The SpecConfig.method a draft needs: "eagle" / "eagle3" for a converted head directory,
    "draft" for a draft model directory or "self"."""
    import json

    from specjax.checkpoint import MARKER
    marker = Path(draft) / MARKER
    if draft != "self" and marker.exists():
        kind = json.loads(marker.read_text()).get("kind", "draft")
        if kind in ("eagle", "eagle3"):
            return kind
    return "draft"


class LLM:
    def __init__(self, model: str | Path | None = None, dtype: str = "bfloat16", page_size: int = 16,
                 max_batch: int = 8, max_seq_len: int = 2048, num_pages: int | None = None, seed: int = 0,
                 draft: str | Path | None = None, spec=None, tensor_parallel: int = 1):
        """draft: None (plain decoding), "self" (the target drafts for itself: for testing), the
        directory of a converted Llama-family draft model with the target's vocabulary, or of a
        converted EAGLE-1 / EAGLE-3 head (`specjax convert --draft`).
        spec: specjax.tree.SpecConfig (default: a chain of 4 drafted tokens with the draft's method).
        tensor_parallel: shard heads / MLP / vocabulary / KV heads over this many devices."""
        from specjax.checkpoint import load_model, load_tokenizer
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
        if model is None:
            from specjax.default_model import ensure_default
            model = ensure_default()
        self.model_dir = Path(model)
        mesh = None
        if tensor_parallel != 1:
            from specjax import sharding
            mesh = sharding.make_mesh(tensor_parallel)
            self.cfg, module = sharding.restore_sharded(self.model_dir, mesh, dtype=dtype)
        else:
            self.cfg, module = load_model(self.model_dir, dtype)
        self.tokenizer = load_tokenizer(self.model_dir)
        self.max_seq_len = max_seq_len
        self.spec = None
        engine_draft = None
        if draft is not None:
            engine_draft = self._load_draft(draft, spec, module, dtype)
        self.engine = Engine(module, self.cfg, CacheOptions(page_size, max_seq_len, num_pages),
                             BatchOptions(max_batch), DTYPES[dtype], draft=engine_draft, mesh=mesh)
        self._rng = random.Random(seed)
        self._next_id = 0

    def _load_draft(self, draft, spec, target_module, dtype):
        from specjax.checkpoint import load_model
        from specjax.drafter import DraftInfo
        from specjax.engine import Draft
        from specjax.tree import SpecConfig
        kind = draft_method(draft)
        self.spec = spec or SpecConfig(method=kind, num_steps=4)
        if self.spec.method != kind:
            raise ValueError(f"SpecConfig.method={self.spec.method!r} but the draft "
                             f"{'(the target itself)' if draft == 'self' else str(draft)} is a {kind!r} draft")
        if kind != "draft":
            from specjax.checkpoint import load_draft
            head, ecfg = load_draft(draft, self.cfg, dtype)
            return Draft(head, ecfg.layer, DraftInfo(ecfg.method, tuple(ecfg.aux_layers)), self.spec)
        if draft == "self":
            return Draft(target_module, self.cfg, DraftInfo("draft"), self.spec)
        draft_cfg, draft_module = load_model(draft, dtype)
        if draft_cfg.vocab_size != self.cfg.vocab_size:
            raise ValueError(f"draft model {draft} has vocab_size {draft_cfg.vocab_size}, the target has "
                             f"{self.cfg.vocab_size}: a draft must share the target's vocabulary")
        return Draft(draft_module, draft_cfg, DraftInfo("draft"), self.spec)

    @property
    def eos_ids(self) -> tuple[int, ...]:
        ids = set(self.cfg.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return tuple(sorted(ids))

    def _request(self, prompt, params: SamplingParams, index: int) -> Request:
        if isinstance(prompt, str):
            text, ids = prompt, self.tokenizer.encode(prompt, add_special_tokens=False)
        else:
            text, ids = None, list(prompt)
            if any(not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < self.cfg.vocab_size for t in ids):
                raise PromptError(f"prompt {index}: token ids must be integers in [0, {self.cfg.vocab_size})")
        if not ids:
            raise PromptError(f"prompt {index} is empty")
        if len(ids) >= self.max_seq_len:
            raise PromptError(f"prompt {index} has {len(ids)} tokens; max_seq_len={self.max_seq_len} leaves "
                              f"no room to generate (prompt must be shorter than max_seq_len)")
        seed = params.seed if params.seed is not None else self._rng.getrandbits(32)
        self._next_id += 1
        return Request(self._next_id - 1, text, ids, params, self.tokenizer, self.eos_ids, self.max_seq_len,
                       seed & 0xFFFFFFFF)

    def generate(self, prompts, params: SamplingParams | list[SamplingParams] | None = None) -> list[RequestOutput]:
        """prompts: a string, a list of token ids, or a list of either."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = params or SamplingParams()
        plist = params if isinstance(params, list) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(f"{len(plist)} SamplingParams for {len(prompts)} prompts")
        reqs = [self._request(p, sp, i) for i, (p, sp) in enumerate(zip(prompts, plist))]
        self.engine.run(reqs)
        return [r.output() for r in reqs]

    def apply_chat_template(self, messages: list[dict]) -> str:
        if not self.tokenizer.chat_template:
            raise ValueError(f"the model at {self.model_dir} has no chat template")
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    def chat(self, messages, params: SamplingParams | None = None):
        """messages: one conversation (list of {"role", "content"}) or a list of them."""
        single = bool(messages) and isinstance(messages[0], dict)
        convs = [messages] if single else messages
        outs = self.generate([self.apply_chat_template(c) for c in convs], params)
        return outs[0] if single else outs
