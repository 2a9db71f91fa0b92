"""On-device token sampling: greedy, temperature, top-k, top-p, with per-row parameters.

Randomness is keyed by (request seed, sequence position), so a request samples the same
tokens whatever batch it runs in. The draw is a Gumbel-max over the token ids in vocabulary order:
top-k / top-p only set the logits of the tokens they drop to -inf (a sort finds each row's cut-off
value), so a row without top-k / top-p draws the same token whether or not its batch needed the
sort, and a batch in which no sampling row filters skips the sort altogether (stochastic=UNFILTERED,
the engine's choice per dispatch: a [B, V] argsort costs milliseconds per step at large batch).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from specjax.sampling_params import MAX_LOGPROBS


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SamplingArrays:
    temperature: jax.Array  # [B] float32, 0 = greedy
    top_p: jax.Array  # [B] float32
    top_k: jax.Array  # [B] int32, 0 = off
    seed: jax.Array  # [B] uint32


def filtered_logits(logits, temperature, top_p, top_k):
    """Temperature, top-k and top-p applied to logits [B, V] (float32).
    Returns (sorted masked logits [B, V], their token ids [B, V])."""
    t = jnp.where(temperature > 0, temperature, 1.0)[:, None]
    scaled = logits / t
    order = jnp.argsort(-scaled, axis=-1)  # [B, V] descending
    vals = jnp.take_along_axis(scaled, order, axis=-1)
    rank = jnp.arange(vals.shape[-1], dtype=jnp.int32)[None, :]
    vals = jnp.where((top_k[:, None] > 0) & (rank >= top_k[:, None]), -jnp.inf, vals)
    probs = jax.nn.softmax(vals, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # mass strictly before each token
    vals = jnp.where((before >= top_p[:, None]) & (rank > 0) & (top_p[:, None] < 1.0), -jnp.inf, vals)
    return vals, order


def _row_key(seed, position):
    return jax.random.fold_in(jax.random.key(seed), position)


UNFILTERED = "unfiltered"  # the `stochastic` value of programs whose sampling rows use no top-k / top-p


def filter_in_place(scaled, top_p, top_k):
    """scaled [B, V] float32 (temperature applied) -> [B, V]: the same logits in vocabulary order with
    the tokens top-k / top-p drop set to -inf. A token is kept when its logit is >= the smallest logit
    filtered_logits keeps in its row (tokens tied with that cut-off are all kept)."""
    vals, _ = filtered_logits(scaled, jnp.ones_like(top_p), top_p, top_k)  # [B, V] sorted, -inf dropped
    kept = jnp.sum(vals > -jnp.inf, axis=-1)  # [B] >= 1 (rank 0 is always kept)
    cutoff = jnp.take_along_axis(vals, (kept - 1)[:, None], axis=-1)  # [B, 1]
    return jnp.where(scaled >= cutoff, scaled, -jnp.inf)


def sample(logits, samp: SamplingArrays, positions, stochastic: bool | str = True):
    """logits: [B, V] float32; positions: [B] int32 (unique per token of a request). -> [B] int32.

    stochastic is static: False compiles the greedy-only program (no sort, no host-read predicate);
    UNFILTERED the program for batches whose sampling rows have top_p >= 1 and top_k == 0 (no sort:
    the caller guarantees it; rows that do filter would be sampled unfiltered); True the general one.
    Rows whose temperature is 0 take the argmax in every program."""
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if not stochastic:
        return greedy
    t = jnp.where(samp.temperature > 0, samp.temperature, 1.0)[:, None]
    scaled = logits / t  # [B, V]
    if stochastic != UNFILTERED:
        scaled = filter_in_place(scaled, samp.top_p, samp.top_k)
    keys = jax.vmap(_row_key)(samp.seed, positions)
    tok = jax.vmap(jax.random.categorical)(keys, scaled).astype(jnp.int32)  # [B] token ids
    return jnp.where(samp.temperature > 0, tok, greedy)


def token_logprobs(logits, tokens):
    """Log-probabilities of the model's (unscaled) distribution: the chosen token's [B] and
    the top MAX_LOGPROBS [B, K] values and ids."""
    logp = jax.nn.log_softmax(logits, axis=-1)
    chosen = jnp.take_along_axis(logp, tokens[:, None], axis=-1)[:, 0]
    top_vals, top_ids = jax.lax.top_k(logp, MAX_LOGPROBS)
    return chosen, top_vals, top_ids.astype(jnp.int32)
