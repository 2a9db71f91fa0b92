"""Training data for EAGLE-3 heads: prompts -> target responses -> target features, in shards.

    prompts (jsonl: "turns"[0] | "prompt" | "question" | "instruction"; a row's "json_schema":
             its response generated under that schema, specjax.train.schemas)
      -> the target's chat template -> LLM.generate at several temperatures (one per prompt, in turn);
       a share of the prompts (ignore_eos_share, drawn per prompt from the seed) runs to max_tokens
       past the end of the turn: what the target writes after it (usually a new turn) is what a
       speculative decoder drafts for when EOS is ignored (equal-work benchmarks such as
       `specjax eval`, whose acceptance after the end of a response was the lowest)
      -> one target prefill over prompt + response (specjax.train.features), or with
         features=False nothing more: the training step computes the features on the fly
         (specjax.train.target; large runs: 30 M tokens of stored features would be ~100 GB)
      -> DATA_DIR/shard-00000.npz ... + DATA_DIR/manifest.json

Shards are written one chunk of prompts at a time and recorded in the manifest, so an interrupted
run resumes at the next chunk; a time budget stops after the chunk that exceeds it.
N processes (one per GPU) share one directory: worker i makes the chunks k with k % N == i
(shard files are named by chunk, so they never collide) and records them in its own
manifest.<i>-of-<N>.json; merge_manifests joins those into manifest.json. Each worker skips the
chunks that any manifest of the directory already lists, so a run resumes with any N.
Evaluation prompt sets are refused (see check_not_eval) and any training prompt that also occurs
in the shipped evaluation prompts (specjax/assets/prompts/*.jsonl, also data/prompts/) is dropped.
"""
from __future__ import annotations

import dataclasses
import json
import random
import sys
import time
from pathlib import Path

from specjax.assets import PROMPTS_DIR as EVAL_PROMPTS_DIR
from specjax.train.features import FeatureExtractor, Shard

EVAL_SET_STEMS = {"mt_bench", "gsm8k", "humaneval", "alpaca", "qa", "sum", "gsm8k_test"}
MANIFEST = "manifest.json"
FORMAT_VERSION = 1


class DataError(ValueError):
    """Training data that cannot be built or read."""


def check_not_eval(path: str | Path) -> None:
    """Refuse evaluation sets as training data: files named like a test split or one of the
    evaluation prompt sets, and anything inside a `prompts/` directory."""
    p = Path(path)
    stem = p.name.split(".")[0].lower()
    if "test" in stem or stem in EVAL_SET_STEMS or p.parent.name.lower() == "prompts":
        raise DataError(f"refusing {p} as training data: it looks like an evaluation set "
                        f"(test splits, {', '.join(sorted(EVAL_SET_STEMS))}, or prompts/ directories)")


def prompt_text(row: dict) -> str | None:
    """The user prompt of one jsonl row: turns[0], prompt, question or instruction (+ input)."""
    if isinstance(row.get("turns"), list) and row["turns"] and isinstance(row["turns"][0], str):
        return row["turns"][0]
    for key in ("prompt", "question"):
        if isinstance(row.get(key), str):
            return row[key]
    if isinstance(row.get("instruction"), str):
        extra = row.get("input")
        return row["instruction"] + (f"\n\n{extra}" if isinstance(extra, str) and extra else "")
    return None


def read_prompt_items(path: str | Path, *, allow_eval: bool = False) -> list[tuple[str, dict | None]]:
    """(prompt, json_schema or None) of each usable line of a jsonl file: a row's "json_schema"
    (specjax.train.schemas) makes its response generated under that schema."""
    if not allow_eval:
        check_not_eval(path)
    out = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{n}: not valid JSON ({e})") from None
            text = prompt_text(row) if isinstance(row, dict) else None
            schema = row.get("json_schema") if isinstance(row, dict) else None
            if schema is not None and not isinstance(schema, dict):
                raise DataError(f"{path}:{n}: json_schema must be an object, got {type(schema).__name__}")
            if text and text.strip():
                out.append((text, schema))
    return out


def read_prompts(path: str | Path, *, allow_eval: bool = False) -> list[str]:
    """Prompts of a jsonl file (lines without a usable field are skipped)."""
    return [t for t, _ in read_prompt_items(path, allow_eval=allow_eval)]


def eval_prompt_set(directory: Path = EVAL_PROMPTS_DIR) -> set[str]:
    texts: set[str] = set()
    for f in sorted(directory.glob("*.jsonl")) if directory.is_dir() else []:
        texts.update(t.strip() for t in read_prompts(f, allow_eval=True))
    return texts


