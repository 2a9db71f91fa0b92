"""The one dispatch point for attention over the paged cache.

Model code calls `attend(q, kv_pages, meta, impl)`; `impl` (AttnImpl) is static configuration held
by every Attention module of the model, set once at engine start by `configure(model, resolve(...))`
outside traced code, so it is part of the model's graph definition and of the jit key of every
program built from it. Implementations (same contract: pallas_kernels/paged_attention.py):

  reference   pure jnp; gathers every page of every row (cost grows with the capacity). CPU default,
              and the oracle of the tests.
  pallas      generic pallas_call over the live key blocks only (Triton on GPU; any page size).
  mosaic_gpu  Mosaic GPU kernel (Hopper; bf16 / f16; page sizes 8 .. 128 dividing or multiple of 64;
              head_dim a multiple of 64). "auto" on a Hopper GPU.
  tpu         Mosaic TPU kernel (page size a multiple of the sublane tile: 8 for 4-byte, 16 for 2-byte
              dtypes). "auto" on TPU; where it cannot serve, the reference runs and `resolve` says so.
  cudnn       cuDNN fused attention over the gathered pages (GPU bf16 / f16; reads every page).

"auto" order: gpu -> mosaic_gpu, cudnn, reference (cudnn first for plain decoding of one row); tpu -> tpu, reference; cpu -> reference.
With tensor parallelism (a mesh) the kernels are not used yet (they are not wrapped in shard_map):
"auto" takes cudnn on GPU (bf16 / f16) or the reference and says so.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import threading

import jax
import jax.numpy as jnp

from pallas_kernels.paged_attention import gather_kv, paged_attention_reference, visibility_mask
from specjax.kernel_choice import Choice, choose
from specjax.kv_cache import write_kv

# GPU "auto": the Mosaic GPU kernel (Hopper, bf16 / f16), else cuDNN (bf16 / f16), else the reference.
# Measured on an H100 (SmolLM2 + its EAGLE-3 head, tree 5/4/16, engine steady state, docs/benchmarks.md):
# with the kernel, 4 fused speculative steps take 10.8 ms at batch 32 (cuDNN, which gathers every
# page up to the capacity: 17.8 ms) and 7.0 ms at batch 1 (8.0 ms); speculation then beats plain
# decoding at batch 8, 32 and 64. Plain decoding of one row is the exception (886 vs 1033 tokens/s
# with cuDNN): a plain engine of max_batch 1 takes cuDNN first (PLAIN_BATCH1_ORDER).
AUTO_ORDER = {"gpu": ("mosaic_gpu", "cudnn", "reference"), "tpu": ("tpu", "reference"), "cpu": ("reference",)}
PLAIN_BATCH1_ORDER = ("cudnn", "mosaic_gpu", "reference")  # GPU, plain decoding with max_batch 1


@dataclasses.dataclass(frozen=True)
class AttnImpl:
    """Static attention configuration (hashable; part of the jit key)."""
    name: str = "reference"
    interpret: bool = False  # run a Pallas kernel in its interpreter (CPU tests)
    block_q: int | None = None  # kernel tuning knobs (None: the kernel's default)
    block_kv: int | None = None
    num_splits: int | None = None
    max_splits: int | None = None  # at most this many splits where num_splits is None (split_cap)
    fuse_write: bool = False  # block-masked calls write their K / V inside the kernel (write_and_attend)


REFERENCE = AttnImpl()

# Split caps by context (H200, SmolLM2 + its head at batch 1, docs/benchmarks.md, session 35): every split
# of a row's keys costs the combine's reads, so short rows are faster with fewer splits: `specjax eval`
# at batch 1 ran 1 278-1 310 us per fused step with at most 8 splits where rows stay <= 1 024 keys, against
# 1 352 us with the auto 32 (same machine). Past ~1 024 keys 8 splits stop paying (a sweep of one call:
# about even at 1 024-2 048, slower at 4 096, where a split walks many key blocks in order), so the cap
# follows the live context: the engine compiles fused programs with and without it (Engine._split_flags).
SHORT_CONTEXT = 1024  # keys: rows no longer than this take at most SHORT_SPLITS splits
SHORT_SPLITS = 8
SHORT_ROWS = 4  # dispatches of more rows keep the kernels' own count (auto: near or below 8 already)
SPLIT_KERNELS = ("mosaic_gpu", "pallas")  # the implementations that split a row's keys
_cap = threading.local()


def split_cap(context: int, rows: int) -> int | None:
    """The most splits for attention over `rows` rows of at most `context` keys (None: the kernel's
    own count)."""
    return SHORT_SPLITS if context <= SHORT_CONTEXT and rows <= SHORT_ROWS else None


@contextlib.contextmanager
def splits_at_most(n: int | None):
    """While a program is traced: the split-capable kernels it calls split a row's keys at most n
    ways (None: no cap). A program compiled under a cap is a program of its own (callers pass n as a
    static argument); outputs do not depend on the split count beyond float rounding."""
    before = getattr(_cap, "n", None)
    _cap.n = n
    try:
        yield
    finally:
        _cap.n = before


def paged_attention_cudnn(q, kv_pages, page_table, q_start, kv_len, block_mask=None,
                          *, sliding_window=None, scale=None, mask_start=None):
    """Same contract as the reference; the softmax(QK^T)V part runs as one cuDNN fused kernel
    (GPU, bf16/fp16 only). Gathering the pages stays in XLA."""
    T = q.shape[1]
    k, v = gather_kv(kv_pages, page_table)  # [B, S, Hkv, D]
    S = k.shape[1]
    kv_len = jnp.maximum(kv_len, 1)  # rows without keys (inactive, output unused): no fully masked row (NaN)
    if T == 1 and block_mask is None and sliding_window is None:  # decode: keys [0, kv_len)
        # a slot stepped past its last page (steps computed after a request ended are dropped)
        # must not make cuDNN read past the S gathered keys
        return jax.nn.dot_product_attention(q, k, v, scale=scale, key_value_seq_lengths=jnp.minimum(kv_len, S),
                                            implementation="cudnn")
    mask = visibility_mask(q_start, kv_len, S, T, block_mask, sliding_window, mask_start)[:, None]  # [B, 1, T, S]
    return jax.nn.dot_product_attention(q, k, v, mask=mask, scale=scale, implementation="cudnn")


FUSE_WRITE_ENV = "SPECJAX_FUSE_KV_WRITE"
FUSE_WRITE_DEFAULT = False  # see fuse_write_default


def fuse_write_default() -> bool:
    """Whether engines' attention writes a block-masked call's K / V inside the Mosaic kernel
    (write_and_attend): $SPECJAX_FUSE_KV_WRITE = 1 / 0, else FUSE_WRITE_DEFAULT. Measured on H100s
    (docs/benchmarks.md, sessions 47-48): two versions of the kernel cost more than the scatters they
    removed (6.9 against 4.5 µs per verify call, the step 1 386 against 1 341 µs); the default follows
    the measurements."""
    v = os.environ.get(FUSE_WRITE_ENV, "").strip()
    if v not in ("", "0", "1"):
        raise ValueError(f"${FUSE_WRITE_ENV} must be 0 or 1, got {v!r}")
    return FUSE_WRITE_DEFAULT if v == "" else v == "1"


def _tuning(impl: AttnImpl) -> dict:
    kw = {k: getattr(impl, k) for k in ("block_q", "block_kv", "num_splits", "max_splits")
          if getattr(impl, k) is not None}
    return dict(kw, interpret=impl.interpret)


def _lowered_once(kernel, static: tuple[str, ...] = ()):
    """A kernel wrapper as a jitted function: every call site with the same shapes (the layers of a
    model, the steps of a loop) shares one lowering. Called inline, each call site lowered the kernel
    again into its own copy: 30 layers made the engine's decode program take 24 s and its prefill
    36 s to compile on an H100 (SmolLM2, Mosaic GPU; docs/benchmarks.md)."""
    return jax.jit(kernel, static_argnames=("sliding_window",) + static)


def _pallas(impl):
    from pallas_kernels.paged_attention_pallas import paged_attention_pallas
    return _lowered_once(functools.partial(paged_attention_pallas, **_tuning(impl)))


def _mosaic(impl):
    from pallas_kernels.paged_attention_mosaic import paged_attention_mosaic
    return _lowered_once(functools.partial(paged_attention_mosaic, **_tuning(impl)))


def _tpu(impl):
    from pallas_kernels.paged_attention_tpu import paged_attention_tpu
    kw = _tuning(impl)
    kw.pop("num_splits", None)  # one TensorCore walks a row's pages in order: no splits
    kw.pop("max_splits", None)
    return _lowered_once(functools.partial(paged_attention_tpu, **kw))


_FACTORIES = {  # name -> (AttnImpl -> function with the reference's signature)
    "reference": lambda impl: paged_attention_reference,
    "cudnn": lambda impl: paged_attention_cudnn,
    "pallas": _pallas,
    "mosaic_gpu": _mosaic,
    "tpu": _tpu,
}


def register(name: str, factory) -> None:
    """Plug in an implementation: factory(AttnImpl) -> function with the reference's signature."""
    _FACTORIES[name] = factory
    implementation.cache_clear()


