"""Kernel choices of the engine's jitted programs: made once, when the engine starts, outside any
trace; reported on the engine's info line; passed to the programs as part of their static
configuration (a `Kernels` value closed over by the programs, so no global is read at trace time and
a choice never changes under a compiled program).

    Engine(..., kv_compact_impl="auto")
      -> choose_kv_compact("auto" | "reference" | "pallas" | "mosaic" | "mosaic:pallas_call",
                           shapes of the engine's target cache, rows, accepted-path length)
           "auto"  off GPU: "reference" (the Pallas kernels run only interpreted there: slower);
                   on GPU: the first of mosaic, mosaic:pallas_call, pallas that compiles for those
                   shapes, else "reference", with the reasons in the note (logged as a warning)
           forced: compiled for those shapes once; an implementation that does not compile raises
                   KernelError (never replaced by another)
      -> Kernels(kv_compact=...) -> specjax.step.accept (compaction of accepted tree paths)

    Engine(..., draft_topk="auto")
      -> choose_draft_topk("auto" | "xla" | "reduce"): "xla": lax.top_k; "reduce": specjax.topk, one
                 variadic reduction instead of XLA's TopK custom call (the same ids), in a tree without
                 grammar masks with the level's log-softmax inside it; "auto": "reduce" on GPU, where it
                 took 43 us off a 1 289 us SmolLM2 fused step (H200, docs/benchmarks.md), "xla"
                 elsewhere (unmeasured)
      -> Kernels(draft_topk=...) -> the tree growth (specjax.draft_tree.grow)

Attention is dispatched in specjax.attention.
"""
from __future__ import annotations

import dataclasses
import logging

import jax
import jax.numpy as jnp

from pallas_kernels import kv_compact as kvc
from specjax.topk import IMPLS as TOPK_IMPLS

log = logging.getLogger("specjax")

KV_COMPACT_CHOICES = ("auto",) + kvc.IMPLS
GPU_ORDER = ("mosaic", "mosaic:pallas_call", "pallas")  # what "auto" tries on GPU, in order


DRAFT_TOPK_CHOICES = ("auto",) + TOPK_IMPLS


def choose_draft_topk(requested: str, backend: str | None = None) -> str:
    """The draft top-k an engine runs for `requested` on `backend` (default: JAX's); checked once at
    engine start, so an unknown name fails there, not in a trace. A forced name holds everywhere."""
    if requested not in DRAFT_TOPK_CHOICES:
        raise ValueError(f"draft_topk must be one of {DRAFT_TOPK_CHOICES}, got {requested!r}")
    if requested == "auto":
        return "reduce" if (backend or jax.default_backend()) == "gpu" else "xla"
    return requested


class KernelError(ValueError):
    """An implementation forced by the user cannot run here."""


@dataclasses.dataclass(frozen=True)
class Kernels:
    """The implementations a jitted program runs (hashable, static)."""
    kv_compact: str = "reference"  # one of pallas_kernels.kv_compact.IMPLS
    draft_topk: str = "xla"  # the draft's per-level top-k: one of specjax.topk.IMPLS (the same results)


def compact_shapes(num_layers: int, page_shape: tuple[int, ...], dtype, rows: int, pages_per_slot: int,
                   accepted: int) -> tuple:
    """kv_compact arguments as ShapeDtypeStructs: num_layers page arrays of page_shape
    [num_pages, page_size, 2, Hkv, D], rows batch rows, paths of `accepted` nodes."""
    i32 = jnp.int32
    return ([jax.ShapeDtypeStruct(tuple(page_shape), dtype)] * num_layers,
            jax.ShapeDtypeStruct((rows, pages_per_slot), i32), jax.ShapeDtypeStruct((rows,), i32),
            jax.ShapeDtypeStruct((rows, accepted), i32), jax.ShapeDtypeStruct((rows,), i32))


def choose_kv_compact(requested: str, args) -> tuple[str, str]:
    """(implementation, note) for kv_compact over arguments shaped like `args` (see compact_shapes).
    Call once, outside traced code (it may compile the candidates)."""
    if requested not in KV_COMPACT_CHOICES:
        raise ValueError(f"kv_compact implementation must be one of {KV_COMPACT_CHOICES}, got {requested!r}")
    backend = jax.default_backend()
    if requested == "reference":
        return "reference", "forced"
    if requested != "auto":
        err = kvc.compile_error(requested, *args)
        if err is not None:
            raise KernelError(f"kv_compact implementation {requested!r} was asked for but does not compile on "
                              f"the {backend} backend for this engine's cache: {err}")
        return requested, "forced"
    if backend != "gpu":
        return "reference", f"auto: the {backend} backend runs Pallas kernels only interpreted"
    failed = []
    for name in GPU_ORDER:
        err = kvc.compile_error(name, *args)
        if err is None:
            return name, "auto" + (f" ({'; '.join(failed)})" if failed else "")
        failed.append(f"{name} does not compile: {(err.splitlines() or [''])[0][:300]}")
    note = "auto: no kernel compiles, the jnp reference runs (" + "; ".join(failed) + ")"
    log.warning("kv_compact: %s", note)
    return "reference", note
