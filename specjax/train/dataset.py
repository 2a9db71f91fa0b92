"""From data shards to training batches: the draft vocabulary and packed rows.

Draft vocabulary: the `size` target tokens the target predicts most often in the responses of the
training data (ties: lower id first), sorted by id. d2t[d] = target_id - d (what EagleHead stores);
t2d[target_id] = draft id or -1.

Packing: sequences (truncated to seq_len) are placed first-fit-decreasing into rows of seq_len
tokens; each gets its own segment id (1, 2, ... inside a row; 0 = padding) and positions from 0.
The loss runs where the target predicts a response token: label[u] = t2d[next_ids[u]] for
prompt_len - 1 <= u <= n - 2, else -1. Shards of token ids only (no stored features: the training
step computes them, specjax.train.target) pack without aux, and their label marks the loss span
only (0 inside, -1 outside); the step maps the target's argmax there.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from specjax.train.features import Shard


def loss_span(prompt_len: int, n: int) -> tuple[int, int]:
    """[lo, hi) of the token indices whose target prediction is trained on."""
    return max(prompt_len - 1, 0), max(n - 1, 0)


def has_features(sh: Shard) -> bool:
    return sh.aux.shape[0] == sh.ids.shape[0] and sh.ids.shape[0] > 0


def label_counts(shards: list[Shard], vocab_size: int) -> np.ndarray:
    """How often the target predicts each token inside the loss spans (shards without stored
    predictions: how often each token follows inside the spans, i.e. the responses' tokens, which
    the target predicted exactly where it decoded greedily)."""
    parts = []
    for sh in shards:
        for s in range(sh.num_seqs):
            a, b = int(sh.offsets[s]), int(sh.offsets[s + 1])
            lo, hi = loss_span(int(sh.prompt_lens[s]), b - a)
            parts.append(sh.next_ids[a + lo: a + hi] if has_features(sh) else sh.ids[a + lo + 1: a + hi + 1])
    flat = np.concatenate(parts) if parts else np.zeros(0, np.int32)
    return np.bincount(flat, minlength=vocab_size)[:vocab_size].astype(np.int64)


def draft_vocab(counts: np.ndarray, size: int, keep=None) -> tuple[np.ndarray, np.ndarray, float]:
    """-> (d2t [size] int32, t2d [V] int32, share of the label mass the draft vocabulary covers):
    the `size` most frequent labels, or keep (target ids, e.g. a trained head's vocabulary) and the most
    frequent others up to size."""
    V = len(counts)
    if not 0 < size <= V:
        raise ValueError(f"draft vocabulary size {size} must be in 1..{V} (the target vocabulary)")
    kept = np.zeros(V, bool)
    if keep is not None:
        kept[np.asarray(keep, np.int64)] = True
        if kept.sum() > size:
            raise ValueError(f"draft vocabulary size {size} is smaller than the {int(kept.sum())} ids to keep")
    order = np.lexsort((np.arange(V), -counts, ~kept))  # kept ids first, then most frequent, ties by id
    ids = np.sort(order[:size]).astype(np.int32)
    t2d = np.full(V, -1, np.int32)
    t2d[ids] = np.arange(size, dtype=np.int32)
    covered = float(counts[ids].sum() / max(counts.sum(), 1))
    return ids - np.arange(size, dtype=np.int32), t2d, covered


@dataclasses.dataclass
class Packed:
    ids: np.ndarray  # [R, T] int32
    seg: np.ndarray  # [R, T] int32
    pos: np.ndarray  # [R, T] int32
    aux: np.ndarray | None  # [R, T, 3E] uint16; None: the training step computes the features
    label: np.ndarray  # [R, T] int32 (without aux: 0 inside the loss span, -1 outside)

    @property
    def num_rows(self) -> int:
        return self.ids.shape[0]

    def arrays(self) -> dict[str, np.ndarray]:
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}

    def rows(self, idx) -> Packed:
        return Packed(**{k: (None if v is None else v[idx]) for k, v in dataclasses.asdict(self).items()})

    def split(self, frac: float) -> tuple[Packed, Packed | None]:
        """(train rows, held-out rows): the last max(1, frac * R) rows are held out (rows are
        already shuffled); frac 0 holds out nothing."""
        n = 0 if frac <= 0 else max(1, int(round(frac * self.num_rows)))
        if n >= self.num_rows:
            raise ValueError(f"held-out fraction {frac} leaves no training rows ({self.num_rows} rows)")
        if n == 0:
            return self, None
        return self.rows(slice(0, self.num_rows - n)), self.rows(slice(self.num_rows - n, None))

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays().values())


def pack(shards: list[Shard], t2d: np.ndarray, seq_len: int, seed: int = 0) -> Packed:
    seqs = [(k, s) for k, sh in enumerate(shards) for s in range(sh.num_seqs)
            if sh.offsets[s + 1] - sh.offsets[s] >= 2]
    if not seqs:
        raise ValueError("no sequence of at least 2 tokens to train on")
    lens = np.array([min(int(shards[k].offsets[s + 1] - shards[k].offsets[s]), seq_len) for k, s in seqs])
    cap = np.full(len(seqs), seq_len, np.int64)
    row_of = np.empty(len(seqs), np.int64)
    for i in np.argsort(-lens, kind="stable"):  # first fit decreasing
        r = int(np.argmax(cap >= lens[i]))
        row_of[i] = r
        cap[r] -= lens[i]
    used = np.flatnonzero(cap < seq_len)
    rows = np.random.default_rng(seed).permutation(used)  # long-first packing -> shuffle the rows
    new_row = np.empty(len(seqs), np.int64)
    new_row_map = {int(r): i for i, r in enumerate(rows)}
    for i in range(len(seqs)):
        new_row[i] = new_row_map[int(row_of[i])]
    R = len(rows)
    stored = [has_features(sh) for sh in shards]
    if len(set(stored)) > 1:
        raise ValueError("shards mix stored features and token ids only: build the data in one mode")
    aux = np.zeros((R, seq_len, shards[0].aux.shape[1]), np.uint16) if stored[0] else None
    out = Packed(ids=np.zeros((R, seq_len), np.int32), seg=np.zeros((R, seq_len), np.int32),
                 pos=np.zeros((R, seq_len), np.int32), aux=aux, label=np.full((R, seq_len), -1, np.int32))
    fill = np.zeros(R, np.int64)
    nseg = np.zeros(R, np.int32)
    for i, (k, s) in enumerate(seqs):
        sh, r, n = shards[k], new_row[i], int(lens[i])
        a = int(sh.offsets[s])
        c = int(fill[r])
        nseg[r] += 1
        out.ids[r, c: c + n] = sh.ids[a: a + n]
        out.seg[r, c: c + n] = nseg[r]
        out.pos[r, c: c + n] = np.arange(n)
        lo, hi = loss_span(int(sh.prompt_lens[s]), n)
        if aux is not None:
            out.aux[r, c: c + n] = sh.aux[a: a + n]
            if hi > lo:
                out.label[r, c + lo: c + hi] = t2d[sh.next_ids[a + lo: a + hi]]
        elif hi > lo:
            out.label[r, c + lo: c + hi] = 0
        fill[r] += n
    return out


@functools.lru_cache(maxsize=8)
def take_fn(sharding=None):
    """Jitted (arrays, idx) -> each array's rows idx, placed by `sharding` (None: jit's default);
    with a batch sharding over a mesh, each device gathers its own rows of the replicated arrays."""
    return jax.jit(lambda arrays, idx: jax.tree.map(lambda a: a[idx], arrays), out_shardings=sharding)


class Batches:
    """Deterministic batches of packed rows: batch `step` is a pure function of (seed, step), so a
    resumed run sees the same data as an uninterrupted one. Each epoch is a fresh permutation.
    With a DataParallel placement (specjax.train.mesh) the rows are replicated on every device and
    each batch is split over them; None: the default device."""

    def __init__(self, packed: Packed, batch_size: int, seed: int = 0, device_bytes: int = 16 << 30, dp=None):
        self.packed, self.batch_size, self.seed = packed, batch_size, seed
        self.num_rows = packed.num_rows
        self._perms: dict[int, np.ndarray] = {}
        self.on_device = packed.nbytes <= device_bytes
        self._batch = None if dp is None else dp.batch
        self._dev = jax.device_put(packed.arrays(), None if dp is None else dp.replicated) if self.on_device else None

    def _perm(self, epoch: int) -> np.ndarray:
        if epoch not in self._perms:
            self._perms = {epoch: np.random.default_rng((self.seed, epoch)).permutation(self.num_rows)}
        return self._perms[epoch]

    def indices(self, step: int) -> np.ndarray:
        g = step * self.batch_size + np.arange(self.batch_size)
        return np.array([self._perm(int(e))[int(i)] for e, i in zip(g // self.num_rows, g % self.num_rows)],
                        np.int32)

    def get(self, step: int) -> dict:
        idx = self.indices(step)
        if self.on_device:
            return take_fn(self._batch)(self._dev, jnp.asarray(idx))
        return jax.device_put({k: v[idx] for k, v in self.packed.arrays().items()}, self._batch)

    @property
    def steps_per_epoch(self) -> float:
        return self.num_rows / self.batch_size
