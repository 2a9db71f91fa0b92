"""EAGLE-3 training loss: cross-entropy of each unrolled step's draft-vocabulary logits against the
target's greedy next token (mapped to the draft vocabulary), weighted by decay**j.

A batch is a dict of packed rows (see specjax.train.dataset):
  ids, seg, pos  [B, T] int32   tokens, sequence id (0 = padding), position inside the sequence
  aux            [B, T, 3E]     bfloat16 bits (uint16) or floats: the target's three hidden states
  label          [B, T] int32   draft id of the target's argmax after token t, -1 = no loss there
                                (prompt tokens, the last token, targets outside the draft vocab)
Step j's prediction at index t is made after token t+1+j, so its label is label[t+1+j].
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from specjax.train.forward import HeadDims, draft_logits, shift_left, unrolled


@dataclasses.dataclass(frozen=True)
class LossConfig:
    num_steps: int = 5  # K: unrolled draft steps
    decay: float = 0.8  # weight of step j: decay ** j
    compute_dtype: str = "float32"  # params and activations are cast to this inside the forward


def as_features(aux, dtype):
    """Stored features (uint16 = bfloat16 bits, or floats) -> dtype."""
    if aux.dtype == jnp.uint16:
        aux = jax.lax.bitcast_convert_type(aux, jnp.bfloat16)
    return aux.astype(dtype)


def ttt_loss(params, embed, batch, dims: HeadDims, cfg: LossConfig):
    """-> (weighted loss, metrics {"loss": [K], "acc": [K], "count": [K]})."""
    dtype = jnp.dtype(cfg.compute_dtype)
    p = {k: v.astype(dtype) for k, v in params.items()}
    aux = as_features(batch["aux"], dtype)
    total = jnp.zeros((), jnp.float32)
    losses, accs, counts = [], [], []
    for j, hidden, valid in unrolled(p, dims, embed, batch["ids"], batch["seg"], batch["pos"], aux,
                                     cfg.num_steps):
        lab = shift_left(batch["label"], j + 1, -1)
        m = valid & (lab >= 0)
        logits = draft_logits(p, dims, hidden)  # [B, T, Vd] float32
        lse = jax.nn.logsumexp(logits, axis=-1)
        picked = jnp.take_along_axis(logits, jnp.maximum(lab, 0)[..., None], axis=-1)[..., 0]
        n = jnp.sum(m)
        denom = jnp.maximum(n, 1).astype(jnp.float32)
        ce = jnp.sum(jnp.where(m, lse - picked, 0.0)) / denom
        hit = (jnp.argmax(logits, axis=-1) == lab) & m
        total = total + (cfg.decay ** j) * ce
        losses.append(ce)
        accs.append(jnp.sum(hit) / denom)
        counts.append(n)
    return total, {"loss": jnp.stack(losses), "acc": jnp.stack(accs), "count": jnp.stack(counts)}


def tau_estimate(accs) -> float:
    """Rough mean acceptance length of a greedy chain from per-step accuracies a_j (each measured
    after correct earlier tokens): 1 + a_0 + a_0 a_1 + ..."""
    tau, run = 1.0, 1.0
    for a in accs:
        run *= float(a)
        tau += run
    return tau