@dataclasses.dataclass
class DataConfig:
    prompt_files: list[str]
    out_dir: str
    model_dir: str | None = None  # None: the default model
    dtype: str = "bfloat16"
    temperatures: tuple[float, ...] = (0.0, 0.7, 1.0)
    max_tokens: int = 256
    ignore_eos_share: float = 0.0  # prompts whose responses run to max_tokens past EOS (module doc)
    max_prompts: int | None = None
    max_seq_len: int = 1024
    max_batch: int = 64
    chunk_prompts: int = 512  # prompts per shard
    tokens_per_batch: int = 16384  # feature prefill
    features: bool = True  # store the target's features (False: token ids only)
    aux_layers: tuple[int, ...] | None = None  # None: (2, L//2, L-3)
    chat: bool = True
    seed: int = 0
    time_budget: float | None = None  # seconds; stop after the chunk that exceeds it
    progress: bool = True
    command: str = ""
    worker: int = 0  # this process makes the chunks k with k % workers == worker
    workers: int = 1  # > 1: recorded in manifest.<worker>-of-<workers>.json (see merge_manifests)


def part_manifest(worker: int, workers: int) -> str:
    return MANIFEST if workers == 1 else f"manifest.{worker}-of-{workers}.json"


def load_manifest(data_dir: str | Path, name: str = MANIFEST) -> dict | None:
    p = Path(data_dir) / name
    if not p.is_file():
        return None
    try:
        return json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise DataError(f"{p} is not valid JSON: {e}") from None


def _write_manifest(data_dir: Path, man: dict, name: str = MANIFEST) -> None:
    tmp = data_dir / (name + ".tmp")
    tmp.write_text(json.dumps(man, indent=2) + "\n")
    tmp.replace(data_dir / name)


def _part_names(data_dir: Path) -> list[str]:
    return sorted(p.name for p in data_dir.glob("manifest.*-of-*.json"))