@functools.lru_cache(maxsize=None)
def implementation(impl: AttnImpl):
    """The function of impl (one object per AttnImpl, so that jitted kernels are traced and lowered
    once however many layers call them)."""
    if impl.name not in _FACTORIES:
        raise ValueError(f"unknown attention implementation {impl.name!r}; known: {sorted(_FACTORIES)}")
    return _FACTORIES[impl.name](impl)


def _capped(impl: AttnImpl) -> AttnImpl:
    cap = getattr(_cap, "n", None)
    if cap is not None and impl.name in SPLIT_KERNELS and impl.num_splits is None:
        impl = dataclasses.replace(impl, max_splits=min(cap, impl.max_splits or cap))
    return impl


def attend(q, kv_pages, meta, impl: AttnImpl = REFERENCE, *, sliding_window=None):
    """q: [B, T, H, D] over the pages named by meta (AttnMeta). Returns [B, T, H, D]."""
    return implementation(_capped(impl))(q, kv_pages, meta.page_table, meta.q_start, meta.kv_len, meta.block_mask,
                                         sliding_window=sliding_window, mask_start=meta.mask_start)


@functools.lru_cache(maxsize=None)
def _writer(impl: AttnImpl):
    """The kernel of impl that writes a block-masked call's K / V and attends in one launch (None: none)."""
    if impl.name != "mosaic_gpu":
        return None
    from pallas_kernels.paged_attention_mosaic import paged_attention_write_mosaic
    return _lowered_once(functools.partial(paged_attention_write_mosaic, **_tuning(impl)), static=("offset",))


