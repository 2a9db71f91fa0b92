"""specjax model directories: write and read converted checkpoints.

A model directory holds
  config.json       HF-style config (ModelConfig.from_hf_dict accepts it)
  params/           orbax checkpoint of the flat parameters {name from param_specs: array}
  specjax.json      format version, dtype, source; written last, so it marks a complete directory
  tokenizer.json, tokenizer_config.json, ...   written by the converters
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from specjax.config import ModelConfig
from specjax.models.llama import Llama, param_specs

FORMAT_VERSION = 1
MARKER = "specjax.json"
IN_PROGRESS = ".specjax-incomplete"  # exists while a directory is being written
DTYPES: dict[str, Any] = {"bfloat16": jnp.bfloat16, "float32": jnp.float32, "float16": jnp.float16}


class CheckpointError(ValueError):
    """A model directory that cannot be written or read."""


def dtype_name(dtype: Any) -> str:
    """'bfloat16' | 'float32' | 'float16' from a string or a numpy/jax dtype."""
    name = dtype if isinstance(dtype, str) else np.dtype(dtype).name
    if name not in DTYPES:
        raise CheckpointError(f"unsupported dtype {dtype!r}; supported: {', '.join(DTYPES)}")
    return name


def prepare_out_dir(out_dir: str | Path) -> Path:
    """Make out_dir ready to be (re)written. Refuses a non-empty directory that is not ours."""
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise CheckpointError(f"output path {out} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()):
        if not any((out / n).exists() for n in (MARKER, IN_PROGRESS, "params")):
            raise CheckpointError(f"refusing to overwrite {out}: non-empty and not a specjax model directory")
        (out / MARKER).unlink(missing_ok=True)  # incomplete until rewritten
        shutil.rmtree(out / "params", ignore_errors=True)
    out.mkdir(parents=True, exist_ok=True)
    (out / IN_PROGRESS).touch()
    return out


def save_model_dir(out_dir: str | Path, flat: dict[str, np.ndarray], hf_config: dict, dtype: str,
                   source: str = "") -> Path:
    """Write config.json, params/ (orbax, arrays cast to dtype) and, last, specjax.json."""
    import orbax.checkpoint as ocp

    name = dtype_name(dtype)
    cfg = ModelConfig.from_hf_dict(hf_config)
    _check_flat(cfg, {k: tuple(v.shape) for k, v in flat.items()}, what="parameters to save")
    out = prepare_out_dir(out_dir)
    (out / "config.json").write_text(json.dumps(hf_config, indent=2, sort_keys=True) + "\n")
    np_dtype = np.dtype(DTYPES[name])
    params = {k: np.asarray(v).astype(np_dtype, copy=False) for k, v in flat.items()}
    ckpt = ocp.StandardCheckpointer()
    ckpt.save((out / "params").absolute(), params)
    ckpt.wait_until_finished()
    ckpt.close()
    meta = {"format_version": FORMAT_VERSION, "dtype": name, "source": str(source),
            "architecture": cfg.architecture, "num_params": int(sum(v.size for v in params.values()))}
    (out / MARKER).write_text(json.dumps(meta, indent=2) + "\n")
    (out / IN_PROGRESS).unlink(missing_ok=True)
    return out


def is_complete(model_dir: str | Path) -> bool:
    d = Path(model_dir)
    return ((d / MARKER).is_file() and not (d / IN_PROGRESS).exists() and (d / "config.json").is_file()
            and (d / "params").is_dir())


def read_meta(model_dir: str | Path) -> dict:
    path = Path(model_dir) / MARKER
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path} is not valid JSON: {e}") from None


SPEC_KEYS = ("num_steps", "topk", "num_draft_tokens", "ngram_branch")
PLAIN = "plain"  # a spec_defaults entry: plain decoding beat every tree shape measured at that batch


def _spec_table(draft_dir: str | Path) -> dict[int, dict | str] | None:
    """A draft directory's specjax.json "spec_defaults", checked: {batch: SpecConfig keyword
    arguments (num_steps at least) or PLAIN}; None when it has none."""
    table = read_meta(draft_dir).get("spec_defaults")
    if not table:
        return None
    path = Path(draft_dir) / MARKER
    try:
        rows = {int(b): v if v == PLAIN else {k: v[k] for k in SPEC_KEYS if k in v} for b, v in table.items()}
    except (TypeError, ValueError, AttributeError) as e:
        raise CheckpointError(f"{path}: spec_defaults must map batch sizes to {{{', '.join(SPEC_KEYS)}}} or "
                              f"{PLAIN!r}: {e}") from None
    if any(v != PLAIN and "num_steps" not in v for v in rows.values()):
        raise CheckpointError(f"{path}: every spec_defaults entry needs num_steps (or is {PLAIN!r})")
    return rows


def head_spec_defaults(draft_dir: str | Path, batch: int) -> tuple[dict, int] | None:
    """The tree shape a draft directory recommends for `batch` concurrent requests: its specjax.json
    "spec_defaults" ({"<batch>": {"num_steps", "topk", "num_draft_tokens"} or "plain"}, written by
    scripts/tree_grid.py from measurements), the tree entry of the largest batch <= `batch` (else
    the smallest) -> (SpecConfig keyword arguments, that entry's batch), or None when it has no tree
    entry. Entries "plain" say where speculation does not pay (head_speculate_below)."""
    rows = _spec_table(draft_dir)
    trees = {b: v for b, v in (rows or {}).items() if v != PLAIN}
    if not trees:
        return None
    fit = [b for b in trees if b <= batch]
    b = max(fit) if fit else min(trees)
    return trees[b], b


def head_spec_tiers(draft_dir: str | Path, max_batch: int) -> list[tuple[int, dict]]:
    """The tree shapes a draft directory recommends by batch up to max_batch: its spec_defaults' tree
    entries of batches <= max_batch (the smallest one's bound taken as 1 row) -> [(min_rows,
    SpecConfig keyword arguments)] ascending (specjax.spec_tiers), [] without measurements."""
    trees = sorted((b, v) for b, v in (_spec_table(draft_dir) or {}).items() if v != PLAIN)
    fit = [(b, v) for b, v in trees if b <= max_batch] or trees[:1]
    return [(1 if i == 0 else b, v) for i, (b, v) in enumerate(fit)]


def head_min_accept(draft_dir: str | Path, batch: int) -> float | None:
    """The break-even acceptance a draft directory's measurements give for `batch` rows: "min_accept"
    of the spec_defaults tree entry head_spec_defaults picks (tokens per fused step below which its
    fused step is slower than a plain one: specjax.adaptive), or None when that entry has none."""
    found = head_spec_defaults(draft_dir, batch)
    if found is None:
        return None
    value = read_meta(draft_dir)["spec_defaults"][str(found[1])].get("min_accept")
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or value < 1):
        raise CheckpointError(f"{Path(draft_dir) / MARKER}: spec_defaults[{found[1]}].min_accept must be a number "
                              f">= 1, got {value!r}")
    return value


def head_speculate_below(draft_dir: str | Path) -> int | None:
    """The batch size from which a draft directory's measurements say plain decoding wins: the
    smallest batch of its spec_defaults from which every entry is "plain" (the engine's
    BatchOptions.speculate_below: lite steps from that many rows on), or None (speculation measured
    to pay at its largest batch, or no measurements)."""
    rows = _spec_table(draft_dir)
    below = None
    for b in sorted(rows or {}, reverse=True):
        if rows[b] != PLAIN:
            break
        below = b
    return below


def measurement_note(draft_dir: str | Path, attention: str) -> str | None:
    """Why a draft directory's spec_defaults may not fit this engine: its specjax.json
    "spec_defaults_measured" ({"attention", "device", ...}, written by scripts/tree_grid.py) names
    another attention implementation than `attention` (the engine's), whose costs decide where
    speculation pays (cuDNN's attention reads every page up to the capacity; the Mosaic kernel only
    the live ones). None when they agree or nothing was recorded."""
    measured = read_meta(draft_dir).get("spec_defaults_measured")
    if not isinstance(measured, dict) or not measured.get("attention") or measured["attention"] == attention:
        return None
    where = f" on {measured['device']}" if measured.get("device") else ""
    return (f"the draft's spec_defaults were measured with attention {measured['attention']}{where}; this engine "
            f"runs {attention}, so its tree shapes and lite-step threshold may not be the fastest here "
            "(scripts/tree_grid.py --write-best measures them; --speculate-below / --num-steps override)")


def convert_hint(path: str | Path, what: str = "model") -> str:
    """What to run when `path` is a model (or draft) that has not been converted yet."""
    if what == "draft":
        return (f"convert it first: `specjax convert --draft {path} OUT_DIR` (an EAGLE-1 / EAGLE-3 head) "
                f"or `specjax convert {path} OUT_DIR` (a draft model)")
    return f"convert it first: `specjax convert {path} OUT_DIR` (a Hugging Face folder or a .gguf file)"


def check_converted(path: str | Path, what: str = "model") -> Path:
    """Path(path) if it is a converted specjax directory (it has specjax.json); otherwise a
    CheckpointError naming the problem and, for unconverted inputs, the `specjax convert` command.
    what: "model" or "draft" (the word used in the message)."""
    d = Path(path)
    if not d.exists():
        raise CheckpointError(f"{what} directory {d} does not exist")
    if not d.is_dir():
        raise CheckpointError(f"{what} path {d} is a file, not a converted model directory; {convert_hint(d, what)}")
    if not (d / MARKER).is_file():
        raise CheckpointError(f"{what} directory {d} is not a converted specjax checkpoint (no {MARKER}); "
                              f"{convert_hint(d, what)}")
    return d


def load_config(model_dir: str | Path) -> ModelConfig:
    d = Path(model_dir)
    if not d.is_dir():
        check_converted(d)  # raises: does not exist / is a file
    if not (d / "config.json").is_file():
        raise CheckpointError(f"model directory {d} has no config.json; {convert_hint(d)}")
    return ModelConfig.from_file(d / "config.json")


def load_flat(model_dir: str | Path, dtype: Any = None) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """(cfg, {name: host array in dtype}) restored from model_dir/params, names/shapes validated."""
    import orbax.checkpoint as ocp

    d = Path(model_dir)
    cfg = load_config(d)
    meta = read_meta(d)
    params_dir = (d / "params").absolute()
    if not params_dir.is_dir():
        raise CheckpointError(f"model directory {d} has no params/ checkpoint; {convert_hint(d)}")
    ckpt = ocp.StandardCheckpointer()
    try:
        tree = ckpt.metadata(params_dir).item_metadata.tree
        shapes = {k: tuple(v.shape) for k, v in tree.items()}
        stored = {k: np.dtype(v.dtype) for k, v in tree.items()}
    except Exception as e:  # noqa: BLE001 - orbax raises many types for broken directories
        raise CheckpointError(f"{params_dir} is missing or corrupt: {type(e).__name__}: {e}") from e
    _check_flat(cfg, shapes, what=f"checkpoint {params_dir}")
    name = dtype_name(dtype) if dtype is not None else meta.get("dtype") or next(iter(stored.values())).name
    target_dtype = np.dtype(DTYPES[dtype_name(name)])
    target = {k: jax.ShapeDtypeStruct(s, target_dtype) for k, s in shapes.items()}
    try:
        flat = ckpt.restore(params_dir, target)
    except Exception as e:  # noqa: BLE001
        raise CheckpointError(f"{params_dir} is corrupt, cannot restore: {type(e).__name__}: {e}") from e
    finally:
        ckpt.close()
    return cfg, dict(flat)


def load_model(model_dir: str | Path, dtype: Any = None) -> tuple[ModelConfig, Llama]:
    """(cfg, Llama) with parameters restored in dtype (default: the checkpoint's dtype).

    The model is built abstractly (no random init) and filled from the checkpoint."""
    cfg, flat = load_flat(model_dir, dtype)
    jdtype = DTYPES[dtype_name(next(iter(flat.values())).dtype)]
    abstract = nnx.eval_shape(lambda: Llama(cfg, jdtype, rngs=nnx.Rngs(0)))
    graphdef, params, rest = nnx.split(abstract, nnx.Param, ...)
    if jax.tree_util.tree_leaves(rest):
        raise CheckpointError("model has non-parameter state that a checkpoint cannot fill")
    pure = nnx.to_pure_dict(params)
    fill_pure(pure, flat)  # names/shapes checked against param_specs
    nnx.replace_by_pure_dict(params, pure)
    return cfg, nnx.merge(graphdef, params, rest)


def load_tokenizer(model_dir: str | Path):
    """transformers PreTrainedTokenizerFast from model_dir's tokenizer.json/tokenizer_config.json."""
    from transformers import PreTrainedTokenizerFast

    d = Path(model_dir)
    if not (d / "tokenizer.json").is_file():
        raise CheckpointError(f"model directory {d} has no tokenizer.json")
    try:
        return PreTrainedTokenizerFast.from_pretrained(str(d.absolute()), local_files_only=True)
    except Exception as e:  # noqa: BLE001
        raise CheckpointError(f"cannot load the tokenizer of {d}: {type(e).__name__}: {e}") from e


def fill_pure(pure: dict, flat: dict, convert=jnp.asarray) -> None:
    """Fill a nested nnx pure dict in place from flat 'a.b.c' names."""
    def fill(node: dict, prefix: str) -> None:
        for key, value in node.items():
            name = f"{prefix}{key}"
            if isinstance(value, dict):
                fill(value, name + ".")
            else:
                node[key] = convert(flat[name])
    fill(pure, "")


def _check_specs(specs: dict, shapes: dict[str, tuple[int, ...]], what: str, against: str) -> None:
    """CheckpointError naming missing / unexpected / mis-shaped parameters of `shapes` vs `specs`."""
    missing = sorted(set(specs) - set(shapes))
    extra = sorted(set(shapes) - set(specs))
    bad = [f"{k}: {shapes[k]} != expected {specs[k][0]}" for k in sorted(set(specs) & set(shapes))
           if tuple(shapes[k]) != tuple(specs[k][0])]
    problems = []
    if missing:
        problems.append(f"missing {len(missing)} parameter(s): {', '.join(missing[:6])}")
    if extra:
        problems.append(f"unexpected {len(extra)} parameter(s): {', '.join(extra[:6])}")
    if bad:
        problems.append(f"shape mismatch: {'; '.join(bad[:6])}")
    if problems:
        raise CheckpointError(f"{what} does not match {against}: " + " | ".join(problems))


def _check_flat(cfg: ModelConfig, shapes: dict[str, tuple[int, ...]], what: str) -> None:
    _check_specs(param_specs(cfg), shapes, what, f"the config ({cfg.architecture})")


# ---- draft heads (EAGLE-1 / EAGLE-3): same layout, specjax.json carries "kind" ----

DRAFT_KINDS = ("eagle", "eagle3")


def save_draft_dir(out_dir: str | Path, flat: dict[str, np.ndarray], hf_config: dict, dtype: str,
                   source: str = "") -> Path:
    """Write a draft head directory: config.json (with its "specjax_draft" entry), params/ (floats in
    dtype, d2t int32) and, last, specjax.json with "kind" = the head's method."""
    import orbax.checkpoint as ocp

    from specjax.models.eagle import EagleConfig

    name = dtype_name(dtype)
    cfg = EagleConfig.from_hf_dict(hf_config, None)
    _check_draft_flat(cfg, {k: tuple(v.shape) for k, v in flat.items()}, what="draft parameters to save")
    out = prepare_out_dir(out_dir)
    (out / "config.json").write_text(json.dumps(hf_config, indent=2, sort_keys=True) + "\n")
    np_dtype = np.dtype(DTYPES[name])
    params = {k: np.asarray(v).astype(np.int32 if k == "d2t" else np_dtype, copy=False) for k, v in flat.items()}
    ckpt = ocp.StandardCheckpointer()
    ckpt.save((out / "params").absolute(), params)
    ckpt.wait_until_finished()
    ckpt.close()
    meta = {"format_version": FORMAT_VERSION, "kind": cfg.method, "dtype": name, "source": str(source),
            "num_params": int(sum(v.size for v in params.values()))}
    (out / MARKER).write_text(json.dumps(meta, indent=2) + "\n")
    (out / IN_PROGRESS).unlink(missing_ok=True)
    return out


def load_draft_flat(draft_dir: str | Path, target_cfg: ModelConfig, dtype: Any = None):
    """(flat parameters {name: array} incl. d2t, EagleConfig, float dtype) of a converted draft head,
    checked against the target's config (the names are those specjax.train exports)."""
    import orbax.checkpoint as ocp

    from specjax.config import ConfigError
    from specjax.models.eagle import EagleConfig
    d = Path(draft_dir)
    if not d.is_dir():
        raise CheckpointError(f"draft directory {d} does not exist")
    meta = read_meta(d)
    if meta.get("kind") not in DRAFT_KINDS:
        raise CheckpointError(f"{d / MARKER}: not a converted draft head (kind={meta.get('kind')!r}; "
                              f"expected one of {', '.join(DRAFT_KINDS)}; convert with `specjax convert --draft`)")
    if not (d / "config.json").is_file():
        raise CheckpointError(f"draft directory {d} has no config.json")
    try:
        cfg = EagleConfig.from_dir(d, target_cfg)
    except ConfigError as e:
        raise CheckpointError(f"{d / 'config.json'}: {e}") from None
    params_dir = (d / "params").absolute()
    if not params_dir.is_dir():
        raise CheckpointError(f"draft directory {d} has no params/ checkpoint")
    ckpt = ocp.StandardCheckpointer()
    try:
        try:
            tree = ckpt.metadata(params_dir).item_metadata.tree
            shapes = {k: tuple(v.shape) for k, v in tree.items()}
        except Exception as e:  # noqa: BLE001 - orbax raises many types for broken directories
            raise CheckpointError(f"{params_dir} is missing or corrupt: {type(e).__name__}: {e}") from e
        _check_draft_flat(cfg, shapes, what=f"checkpoint {params_dir}")
        fdtype = np.dtype(DTYPES[dtype_name(dtype if dtype is not None else meta.get("dtype", "float32"))])
        target = {k: jax.ShapeDtypeStruct(s, np.int32 if k == "d2t" else fdtype) for k, s in shapes.items()}
        try:
            flat = ckpt.restore(params_dir, target)
        except Exception as e:  # noqa: BLE001
            raise CheckpointError(f"{params_dir} is corrupt, cannot restore: {type(e).__name__}: {e}") from e
    finally:
        ckpt.close()
    return flat, cfg, fdtype


def load_draft(draft_dir: str | Path, target_cfg: ModelConfig, dtype: Any = None):
    """(EagleHead, EagleConfig) of a converted draft head, checked against the target's config;
    float parameters in dtype (default: the checkpoint's dtype)."""
    from specjax.models.eagle import EagleHead

    flat, cfg, fdtype = load_draft_flat(draft_dir, target_cfg, dtype)
    abstract = nnx.eval_shape(lambda: EagleHead(cfg, DTYPES[fdtype.name], rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    pure = nnx.to_pure_dict(state)
    fill_pure(pure, flat)  # names/shapes checked against eagle.param_specs
    nnx.replace_by_pure_dict(state, pure)
    return nnx.merge(graphdef, state), cfg


def _check_draft_flat(cfg, shapes: dict[str, tuple[int, ...]], what: str) -> None:
    from specjax.models.eagle import param_specs as draft_specs

    _check_specs(draft_specs(cfg), shapes, what, f"the {cfg.method} head config")
