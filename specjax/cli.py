"""`specjax` command line: thin wrappers over the library.

Every command logs one line at start: JAX's backend and devices (specjax.machine.log_backend), with
a warning when a GPU / TPU is present but JAX runs on the CPU.

Exit status: 0 when everything succeeded; 1 when a request failed (its output has finish_reason
"error" and an "error" message; the other requests still run and are written); 2 for bad arguments
or input files, reported before anything runs, argparse-style (usage + `specjax CMD: error: ...`
naming the flag).
"""
from __future__ import annotations

import argparse
import json
import re
import sys

EXIT_OK, EXIT_FAILED_REQUESTS, EXIT_USAGE = 0, 1, 2


class UsageError(Exception):
    """A bad command-line argument or input file; the message names the flag. main() reports it like
    argparse's own errors: usage and `specjax CMD: error: MESSAGE` on stderr, exit status 2."""


# API names in library messages -> the flags that set them
FLAG_NAMES = {"max_tokens": "--max-tokens", "temperature": "--temperature", "top_p": "--top-p",
              "top_k": "--top-k", "seed": "--seed", "json_schema": "--json-schema", "regex": "--regex",
              "grammar": "--grammar", "choice": "--choice", "num_steps": "--num-steps", "topk": "--topk",
              "num_draft_tokens": "--num-draft-tokens", "tensor_parallel": "--tensor-parallel",
              "max_seq_len": "--max-seq-len", "max_batch": "--max-batch", "ngram_max": "--ngram-max",
              "ngram_min": "--ngram-min", "ngram_branch": "--ngram-branch"}
_API_PREFIX = re.compile(r"^(invalid SamplingParams: |SpecConfig: |SpecConfig\.)")
_API_NAME = re.compile(r"\b(" + "|".join(FLAG_NAMES) + r")\b")


def flag_message(msg: str) -> str:
    """A library error message in command-line words: `invalid SamplingParams: temperature must be ...`
    -> `--temperature must be ...`."""
    return _API_NAME.sub(lambda m: FLAG_NAMES[m[1]], _API_PREFIX.sub("", msg))


def speculate_below_arg(text: str) -> int | None | str:
    """argparse type of --speculate-below: an integer >= 1, "none" (always speculate) or "auto" (the
    draft's measurements)."""
    word = text.strip().lower()
    return None if word == "none" else "auto" if word == "auto" else positive_int(text)


def min_accept_arg(text: str) -> float | None | str:
    """argparse type of --min-accept: a number >= 1, "none" (no gate) or "auto"."""
    word = text.strip().lower()
    if word in ("none", "auto"):
        return None if word == "none" else "auto"
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number >= 1, 'none' or 'auto', got {text!r}") from None
    if not v >= 1:
        raise argparse.ArgumentTypeError(f"must be a number >= 1 (tokens per fused step), got {v}")
    return v


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1 (argparse names the flag in its error)."""
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {v}")
    return v


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """--help shows each flag's default, except for switches and where the default means "not given"."""

    def _get_help_string(self, action):
        if action.default is None or action.nargs == 0:
            return action.help
        return super()._get_help_string(action)


# ----------------------------------------------------------------------------- input files

def _read_prompts(path: str) -> list[dict]:
    rows = []
    try:
        f = open(path)
    except OSError as e:
        raise UsageError(f"--prompts: cannot read {path}: {e.strerror}") from None
    with f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise UsageError(f"--prompts {path}:{n}: not valid JSON ({e})") from None
            if not isinstance(row, dict) or not ({"prompt", "turns", "prompt_ids"} & row.keys()):
                raise UsageError(f"--prompts {path}:{n}: a line needs \"prompt\", \"turns\" or \"prompt_ids\"")
            if not ({"prompt", "prompt_ids"} & row.keys()) and (
                    not isinstance(row["turns"], list) or not row["turns"] or not isinstance(row["turns"][0], str)):
                raise UsageError(f"--prompts {path}:{n}: \"turns\" needs at least one string turn")
            rows.append(row)
    if not rows:
        raise UsageError(f"--prompts {path}: no prompts in the file")
    return rows


def _prepare(row: dict, llm, chat: bool):
    """-> (prompt for generate, prompt text for the output, keys used)."""
    if "prompt_ids" in row:
        ids = row["prompt_ids"]
        return ids, llm.tokenizer.decode(ids), {"prompt_ids"}
    if "prompt" in row:
        text, used = row["prompt"], {"prompt"}
    else:
        text, used = row["turns"][0], {"turns"}
    prompt = llm.apply_chat_template([{"role": "user", "content": text}]) if chat else text
    return prompt, text, used