def write_and_attend(q, k, v, kv_pages, meta, impl: AttnImpl = REFERENCE, *, sliding_window=None):
    """The new tokens' K / V [B, T, Hkv, D] written at meta.write_idx, then q [B, T, H, D] attends as in
    `attend`. Returns (o [B, T, H, D], kv_pages). Where impl has a kernel that does both, impl.fuse_write
    is on and the call is block-masked (tree verify; draft growth, whose meta knows q_start - mask_start
    when tracing: offset), one launch: the Mosaic GPU kernel takes the new rows from its input and writes
    them itself (XLA's scatter, one kernel per layer, is gone); otherwise `write_kv` then `attend` (same
    values: the kernel's tests compare the two). The kernel writes token i at q_start + i below kv_len, as the
    meta's write_idx does (kv_cache.meta_at)."""
    offset = 0 if meta.mask_start is None else getattr(meta, "offset", None)
    if offset is not None and impl.fuse_write and _writer(impl) is not None:
        from pallas_kernels.paged_attention_mosaic import why_not_write
        if why_not_write(q, kv_pages, meta.page_table, meta.block_mask, impl.block_q) is None:
            fn = _writer(_capped(impl))
            return fn(q, k, v, kv_pages, meta.page_table, meta.q_start, meta.kv_len, meta.block_mask,
                      sliding_window=sliding_window, mask_start=meta.mask_start, offset=offset)
    kv_pages = write_kv(kv_pages, k, v, meta.write_idx)
    return attend(q, kv_pages, meta, impl, sliding_window=sliding_window), kv_pages


