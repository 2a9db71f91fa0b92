"""Tensor parallelism over one mesh axis "tp": attention heads, MLP columns and the vocabulary.

Only shardings are chosen here; the model and the jitted steps stay single-program code and
GSPMD inserts the collectives (Megatron layout):
  wq/wk/wv [E, H|K, D] split on heads, wo [H, D, E] on heads    -> one all-reduce after attention
  w_gate/w_up [E, F] split on mlp, w_down [F, E] on mlp         -> one all-reduce after the MLP
  embed [V, E], lm_head [E, V] split on vocab                    -> lookup: local masked gather +
      all-reduce; logits stay [B, V/tp] per device until argmax / sampling reduce or gather them
  KV pages [N, page_size, 2, Hkv, D] split on kv_heads: each device keeps its own heads' K/V
  norms, page tables, lengths, tokens, sampling arrays: replicated.
Each device therefore streams 1/tp of the weights and of the KV cache per decode step. A greedy
decode step then moves activations only: 1 + 2 * num_layers all-reduces of [B, E] and, for the
argmax over the sharded vocabulary, each shard's (max, index) [B, tp]; sampling (top-p sort) also
all-gathers the logits [B, V]. Weights are never gathered (tests/test_sharding.py checks the HLO).

Shardings travel with the arrays: jax.jit (decode.compile_steps) takes its input shardings
from the committed arguments and XLA propagates them, so the donated state comes back in the
layout it went in with and the next call reuses the same executable.

KV heads are never replicated: a model whose num_kv_heads is not divisible by tp is refused
(check_divisible). The vocabulary falls back to replication when it is not divisible
(resolve_rules; model_rules also looks at the parameters, e.g. an EAGLE-3 head's draft vocabulary).

Multi-host: the same code path. Every host runs the same program and calls
jax.distributed.initialize() before anything else touches JAX, then builds make_mesh(tp) over
jax.devices(), which then lists the devices of all hosts (not jax.local_devices()). Load with
restore_sharded (each host reads only the shards of its own devices) and build caches with
create_sharded (each device allocates its shards); shard_model / shard_cache copy from arrays
held by this host and are meant for one host. Sampled tokens are replicated, so every host can
read them; host inputs (token ids, page tables) must be identical on every host.
"""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from specjax.kv_cache import PAGE_AXES, KVCache

AXIS = "tp"
# logical axis (Param metadata `logical_axes`, kv_cache.PAGE_AXES) -> mesh axis or None (replicated)
DEFAULT_RULES: dict[str, str | None] = {
    "vocab": AXIS, "embed": None, "heads": AXIS, "kv_heads": AXIS, "mlp": AXIS, "pages": None,
}
Rules = dict  # logical axis -> mesh axis name or None


# ------------------------------------------------------------------------------ mesh and rules

def make_mesh(tensor_parallel: int, devices=None) -> Mesh:
    """A 1-D mesh ("tp",) over the first tensor_parallel devices (default: jax.devices()).

    Axes are AxisType.Auto (GSPMD propagation), not the Explicit default of jax.make_mesh."""
    devices = list(jax.devices() if devices is None else devices)
    if isinstance(tensor_parallel, bool) or not isinstance(tensor_parallel, int) or tensor_parallel < 1:
        raise ValueError(f"tensor_parallel must be an integer >= 1, got {tensor_parallel!r}")
    if tensor_parallel > len(devices):
        kind = devices[0].platform if devices else "none"
        raise ValueError(f"tensor_parallel={tensor_parallel} needs {tensor_parallel} devices, "
                         f"only {len(devices)} available ({kind})")
    devices = devices[:tensor_parallel]
    auto = (jax.sharding.AxisType.Auto,)
    try:
        return jax.make_mesh((tensor_parallel,), (AXIS,), axis_types=auto, devices=devices)
    except TypeError:  # a make_mesh without axis_types/devices keywords
        return Mesh(np.asarray(devices), (AXIS,), axis_types=auto)


def _tp(mesh: Mesh) -> int:
    return int(mesh.shape[AXIS]) if AXIS in mesh.shape else 1


def _model_dims(cfg) -> dict[str, int]:
    return {"heads": cfg.num_heads, "kv_heads": cfg.num_kv_heads, "mlp": cfg.intermediate_size,
            "vocab": cfg.vocab_size}


def check_divisible(cfg, tp: int, rules: Rules = DEFAULT_RULES) -> None:
    """Raise ValueError unless every model dim that `rules` shard is divisible by tp."""
    bad = [f"{name}={n}" for name, n in _model_dims(cfg).items() if rules.get(name) and n % tp]
    if not bad:
        return
    hint = ""
    if any(b.startswith("kv_heads=") for b in bad):
        hint = (" Each device must hold whole KV heads (KV heads are not replicated): "
                f"use a tensor_parallel that divides num_kv_heads={cfg.num_kv_heads}.")
    if any(b.startswith("vocab=") for b in bad):
        hint += " resolve_rules() replicates a vocabulary that tensor_parallel does not divide."
    raise ValueError(f"tensor_parallel={tp} does not divide {', '.join(bad)} "
                     f"({cfg.architecture}).{hint}")


