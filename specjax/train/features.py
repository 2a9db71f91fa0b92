"""Target features for EAGLE-3 training: one jitted target prefill over whole sequences.

For every token t of a sequence it records the inputs of the target layers `aux_layers`
(concatenated, [3E], as bfloat16 bits in uint16) and the target's greedy next token (argmax of the
logits at t, i.e. its prediction of token t+1).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from specjax.kv_cache import KVCache, init_cache, meta_at


def _bucket(n: int, lo: int = 64) -> int:
    b = lo
    while b < n:
        b *= 2
    return b


def _features(graphdef, params, tokens, lens, *, cfg, aux_layers, cache_dtype):
    """tokens [B, T] (right-padded), lens [B] -> (aux bits [B, T, 3E] uint16, next ids [B, T] int32)."""
    model = nnx.merge(graphdef, params)
    B, T = tokens.shape
    # one page of T entries per row (page 0 is the trash page that padding writes to)
    cache = init_cache(cfg, num_pages=B + 1, page_size=T, max_slots=B, max_seq_len=T, dtype=cache_dtype)
    pt = jnp.arange(1, B + 1, dtype=jnp.int32)[:, None]
    cache = KVCache(kv=cache.kv, page_table=pt, seq_lens=jnp.zeros((B,), jnp.int32))
    meta = meta_at(pt, jnp.zeros((B,), jnp.int32), lens, T, T)
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    h, _, aux = model(tokens, positions, cache, meta, aux_layers)
    nxt = jnp.argmax(model.logits(h), axis=-1).astype(jnp.int32)
    feats = jnp.concatenate(aux, axis=-1).astype(jnp.bfloat16)
    return jax.lax.bitcast_convert_type(feats, jnp.uint16), nxt


class FeatureExtractor:
    """extractor(seqs) -> [(aux uint16 [n, 3E], next int32 [n]) per sequence]."""

    def __init__(self, model, cfg, aux_layers, tokens_per_batch: int = 16384, dtype=None):
        graphdef, params = nnx.split(model)
        leaf = jax.tree.leaves(params)[0]
        self.params = params
        self.tokens_per_batch = tokens_per_batch
        self.aux_layers = tuple(int(i) for i in aux_layers)
        self._fn = jax.jit(functools.partial(_features, graphdef, cfg=cfg, aux_layers=self.aux_layers,
                                             cache_dtype=dtype or leaf.dtype))

    def __call__(self, seqs: list[list[int]]):
        out: list = [None] * len(seqs)
        order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))
        i = 0
        while i < len(order):
            T = _bucket(len(seqs[order[i]]))
            B = max(1, self.tokens_per_batch // T)
            group = []
            while i < len(order) and len(group) < B and len(seqs[order[i]]) <= T:
                group.append(order[i])
                i += 1
            Bp = 1 << (len(group) - 1).bit_length()  # power-of-two rows: few compiled shapes
            tokens = np.zeros((Bp, T), np.int32)
            lens = np.zeros((Bp,), np.int32)
            for r, k in enumerate(group):
                tokens[r, : len(seqs[k])] = seqs[k]
                lens[r] = len(seqs[k])
            aux, nxt = self._fn(self.params, jnp.asarray(tokens), jnp.asarray(lens))
            aux, nxt = np.asarray(aux), np.asarray(nxt)
            for r, k in enumerate(group):
                out[k] = (aux[r, : lens[r]], nxt[r, : lens[r]])
        return out


@dataclasses.dataclass
class Shard:
    """Sequences of one data shard, concatenated: offsets [S + 1] into the token arrays."""
    ids: np.ndarray  # [N] int32
    aux: np.ndarray  # [N, 3E] uint16 (bfloat16 bits)
    next_ids: np.ndarray  # [N] int32 the target's argmax after each token
    offsets: np.ndarray  # [S + 1] int64
    prompt_lens: np.ndarray  # [S] int32: the response starts at this index of its sequence

    def save(self, path) -> None:
        np.savez(path, ids=self.ids, aux=self.aux, next_ids=self.next_ids, offsets=self.offsets,
                 prompt_lens=self.prompt_lens)

    @classmethod
    def load(cls, path) -> Shard:
        with np.load(path) as z:
            return cls(z["ids"], z["aux"], z["next_ids"], z["offsets"], z["prompt_lens"])

    @classmethod
    def build(cls, seqs: list[list[int]], prompt_lens: list[int], feats) -> Shard:
        """feats None: token ids only (aux [0, 0], next_ids [0]; the trainer computes them)."""
        lens = np.array([len(s) for s in seqs], np.int64)
        offsets = np.concatenate([[0], np.cumsum(lens)])
        E3 = feats[0][0].shape[-1] if feats else 0
        return cls(ids=np.concatenate([np.asarray(s, np.int32) for s in seqs]) if seqs else np.zeros(0, np.int32),
                   aux=np.concatenate([f[0] for f in feats]) if feats else np.zeros((0, E3), np.uint16),
                   next_ids=np.concatenate([f[1] for f in feats]) if feats else np.zeros(0, np.int32),
                   offsets=offsets, prompt_lens=np.asarray(prompt_lens, np.int32))

    @property
    def num_seqs(self) -> int:
        return len(self.offsets) - 1