CONSTRAINT_KEYS = ("json_schema", "regex", "grammar", "choice")
KV_COMPACT_CHOICES = ("auto", "reference", "pallas", "mosaic", "mosaic:pallas_call")  # specjax.kernels (no jax here)
DRAFT_TOPK_CHOICES = ("auto", "xla", "reduce")  # specjax.kernels


def _read_text(path: str, flag: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError as e:
        raise UsageError(f"{flag}: cannot read {path}: {e.strerror}") from None


def _constraint_options(a) -> dict:
    """--json-schema FILE / --regex R / --grammar FILE / --choice A,B,C as SamplingParams fields."""
    if a.json_schema is not None:
        return {"json_schema": _read_text(a.json_schema, "--json-schema")}
    if a.regex is not None:
        return {"regex": a.regex}
    if a.grammar is not None:
        return {"grammar": _read_text(a.grammar, "--grammar")}
    if a.choice is not None:
        return {"choice": a.choice.split(",")}
    return {}


def _line_constraint(row: dict) -> dict:
    """A --prompts line's own constraint ("json_schema": object or string, "regex", "grammar" (EBNF
    text), "choice": list or comma-separated string); it replaces the command-line one."""
    given = {k: row[k] for k in CONSTRAINT_KEYS if k in row}
    if isinstance(given.get("choice"), str):
        given["choice"] = given["choice"].split(",")
    return given


# ----------------------------------------------------------------------------- the model

def add_model_arguments(g: argparse.ArgumentParser) -> None:
    """Flags that choose and size the model, the engine and speculative decoding (llm_from_args)."""
    from specjax.machine import ATTENTION_CHOICES, DTYPE_CHOICES
    g.add_argument("--model", default=None, metavar="DIR",
                   help="converted model directory (default: SmolLM2-135M-Instruct, fetched on first use)")
    g.add_argument("--dtype", choices=DTYPE_CHOICES, default="auto",
                   help="compute dtype; auto: float32 on the CPU, bfloat16 on GPUs and TPUs")
    g.add_argument("--max-batch", type=positive_int, default=8, help="requests decoded together")
    g.add_argument("--max-seq-len", type=positive_int, default=2048,
                   help="context length per request: prompt + generated tokens")
    g.add_argument("--tensor-parallel", type=positive_int, default=1,
                   help="shard the model (heads, MLP, vocabulary, KV heads) over N devices")
    g.add_argument("--attention", default="auto", choices=ATTENTION_CHOICES,
                   help="paged-attention implementation (auto: the Mosaic GPU kernel on Hopper GPUs, cuDNN "
                        "on other NVIDIA GPUs and for plain decoding of one row, the TPU kernel on TPU, the "
                        "jnp reference on the CPU; chosen once at start)")
    g.add_argument("--speculate", nargs="?", const="head", choices=("head", "ngram"), default=None,
                   help="speculative decoding: 'head' (also with no value) the EAGLE-3 head shipped for the "
                   "default model; 'ngram' drafts copied from the prompt and output so far (prompt lookup, "
                   "no weights, any model)")
    g.add_argument("--draft", metavar="DIR",
                   help="speculative decoding with this draft: a converted EAGLE head or draft model, 'self' "
                   "or 'ngram'")
    g.add_argument("--num-steps", type=positive_int, default=None,
                   help="tokens drafted per step (default: the draft's measured spec_defaults for --max-batch "
                   "when its specjax.json has them, else 4)")
    g.add_argument("--topk", type=positive_int, default=None, help="draft tree branching (1 = chain; default 1 "
                   "unless the draft's spec_defaults say otherwise)")
    g.add_argument("--num-draft-tokens", type=positive_int, default=None,
                   help="draft tree size (default: --num-steps for a chain, else num-steps * topk)")
    g.add_argument("--spec-tiers", action="store_true",
                   help="speculative decoding: each step runs the tree shape the draft's spec_defaults give for "
                   "the batch running now, not the one for --max-batch (lossless; measured no faster on an "
                   "H200 with the shipped head, so off by default)")
    g.add_argument("--speculate-below", type=speculate_below_arg, default="auto", metavar="N",
                   help="speculative decoding: batches of N or more requests run plain steps that keep the draft "
                   "in sync (lossless switching; for batches where verifying trees costs more than it gains); "
                   "'none': always speculate (default: the draft's measured spec_defaults, else none)")
    g.add_argument("--min-accept", type=min_accept_arg, default="auto", metavar="TAU",
                   help="speculative decoding: plain steps that keep the draft in sync while the measured tokens "
                   "per speculative step stay below TAU, with a speculative probe now and then (lossless); "
                   "'none': off (default: the n-gram drafter's measured break-even, 1.35, or the draft's "
                   "spec_defaults)")
    g.add_argument("--kv-compact-impl", choices=KV_COMPACT_CHOICES, default="auto",
                   help="KV compaction kernel of draft trees; auto: chosen once at start (a GPU kernel that "
                        "compiles, else the jnp reference); others are forced (an error if one does not "
                        "compile here). The engine's info line on stderr names the one that runs")
    g.add_argument("--draft-topk", choices=DRAFT_TOPK_CHOICES, default="auto",
                   help="the draft tree's per-level top-k; auto: one variadic reduction on GPU, lax.top_k "
                        "elsewhere (the same results); the info line names it")
    g.add_argument("--ngram-max", type=positive_int, default=4, help="n-gram drafter: longest suffix matched")
    g.add_argument("--ngram-min", type=positive_int, default=1, help="n-gram drafter: shortest suffix matched")
    g.add_argument("--ngram-branch", type=int, default=None, metavar="L",
                   help="a model draft's tree: add L nodes holding the request's best n-gram continuation under "
                        "the root (merged where the tree has them; 0 <= L <= --num-steps; default: the draft's "
                        "spec_defaults without tree flags, else 0: off; 0 turns a default branch off)")
    from specjax.engine import BatchOptions
    g.add_argument("--no-prefix-cache", dest="prefix_cache", action="store_false",
                   help="do not reuse the KV pages of prompt prefixes computed before (same outputs)")
    g.add_argument("--max-prefill-tokens", type=positive_int, default=BatchOptions.max_prefill_tokens,
                   help="tokens of one prefill call; longer prompts are prefilled in chunks between the decode "
                        "steps of running requests (lower: steadier streams while long prompts arrive)")
    g.add_argument("--prefill-chunk", type=positive_int, default=BatchOptions.prefill_chunk,
                   help="the longest piece of one prompt in a prefill call; longer prompts are prefilled in "
                        "chunks of this many tokens between decode steps (lower: steadier streams while a long "
                        "prompt arrives; higher: its first token sooner)")
    g.add_argument("--steps-per-call", type=positive_int, default=BatchOptions.steps_per_call, metavar="K",
                   help="plain decoding steps per dispatch (fewer: a new request's prefill waits less for the "
                        "running dispatch, a lower time to first token; more: less host work per token)")
    g.add_argument("--spec-steps-per-call", type=positive_int, default=BatchOptions.spec_steps_per_call,
                   metavar="K", help="fused speculative steps per dispatch (as --steps-per-call)")
    from specjax.scheduler import SchedulerOptions
    g.add_argument("--no-device-dfa", dest="device_dfa", action="store_false",
                   help="regex / choice / JSON-schema constraints through xgrammar on the host instead of token "
                        "DFAs followed on the device (same outputs; the device path needs no host work per token)")
    g.add_argument("--dfa-max-states", type=positive_int, default=SchedulerOptions.dfa_max_states, metavar="N",
                   help="device DFA tables: states per slot (a constraint with more takes the host path)")
    g.add_argument("--dfa-max-classes", type=positive_int, default=SchedulerOptions.dfa_max_classes, metavar="N",
                   help="device DFA tables: token classes per slot (a constraint with more takes the host path)")
    g.add_argument("--handover", action=argparse.BooleanOptionalAction, default=None,
                   help="speculation: a spare slot per row where the next request is prefilled ahead; a fused "
                        "dispatch's row runs it once its request ends (no steps lost past a request's end); "
                        "default: on at --max-batch 1 (one device, no --spec-tiers), off otherwise")
    g.add_argument("--unread", type=positive_int, default=None, metavar="N",
                   help="decode dispatches the host leaves unread after a step: 1 reads one behind, 2 two "
                        "behind (a request boundary's host work then runs over two dispatches of device work); "
                        "default: 2 with hand-over at --max-batch 1, else 1")


def check_model_arguments(a) -> None:
    """Refuse what cannot load (missing / unconverted directories, bad speculation settings) before
    anything heavy runs; --speculate becomes --draft <the shipped head> (or "ngram")."""
    from specjax.checkpoint import CheckpointError, check_converted
    if a.speculate == "ngram":
        if a.draft is not None:
            raise UsageError("--speculate ngram drafts from the text itself: drop --draft")
        a.draft = "ngram"
    elif a.speculate and a.draft is None:
        if a.model is not None:
            raise UsageError("--speculate uses the EAGLE-3 head shipped for the default model; "
                             "with --model give --draft DIR")
        from specjax.assets import DEFAULT_HEAD_DIR
        a.draft = str(DEFAULT_HEAD_DIR)
    for flag, path, what in (("--model", a.model, "model"), ("--draft", a.draft, "draft")):
        if path is not None and not (what == "draft" and path in ("self", "ngram")):
            try:
                check_converted(path, what)
            except CheckpointError as e:
                raise UsageError(f"{flag}: {e}") from None
    a.spec = None
    if a.draft is None and a.speculate_below not in ("auto", None):
        raise UsageError("--speculate-below applies to speculative decoding: give --speculate or --draft")
    if a.draft is None and getattr(a, "min_accept", "auto") not in ("auto", None):
        raise UsageError("--min-accept applies to speculative decoding: give --speculate or --draft")
    if a.draft is None and a.ngram_branch is not None:
        raise UsageError("--ngram-branch adds to a draft's tree: give --speculate or --draft")
    if getattr(a, "spec_tiers", False) and (a.draft is None or a.num_steps or a.topk or a.num_draft_tokens
                                           or a.ngram_branch is not None):
        raise UsageError("--spec-tiers runs the shapes of a draft's spec_defaults: give --speculate or --draft, "
                         "without --num-steps / --topk / --num-draft-tokens / --ngram-branch")
    if a.draft is not None:
        from specjax.llm import draft_method
        from specjax.tree import SpecConfig
        method = draft_method(a.draft)
        tree_flags = (a.num_steps, a.topk, a.num_draft_tokens)
        try:
            if method != "ngram" and tree_flags == (None, None, None):
                a.spec = None  # the LLM's default: the draft's spec_defaults, else a chain of 4
                if a.ngram_branch is not None:  # on top of the draft's spec_defaults (0: without theirs)
                    from specjax.llm import default_spec
                    a.spec = default_spec(a.draft, method, a.max_batch, ngram_branch=a.ngram_branch,
                                          ngram_max=a.ngram_max, ngram_min=a.ngram_min)
            else:
                a.spec = SpecConfig(method=method, num_steps=a.num_steps or 4, topk=a.topk or 1,
                                    num_draft_tokens=a.num_draft_tokens, ngram_max=a.ngram_max,
                                    ngram_min=a.ngram_min, ngram_branch=a.ngram_branch or 0)
        except ValueError as e:
            raise UsageError(flag_message(str(e))) from None


def llm_from_args(a, **more):
    """The LLM the flags of add_model_arguments describe (after check_model_arguments); `more`: other
    LLM arguments (e.g. num_pages, seed)."""
    from specjax import LLM
    from specjax.scheduler import SchedulerOptions
    more.setdefault("scheduler", SchedulerOptions(device_dfa=a.device_dfa, dfa_max_states=a.dfa_max_states,
                                                  dfa_max_classes=a.dfa_max_classes, handover=a.handover,
                                                  unread=a.unread))
    return LLM(a.model, dtype=a.dtype, max_batch=a.max_batch, max_seq_len=a.max_seq_len, draft=a.draft,
               spec=a.spec, tensor_parallel=a.tensor_parallel, kv_compact_impl=a.kv_compact_impl,
               draft_topk=a.draft_topk,
               attention=a.attention, prefix_cache=a.prefix_cache, max_prefill_tokens=a.max_prefill_tokens,
               prefill_chunk=a.prefill_chunk, steps_per_call=a.steps_per_call,
               spec_steps_per_call=a.spec_steps_per_call,
               speculate_below=a.speculate_below if a.draft is not None else "auto",
               min_accept=a.min_accept if a.draft is not None else "auto",
               spec_tiers=getattr(a, "spec_tiers", False), **more)


# ----------------------------------------------------------------------------- generate

def _sampling(a, rows: list[dict]) -> list[dict]:
    """One SamplingParams dict per line; bad command-line values stop here (UsageError naming the
    flag), a line's bad constraint fails that line only (finish_reason "error")."""
    from specjax import SamplingParams
    from specjax.sampling_params import SamplingParamsError
    base = dict(max_tokens=a.max_tokens, temperature=a.temperature, top_p=a.top_p, top_k=a.top_k, seed=a.seed)
    try:
        SamplingParams(**base, **_constraint_options(a))
    except SamplingParamsError as e:
        raise UsageError(flag_message(str(e))) from None
    if a.max_tokens >= a.max_seq_len:
        raise UsageError(f"--max-tokens {a.max_tokens} cannot fit --max-seq-len {a.max_seq_len} (the prompt "
                         "and the generated tokens share the context): raise --max-seq-len or lower --max-tokens")
    return [dict(base, **(_line_constraint(r) or _constraint_options(a))) for r in rows]


def _warn_context(llm, prompts, a) -> None:
    """A prompt whose length + --max-tokens exceeds --max-seq-len is cut short: say so up front."""
    for i, p in enumerate(prompts):
        n = len(p) if isinstance(p, list) else len(llm.tokenizer.encode(p, add_special_tokens=False))
        if n < a.max_seq_len and n + a.max_tokens > a.max_seq_len:
            print(f"specjax: warning: prompt {i} has {n} tokens: with --max-seq-len {a.max_seq_len} at most "
                  f"{a.max_seq_len - n} of --max-tokens {a.max_tokens} fit (finish_reason \"length\" there)",
                  file=sys.stderr)


def _finish_note(o, a) -> str:
    """`[finish_reason: ...]` for stderr: why this output ended."""
    why = ""
    if o.finish_reason == "length":
        ctx = len(o.prompt_token_ids) + len(o.token_ids) >= a.max_seq_len
        why = f"--max-seq-len {a.max_seq_len} reached" if ctx else f"--max-tokens {a.max_tokens} reached"
    elif o.finish_reason == "error":
        why = o.error or "failed"
    return f"[finish_reason: {o.finish_reason}{f' ({why})' if why else ''}]"


def engine_slots(max_batch: int, num_prompts: int) -> int:
    """Slots of the engine `specjax generate` builds: --max-batch, at most one per prompt."""
    return max(1, min(max_batch, num_prompts))


def cmd_generate(a) -> int:
    if a.prompt is None and a.prompts is None:
        raise UsageError("give --prompt TEXT or --prompts FILE.jsonl")
    rows = [{"prompt": a.prompt}] if a.prompt is not None else _read_prompts(a.prompts)
    params = _sampling(a, rows)
    check_model_arguments(a)
    from specjax.machine import log_backend
    log_backend()
    # no more slots than prompts: the engine's batch-size choices (the draft's measured tree shape,
    # the attention implementation) are those of the batch that runs
    a.max_batch = engine_slots(a.max_batch, len(rows))
    llm = llm_from_args(a)
    chat = a.chat if a.chat is not None else bool(llm.tokenizer.chat_template)
    prepared = [_prepare(r, llm, chat) for r in rows]
    _warn_context(llm, [p for p, _, _ in prepared], a)
    outs = llm.generate([p for p, _, _ in prepared], params)
    if a.output:
        with open(a.output, "w") as f:
            for row, (_, text, used), o in zip(rows, prepared, outs):
                rec = {"prompt": text, "text": o.text, "token_ids": o.token_ids, "finish_reason": o.finish_reason}
                if o.error is not None:
                    rec["error"] = o.error
                if o.accept_len_mean is not None:
                    rec["accept_len_mean"] = o.accept_len_mean
                used = used | set(CONSTRAINT_KEYS)
                rec.update({k: v for k, v in row.items() if k not in used and k not in rec})
                f.write(json.dumps(rec, ensure_ascii=False) + "\n")
    else:
        for (_, text, _), o in zip(prepared, outs):
            if len(outs) > 1:
                print(f"### {text}", flush=True)
            print(o.text, flush=True)
            print(_finish_note(o, a), file=sys.stderr)
            if o.accept_len_mean is not None:
                print(f"[mean acceptance length {o.accept_len_mean:.2f}]", file=sys.stderr)
    failed = sum(o.finish_reason == "error" for o in outs)
    if failed:
        print(f"specjax: {failed} of {len(outs)} request{'s' if len(outs) != 1 else ''} failed "
              "(finish_reason \"error\")", file=sys.stderr)
        return EXIT_FAILED_REQUESTS
    return EXIT_OK


# ----------------------------------------------------------------------------- other commands

def cmd_convert(a) -> int:
    from specjax.convert import convert, convert_draft
    from specjax.machine import log_backend
    log_backend()
    (convert_draft if a.draft else convert)(a.src, a.out, dtype=a.dtype)
    print(f"converted {a.src} -> {a.out}")
    return EXIT_OK


def cmd_download_default(a) -> int:
    from specjax.default_model import download_default
    from specjax.machine import log_backend
    log_backend()
    path = download_default(force=a.force)
    print(f"default model ready at {path}")
    return EXIT_OK


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="specjax", description="Speculative decoding for LLMs in JAX.",
                                formatter_class=HelpFormatter,
                                epilog="exit status: 0 ok, 1 a request failed, 2 bad arguments or input files")
    sub = p.add_subparsers(dest="cmd", required=True)

    g = sub.add_parser("generate", help="generate text", formatter_class=HelpFormatter,
                       epilog="exit status: 0 every request finished, 1 a request failed (finish_reason "
                              "\"error\"), 2 bad arguments or input files")
    src = g.add_mutually_exclusive_group()
    src.add_argument("--prompt", help="one prompt")
    src.add_argument("--prompts", metavar="FILE.jsonl",
                     help="JSONL: {\"prompt\"} | {\"turns\": [...]} | {\"prompt_ids\": [...]}; "
                          "optional per-line \"json_schema\" / \"regex\" / \"grammar\" / \"choice\"")
    g.add_argument("--max-tokens", type=int, default=128, help="tokens generated per prompt at most")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass, in (0, 1]")
    g.add_argument("--top-k", type=int, default=0, help="sample among the K likeliest tokens (0 = off)")
    g.add_argument("--seed", type=int, default=None, help="sampling seed (default: random)")
    add_model_arguments(g)
    mode = g.add_mutually_exclusive_group()
    mode.add_argument("--chat", dest="chat", action="store_true", default=None,
                      help="apply the chat template (default when the model has one)")
    mode.add_argument("--raw", dest="chat", action="store_false", help="use prompts as they are")
    g.add_argument("--output", metavar="OUT.jsonl",
                   help="write one JSON object per prompt (text, token_ids, finish_reason, ...) to this file")
    con = g.add_mutually_exclusive_group()
    con.add_argument("--json-schema", metavar="FILE", help="constrain outputs to this JSON schema")
    con.add_argument("--regex", metavar="R", help="constrain outputs to this regular expression")
    con.add_argument("--grammar", metavar="FILE", help="constrain outputs to this EBNF grammar (rule root)")
    con.add_argument("--choice", metavar="A,B,C", help="the output is exactly one of these strings")
    g.set_defaults(fn=cmd_generate, parser=g)

    c = sub.add_parser("convert", help="convert an HF folder or a .gguf file to a specjax checkpoint",
                       formatter_class=HelpFormatter)
    c.add_argument("src", help="Hugging Face model folder (config.json + *.safetensors), .gguf file, "
                               "or (with --draft) an EAGLE head folder")
    c.add_argument("out", help="output directory")
    c.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16",
                   help="dtype the parameters are stored in (models load in any dtype)")
    c.add_argument("--draft", action="store_true",
                   help="SRC is an EAGLE-1 / EAGLE-3 draft head folder (config.json + weights)")
    c.set_defaults(fn=cmd_convert, parser=c)

    d = sub.add_parser("download-default", help="fetch and convert SmolLM2-135M-Instruct",
                       formatter_class=HelpFormatter)
    d.add_argument("--force", action="store_true", help="fetch and convert again even if present")
    d.set_defaults(fn=cmd_download_default, parser=d)

    from specjax import eval as spec_eval
    ev = sub.add_parser("eval", help="acceptance length and speed-up of speculative decoding over prompt sets",
                        formatter_class=HelpFormatter)
    spec_eval.add_arguments(ev)
    ev.set_defaults(fn=spec_eval.cmd_eval, parser=ev)

    from specjax import serve_cli
    sv = sub.add_parser("serve", help="OpenAI-compatible HTTP server (speculative decoding on by default)",
                        formatter_class=HelpFormatter)
    serve_cli.add_arguments(sv)
    sv.set_defaults(fn=serve_cli.cmd_serve, parser=sv)
    return p


def main(argv=None) -> int:
    from specjax.machine import console_logging
    args = build_parser().parse_args(argv)
    console_logging()
    try:
        return args.fn(args)
    except UsageError as e:
        args.parser.error(str(e))  # usage + `specjax CMD: error: ...`, exit 2
    except (ValueError, FileNotFoundError) as e:
        print(f"specjax: error: {e}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