def resolve_rules(cfg, tp: int, rules: Rules | None = None) -> Rules:
    """`rules` (default DEFAULT_RULES) for this model: the vocabulary is replicated when tp does not
    divide it; then check_divisible."""
    rules = dict(DEFAULT_RULES if rules is None else rules)
    if rules.get("vocab") and cfg.vocab_size % tp:
        rules["vocab"] = None
    check_divisible(cfg, tp, rules)
    return rules


def model_rules(model: nnx.Module, cfg, tp: int) -> Rules:
    """resolve_rules(cfg, tp) for a model whose vocabulary-axis parameters may be narrower than
    cfg.vocab_size (an EAGLE-3 head's reduced draft vocabulary): the vocabulary is replicated unless
    tp divides every one of them."""
    rules = resolve_rules(cfg, tp)
    if rules.get("vocab"):
        for _, var in nnx.iter_graph(model):
            if isinstance(var, nnx.Param):
                axes = var.get_metadata().get("logical_axes") or ()
                if any(ax == "vocab" and n % tp for ax, n in zip(axes, var.shape)):
                    rules["vocab"] = None
    return rules


def spec_for(axes: tuple, shape: tuple[int, ...], mesh: Mesh, rules: Rules, what: str = "array") -> PartitionSpec:
    """PartitionSpec of an array with logical `axes`; ValueError naming `what` if a dim does not divide."""
    if len(axes) != len(shape):
        raise ValueError(f"{what}: logical axes {axes} do not match shape {tuple(shape)}")
    names = []
    for dim, (ax, n) in enumerate(zip(axes, shape, strict=True)):
        if ax is not None and ax not in rules:
            raise ValueError(f"{what}: no sharding rule for logical axis {ax!r} (rules: {sorted(rules)})")
        mesh_axis = None if ax is None else rules[ax]
        if mesh_axis is not None and n % mesh.shape[mesh_axis]:
            raise ValueError(f"{what}: dim {dim} ({ax}={n}) is not divisible by mesh axis "
                             f"{mesh_axis!r} of size {mesh.shape[mesh_axis]}")
        names.append(mesh_axis)
    return PartitionSpec(*names)


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


# ------------------------------------------------------------------------------ parameters

def _is_var(x) -> bool:
    return isinstance(x, nnx.Variable)


def _name(path) -> str:
    """'layers.0.attn.wq' from a pytree key path (the flat names of llama.param_specs)."""
    return ".".join(str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path)


def param_shardings(model_or_state, mesh: Mesh, rules: Rules = DEFAULT_RULES):
    """nnx.State (the structure of nnx.state(model, nnx.Param)) of NamedSharding, one per Param,
    from its `logical_axes` metadata. Works on abstract models (nnx.eval_shape) too."""
    state = model_or_state if isinstance(model_or_state, nnx.State) else nnx.state(model_or_state, nnx.Param)

    def one(path, var):
        name = _name(path)
        axes = var.get_metadata().get("logical_axes")
        if axes is None:
            if isinstance(var, nnx.Param):
                raise ValueError(f"parameter {name} has no logical_axes metadata")
            return replicated(mesh)
        return NamedSharding(mesh, spec_for(tuple(axes), tuple(var.shape), mesh, rules, f"parameter {name}"))
    return jax.tree_util.tree_map_with_path(one, state, is_leaf=_is_var)


def shard_model(model: nnx.Module, mesh: Mesh, rules: Rules = DEFAULT_RULES) -> nnx.Module:
    """Place the model's parameters on the mesh (in place; returns the model). A mesh over several
    processes: parameters held by this process alone (e.g. a draft head loaded on every process) go
    through the host (each process gives the same values; device_put does not replicate a local
    device array onto other processes' devices)."""
    state = nnx.state(model, nnx.Param)
    if jax.process_count() > 1:
        state = jax.tree.map(lambda x: np.asarray(x) if getattr(x, "is_fully_addressable", False) else x, state)
    nnx.update(model, jax.device_put(state, param_shardings(state, mesh, rules)))
    return model


def flat_param_shardings(cfg, mesh: Mesh, rules: Rules = DEFAULT_RULES) -> dict[str, NamedSharding]:
    """Flat parameter name (llama.param_specs) -> NamedSharding."""
    from specjax.models.llama import param_specs
    return {name: NamedSharding(mesh, spec_for(axes, shape, mesh, rules, f"parameter {name}"))
            for name, (shape, axes) in param_specs(cfg).items()}