def merge_manifests(data_dir: str | Path, command: str = "") -> dict | None:
    """Join the manifests of parallel workers (manifest.<i>-of-<N>.json) into manifest.json, then
    remove them: the union of their shards by chunk, complete when every chunk is in it, the
    seconds of the slowest worker added. Returns manifest.json's content (None: no manifest)."""
    out = Path(data_dir)
    man, names = load_manifest(out), _part_names(out)
    if not names:
        return man
    parts = [load_manifest(out, n) for n in names]
    merged = dict(man or parts[0])
    by_chunk = {s["chunk"]: s for m in ([man] if man else []) + parts for s in m["shards"]}
    merged["shards"] = sorted(by_chunk.values(), key=lambda s: s["chunk"])
    merged["num_prompts"] = parts[0]["num_prompts"]
    merged["complete"] = len(by_chunk) == -(-merged["num_prompts"] // merged["chunk_prompts"])
    merged["num_seqs"] = sum(s["num_seqs"] for s in merged["shards"])
    merged["num_tokens"] = sum(s["num_tokens"] for s in merged["shards"])
    merged["seconds"] = round((man or {}).get("seconds", 0.0) + max(m.get("seconds", 0.0) for m in parts), 1)
    merged["workers"] = max(int(n.split("-of-")[1].split(".")[0]) for n in names)
    merged["command"] = command or parts[0].get("command", "")
    _write_manifest(out, merged)
    for n in names:
        (out / n).unlink()
    return merged


def select_prompts(cfg: DataConfig) -> list[tuple[str, dict | None]]:
    """All (prompt, json_schema or None) of cfg.prompt_files, deduplicated, minus evaluation prompts,
    shuffled with cfg.seed, at most cfg.max_prompts."""
    seen, prompts = set(), []
    banned = eval_prompt_set()
    for f in cfg.prompt_files:
        for t, schema in read_prompt_items(f):
            key = t.strip()
            if key in seen or key in banned:
                continue
            seen.add(key)
            prompts.append((t, schema))
    random.Random(cfg.seed).shuffle(prompts)
    return prompts[: cfg.max_prompts] if cfg.max_prompts else prompts


def _log(msg: str, cfg: DataConfig | None = None) -> None:
    who = f" {cfg.worker}/{cfg.workers}" if cfg is not None and cfg.workers > 1 else ""
    print(f"[data{who}] {msg}", file=sys.stderr, flush=True)


def build_data(cfg: DataConfig) -> dict:
    """Generate responses and features for cfg's prompts (worker cfg.worker's chunks of them) into
    cfg.out_dir; returns this process's manifest. Chunks already in a manifest are skipped (resume)."""
    from specjax.checkpoint import load_config
    from specjax.train.forward import default_aux_layers

    t0 = time.perf_counter()
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if not 0 <= cfg.worker < cfg.workers:
        raise DataError(f"worker {cfg.worker} of {cfg.workers}: out of range")
    if not 0.0 <= cfg.ignore_eos_share <= 1.0:
        raise DataError(f"ignore_eos_share must be in [0, 1], got {cfg.ignore_eos_share}")
    if cfg.workers == 1:
        merge_manifests(out)  # the parts of an interrupted parallel run first
    man_name = part_manifest(cfg.worker, cfg.workers)
    prompts = select_prompts(cfg)
    if not prompts:
        raise DataError(f"no prompts in {cfg.prompt_files}")
    if cfg.model_dir is None:
        from specjax.default_model import ensure_default
        model_dir = Path(ensure_default())
    else:
        model_dir = Path(cfg.model_dir)
    mcfg = load_config(model_dir)
    aux = tuple(cfg.aux_layers) if cfg.aux_layers else default_aux_layers(mcfg.num_layers)
    found = {n: load_manifest(out, n) for n in [MANIFEST, *_part_names(out)]}
    found = {n: m for n, m in found.items() if m is not None}
    settings = {"model_dir": str(model_dir), "dtype": cfg.dtype, "aux_layers": list(aux),
                "temperatures": list(cfg.temperatures), "max_tokens": cfg.max_tokens, "seed": cfg.seed,
                "chunk_prompts": cfg.chunk_prompts, "chat": cfg.chat, "features": cfg.features,
                "prompt_files": [str(f) for f in cfg.prompt_files]}
    if cfg.ignore_eos_share:  # recorded when used (directories made before it have no such key)
        settings["ignore_eos_share"] = cfg.ignore_eos_share
    for n, m in found.items():
        if (any(m.get(k) != v for k, v in settings.items() if k != "model_dir")
                or m.get("ignore_eos_share", 0.0) != cfg.ignore_eos_share):
            raise DataError(f"{out / n} was made with other settings; use another --out directory")
    man = found.get(man_name)
    if man is None:
        man = {"format_version": FORMAT_VERSION, **settings, "hidden_size": mcfg.hidden_size,
               "vocab_size": mcfg.vocab_size, "feature_dtype": "bfloat16", "shards": [], "complete": False}
    man["num_prompts"] = len(prompts)
    man["command"] = cfg.command or man.get("command", "")
    done = {s["chunk"] for m in found.values() for s in m["shards"]}
    chunks = range(0, len(prompts), cfg.chunk_prompts)
    mine = {k for k in range(len(chunks)) if k % cfg.workers == cfg.worker}
    llm = extractor = None
    if mine - done:  # work left: load the target twice
        from specjax import LLM  # (the engine's copy, and one for the feature prefill)
        from specjax.checkpoint import load_model
        llm = LLM(model_dir, dtype=cfg.dtype, max_batch=cfg.max_batch, max_seq_len=cfg.max_seq_len)
        if cfg.features:
            _, module = load_model(model_dir, cfg.dtype)
            extractor = FeatureExtractor(module, mcfg, aux, cfg.tokens_per_batch)
    _log(f"{len(prompts)} prompts in {len(chunks)} chunks ({len(done)} done, {len(mine - done)} left to this "
         f"process), model {model_dir} ({cfg.dtype}), aux layers {aux}, setup {time.perf_counter() - t0:.1f}s", cfg)
    bar = _progress(len(mine), cfg.progress)
    stopped = False
    for k, start in enumerate(chunks):
        if k not in mine:
            continue
        if k in done:
            bar.update(1)
            continue
        if cfg.time_budget is not None and time.perf_counter() - t0 > cfg.time_budget:
            stopped = True
            _log(f"time budget {cfg.time_budget:.0f}s reached: stopping before chunk {k}", cfg)
            break
        shard, info = _make_chunk(cfg, llm, extractor, prompts[start: start + cfg.chunk_prompts], start)
        name = f"shard-{k:05d}.npz"
        shard.save(out / name)
        man["shards"].append({"chunk": k, "file": name, "num_seqs": shard.num_seqs,
                              "num_tokens": int(shard.offsets[-1]), **info})
        man["shards"].sort(key=lambda s: s["chunk"])
        _write_manifest(out, man, man_name)
        bar.update(1)
        bar.set_postfix(seqs=sum(s["num_seqs"] for s in man["shards"]), gen_s=f"{info['gen_s']:.1f}",
                        feat_s=f"{info['feat_s']:.1f}")
        _log(f"chunk {k}: {shard.num_seqs} seqs, {int(shard.offsets[-1])} tokens, generate {info['gen_s']:.1f}s "
             f"({info['gen_tokens'] / max(info['gen_s'], 1e-9):.0f} tok/s), features {info['feat_s']:.1f}s", cfg)
    bar.close()
    man["complete"] = not stopped and mine <= done | {s["chunk"] for s in man["shards"]}  # this process's share
    man["num_seqs"] = sum(s["num_seqs"] for s in man["shards"])
    man["num_tokens"] = sum(s["num_tokens"] for s in man["shards"])
    man["seconds"] = round(man.get("seconds", 0.0) + time.perf_counter() - t0, 1)
    _write_manifest(out, man, man_name)
    _log(f"{man['num_seqs']} sequences, {man['num_tokens']} tokens in {len(man['shards'])} shards "
         f"({'complete' if man['complete'] else 'partial'}); {time.perf_counter() - t0:.1f}s", cfg)
    return man


def ignores_eos(cfg: DataConfig, index: int) -> bool:
    """Whether prompt `index` (of the whole prompt list) is generated past EOS: a draw per prompt from
    the data seed, so a resumed or parallel run makes the same choice."""
    return cfg.ignore_eos_share > 0 and random.Random(f"ignore-eos {cfg.seed} {index}").random() < cfg.ignore_eos_share


def _make_chunk(cfg: DataConfig, llm, extractor, items: list[tuple[str, dict | None]], first_index: int):
    from specjax import SamplingParams

    t0 = time.perf_counter()
    ids, params = [], []
    for i, (text, schema) in enumerate(items):
        prompt = llm.apply_chat_template([{"role": "user", "content": text}]) if cfg.chat else text
        p = llm.tokenizer.encode(prompt, add_special_tokens=False)
        if not p or len(p) + cfg.max_tokens > cfg.max_seq_len:
            continue  # too long for the cache
        ids.append(p)
        g = first_index + i
        params.append(SamplingParams(max_tokens=cfg.max_tokens,
                                     temperature=float(cfg.temperatures[g % len(cfg.temperatures)]),
                                     seed=cfg.seed * 1_000_003 + g, json_schema=schema,
                                     ignore_eos=schema is None and ignores_eos(cfg, g)))
    outs = llm.generate(ids, params) if ids else []
    past_eos = sum(p.ignore_eos for p, o in zip(params, outs) if o.finish_reason != "error")
    kept = [(p, o) for p, o in zip(ids, outs) if o.finish_reason != "error"]  # a schema it cannot serve
    failed = len(outs) - len(kept)
    if failed:
        _log(f"{failed} prompt(s) failed and were left out: {next(o.error for o in outs if o.finish_reason == 'error')}",
             cfg)
    ids, outs = [p for p, _ in kept], [o for _, o in kept]
    seqs = [p + o.token_ids for p, o in zip(ids, outs)]
    gen_s = time.perf_counter() - t0
    t1 = time.perf_counter()
    feats = extractor(seqs) if seqs and extractor is not None else None
    feat_s = time.perf_counter() - t1
    shard = Shard.build(seqs, [len(p) for p in ids], feats)
    return shard, {"gen_s": round(gen_s, 2), "feat_s": round(feat_s, 2),
                   "gen_tokens": int(sum(len(o.token_ids) for o in outs)),
                   "schema_seqs": sum(schema is not None for _, schema in items), "failed": failed,
                   "ignore_eos_seqs": past_eos}


def load_shards(data_dir: str | Path) -> tuple[dict, list[Shard]]:
    man = load_manifest(data_dir)
    if man is None:
        raise DataError(f"{data_dir} has no {MANIFEST}: build the data first")
    shards = [Shard.load(Path(data_dir) / s["file"]) for s in man["shards"]]
    if not shards:
        raise DataError(f"{data_dir}: the manifest lists no shards")
    return man, shards


class _NoBar:
    def update(self, n=1):
        pass

    def set_postfix(self, **kw):
        pass

    def close(self):
        pass


def _progress(total: int, enabled: bool):
    try:
        from tqdm import tqdm
    except ImportError:
        enabled = False
    if not enabled:
        return _NoBar()
    return tqdm(total=total, desc="data chunks", unit="chunk", file=sys.stderr)