# ----------------------------------------------------------------------------- choosing at start

def _gpu_kind() -> str | None:
    """Compute capability of the first GPU ("9.0" on Hopper), None when unknown."""
    try:
        return str(jax.devices("gpu")[0].compute_capability)
    except Exception:  # noqa: BLE001 - no GPU backend / attribute in this jax
        return None


def _checks(backend: str, dtype, page_size: int, head_dim: int, interpret: bool, mesh) -> dict:
    dtype = jnp.dtype(dtype)
    half = dtype in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))

    def kernel_common():
        if mesh is not None:
            return "tensor parallelism: the kernels are not wrapped in shard_map yet"
        return None

    def pallas():
        if backend != "gpu" and not interpret:
            return f"the generic Pallas kernel lowers through Triton (GPU); backend is {backend!r}"
        if not interpret and (head_dim & (head_dim - 1) or head_dim < 16):
            return f"head_dim {head_dim} is not a power of two >= 16 (Triton blocks)"
        return kernel_common()

    def mosaic():
        from pallas_kernels.paged_attention_mosaic import why_not_mosaic
        if backend != "gpu" and not interpret:
            return f"Mosaic GPU needs a GPU backend; backend is {backend!r}"
        if backend == "gpu" and not interpret and not (_gpu_kind() or "").startswith("9"):
            return f"Mosaic GPU kernel written for Hopper (sm_90); this GPU is sm_{_gpu_kind()}"
        return why_not_mosaic(dtype, page_size, head_dim) or kernel_common()

    def tpu():
        from pallas_kernels.paged_attention_tpu import why_not_tpu
        if backend != "tpu" and not interpret:
            return f"Mosaic TPU needs a TPU backend; backend is {backend!r}"
        return why_not_tpu(dtype, page_size, head_dim) or kernel_common()

    def cudnn():
        if backend != "gpu":
            return f"cuDNN needs a GPU backend; backend is {backend!r}"
        return None if half else f"cuDNN fused attention takes bf16 / fp16, not {dtype}"

    return {"reference": lambda: None, "pallas": pallas, "mosaic_gpu": mosaic, "tpu": tpu, "cudnn": cudnn}


def resolve(requested: str = "auto", *, dtype, page_size: int, head_dim: int, backend: str | None = None,
            interpret: bool = False, mesh=None, plain_batch: int | None = None, **tuning) -> tuple[AttnImpl, Choice]:
    """The implementation for this configuration, chosen once (outside traced code) and logged.
    backend: the platform the programs are for (default: jax's default backend; "tpu" to export
    TPU programs from a CPU host). interpret: Pallas kernels in their interpreter (CPU tests).
    tuning: block_q / block_kv / num_splits for the kernels. plain_batch: the rows of a plain-decoding
    engine (None: speculative decoding, or not known), which changes "auto" at batch 1 on GPUs. Forcing an implementation that cannot
    serve the configuration raises, naming the reason."""
    backend = backend or jax.default_backend()
    if backend == "cuda" or backend == "rocm":
        backend = "gpu"
    checks = _checks(backend, dtype, page_size, head_dim, interpret, mesh)
    order = AUTO_ORDER.get(backend, ("reference",))
    if backend == "gpu" and plain_batch == 1:
        order = PLAIN_BATCH1_ORDER
    if mesh is not None and backend == "gpu":
        order = ("cudnn", "reference")
    checks = {n: checks.get(n, lambda: None) for n in _FACTORIES}  # registered plug-ins: no checks
    choice = choose("attention", requested, order, checks)
    tuning.setdefault("fuse_write", fuse_write_default())
    return AttnImpl(choice.name, interpret=interpret and choice.name not in ("reference", "cudnn"), **tuning), choice


def configure(model, impl: AttnImpl):
    """A copy of `model` (same parameter arrays) whose Attention modules use `impl`."""
    from flax import nnx

    from specjax.models.llama import Attention
    graphdef, state = nnx.split(model)
    copy = nnx.merge(graphdef, state)
    for _, m in nnx.iter_modules(copy):
        if isinstance(m, Attention):
            m.attn_impl = impl
    return copy
