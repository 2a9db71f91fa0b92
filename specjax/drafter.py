"""The draft methods behind one small functional interface used by the fused step.

  "draft"   a Llama-family model sharing the target's vocabulary. Draft cache entry p holds
            token x_p (shift 0).
  "eagle"   EAGLE-1 head: entry p holds (x_{p+1}, f_p) where f_p is the target's final-normed
            hidden state at p (shift 1); it reuses the target's embedding and lm_head.
  "eagle3"  EAGLE-3 head: like EAGLE-1, but f_p fuses three target layers (fc 3E -> E) and the
            head has its own norm and lm_head over a draft vocabulary mapped to target ids.
  "ngram"   no model: the continuation of the longest recent match of the last tokens in the
            request's own text (specjax.ngram, on a token history kept in the step's state); the
            functions below are not used for it.

With shift s, a token at sequence position t sits at draft position (and draft cache index) t - s.
While drafting, an EAGLE head feeds on its own output hidden state instead of f.
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from specjax.kv_cache import KVCache

METHODS = ("draft", "eagle", "eagle3", "ngram")


@dataclasses.dataclass(frozen=True)
class DraftInfo:
    """Static description of a draft (hashable: it parameterises compiled programs)."""
    method: str
    aux_layers: tuple[int, ...] = ()  # target layers whose inputs an EAGLE-3 head fuses

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"unknown draft method {self.method!r}; known: {METHODS}")

    @property
    def shift(self) -> int:
        return 1 if self.method in ("eagle", "eagle3") else 0

    @property
    def uses_features(self) -> bool:
        return self.method in ("eagle", "eagle3")

    @property
    def has_model(self) -> bool:
        """False for the n-gram drafter (no weights, no draft KV cache)."""
        return self.method != "ngram"


def lm_head_weight(target):
    """The target's output projection [E, V]."""
    return target.embed[...].T if target.tied else target.lm_head[...]


def target_features(info: DraftInfo, draft, h, aux):
    """What the head consumes from the target: h [B, T, E] final-normed hidden states, aux the
    hidden states of info.aux_layers. -> [B, T, E] (None for a draft model)."""
    if info.method == "draft":
        return None
    if info.method == "eagle":
        return draft.features((h,))
    return draft.features(tuple(aux))


def forward(info: DraftInfo, draft, target, tokens, positions, feats, kv: list, page_table, meta):
    """Run the draft over new entries. tokens/positions: [B, T]; feats: [B, T, E] or None.
    Returns (hidden [B, T, E] (an EAGLE head's next feature), kv pages list)."""
    cache = KVCache(kv=kv, page_table=page_table, seq_lens=jnp.zeros((page_table.shape[0],), jnp.int32))
    if info.method == "draft":
        h, cache, _ = draft(tokens, positions, cache, meta)
    else:
        h, cache = draft(tokens, positions, feats, cache, meta, target.embed[...])
    return h, cache.kv


def logits(info: DraftInfo, draft, target, hidden):
    """hidden [B, T, E] -> draft logits [B, T, Vd] float32 (Vd = target vocab except for EAGLE-3)."""
    if info.method == "draft":
        return draft.logits(hidden)
    return draft.logits(hidden, lm_head_weight(target))


def to_target(info: DraftInfo, draft, ids):
    """Draft-vocabulary ids -> target ids (identity except for EAGLE-3)."""
    return ids if info.method != "eagle3" else draft.to_target_ids(ids)


def probs_to_target(info: DraftInfo, draft, q, vocab_size: int):
    """Draft-vocabulary probabilities [B, Vd] -> target-vocabulary probabilities [B, V]."""
    if info.method != "eagle3":
        return q
    ids = draft.to_target_ids(jnp.arange(q.shape[-1], dtype=jnp.int32))  # [Vd]
    return jnp.zeros(q.shape[:-1] + (vocab_size,), q.dtype).at[..., ids].set(q)