# ------------------------------------------------------------------------------ caches and state

def cache_sharding(tree, mesh: Mesh, rules: Rules = DEFAULT_RULES):
    """Shardings for any pytree holding KV caches (KVCache, DecodeState, SpecState, lists of them).

    KV pages (KVCache.kv and any other rank-5 leaf, e.g. SpecState.draft_kv) follow PAGE_AXES;
    every other leaf (page tables, lengths, last tokens) is replicated. Leaves may be abstract."""
    rep = replicated(mesh)

    def pages(path, x):
        return NamedSharding(mesh, spec_for(PAGE_AXES, tuple(x.shape), mesh, rules,
                                            f"KV pages {_name(path)}"))

    def one(path, x):
        if isinstance(x, KVCache):
            at = path + (jax.tree_util.GetAttrKey("kv"),)
            kv = [pages(at + (jax.tree_util.SequenceKey(i),), a) for i, a in enumerate(x.kv)]
            return KVCache(kv=kv, page_table=rep, seq_lens=rep)
        return pages(path, x) if len(x.shape) == len(PAGE_AXES) else rep
    return jax.tree_util.tree_map_with_path(one, tree, is_leaf=lambda x: isinstance(x, KVCache))


def shard_cache(tree, mesh: Mesh, rules: Rules = DEFAULT_RULES):
    """device_put a pytree of caches / decode state into cache_sharding (returns the new tree)."""
    return jax.device_put(tree, cache_sharding(tree, mesh, rules))


def create_sharded(make: Callable[[], Any], mesh: Mesh, rules: Rules = DEFAULT_RULES):
    """Build a cache / decode state directly in its shardings: each device allocates only its
    shards (no full copy on one device first). make: () -> pytree, e.g. a closure over init_cache."""
    shardings = cache_sharding(jax.eval_shape(make), mesh, rules)
    return jax.jit(make, out_shardings=shardings)()


# ------------------------------------------------------------------------------ checkpoints

def restore_sharded(model_dir: str | Path, mesh: Mesh, rules: Rules | None = None, dtype: Any = None):
    """(cfg, Llama) like checkpoint.load_model, with every parameter restored by orbax straight
    into its NamedSharding (each device reads and holds only its shards).

    rules: default resolve_rules(cfg, tp) (vocabulary replicated when tp does not divide it)."""
    import orbax.checkpoint as ocp

    from specjax import checkpoint as ck

    d = Path(model_dir)
    cfg = ck.load_config(d)
    rules = resolve_rules(cfg, _tp(mesh), rules)
    params_dir = (d / "params").absolute()
    if not params_dir.is_dir():
        raise ck.CheckpointError(f"model directory {d} has no params/ checkpoint")
    ckpt = ocp.StandardCheckpointer()
    try:
        try:
            tree = ckpt.metadata(params_dir).item_metadata.tree
            shapes = {k: tuple(v.shape) for k, v in tree.items()}
            stored = {k: np.dtype(v.dtype) for k, v in tree.items()}
        except Exception as e:  # noqa: BLE001 - orbax raises many types for broken directories
            raise ck.CheckpointError(f"{params_dir} is missing or corrupt: {type(e).__name__}: {e}") from e
        ck._check_flat(cfg, shapes, what=f"checkpoint {params_dir}")
        name = ck.dtype_name(dtype if dtype is not None
                             else ck.read_meta(d).get("dtype") or next(iter(stored.values())).name)
        jdtype = ck.DTYPES[name]
        shardings = flat_param_shardings(cfg, mesh, rules)
        target = {k: jax.ShapeDtypeStruct(s, jdtype, sharding=shardings[k]) for k, s in shapes.items()}
        try:
            flat = ckpt.restore(params_dir, target)
        except Exception as e:  # noqa: BLE001
            raise ck.CheckpointError(f"{params_dir} is corrupt, cannot restore: {type(e).__name__}: {e}") from e
    finally:
        ckpt.close()
    return cfg, _build_model(cfg, jdtype, dict(flat))


def _build_model(cfg, jdtype, flat: dict):
    """A Llama built abstractly (no random init, no device memory) and filled with `flat`."""
    from specjax.models.llama import Llama

    abstract = nnx.eval_shape(lambda: Llama(cfg, jdtype, rngs=nnx.Rngs(0)))
    graphdef, params, rest = nnx.split(abstract, nnx.Param, ...)
    pure = nnx.to_pure_dict(params)
    from specjax.checkpoint import fill_pure
    fill_pure(pure, flat, convert=lambda x: x)  # already on the mesh
    nnx.replace_by_pure_dict(params, pure)
    return nnx.merge(graphdef, params, rest)
