"""`specjax` command line: thin wrappers over the library."""
from __future__ import annotations

import argparse
import json
import sys


def _read_prompts(path: str) -> list[dict]:
    rows = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise SystemExit(f"{path}:{n}: not valid JSON ({e})")
            if not isinstance(row, dict) or not ({"prompt", "turns", "prompt_ids"} & row.keys()):
                raise SystemExit(f"{path}:{n}: a line needs \"prompt\", \"turns\" or \"prompt_ids\"")
            rows.append(row)
    return rows


def _prepare(row: dict, llm, chat: bool):
    """-> (prompt for generate, prompt text for the output, keys used)."""
    if "prompt_ids" in row:
        ids = row["prompt_ids"]
        return ids, llm.tokenizer.decode(ids), {"prompt_ids"}
    if "prompt" in row:
        text, used = row["prompt"], {"prompt"}
    else:
        turns = row["turns"]
        if not turns or not isinstance(turns[0], str):
            raise SystemExit("a \"turns\" line needs at least one string turn")
        text, used = turns[0], {"turns"}
    prompt = llm.apply_chat_template([{"role": "user", "content": text}]) if chat else text
    return prompt, text, used


CONSTRAINT_KEYS = ("json_schema", "regex", "grammar", "choice")


def _read_text(path: str, what: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError as e:
        raise SystemExit(f"cannot read the {what} file {path}: {e}")


def _constraint_options(a) -> dict:
    """--json-schema FILE / --regex R / --grammar FILE / --choice A,B,C as SamplingParams fields."""
    if a.json_schema is not None:
        return {"json_schema": _read_text(a.json_schema, "JSON schema")}
    if a.regex is not None:
        return {"regex": a.regex}
    if a.grammar is not None:
        return {"grammar": _read_text(a.grammar, "grammar")}
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


def cmd_generate(a) -> int:
    from specjax import LLM, SamplingParams
    from specjax.sampling_params import SamplingParamsError
    if a.prompt is None and a.prompts is None:
        raise SystemExit("give --prompt TEXT or --prompts FILE.jsonl")
    rows = [{"prompt": a.prompt}] if a.prompt is not None else _read_prompts(a.prompts)
    base = dict(max_tokens=a.max_tokens, temperature=a.temperature, top_p=a.top_p, top_k=a.top_k, seed=a.seed)
    try:
        SamplingParams(**base, **_constraint_options(a))  # bad command-line options stop here
    except SamplingParamsError as e:
        raise SystemExit(str(e))
    # one parameter set per line: a line's bad constraint fails that line only (finish_reason "error")
    params = [dict(base, **(_line_constraint(r) or _constraint_options(a))) for r in rows]
    spec = None
    if a.speculate and a.draft is None:
        if a.model is not None:
            raise SystemExit("--speculate uses the EAGLE-3 head shipped for the default model; "
                             "with --model give --draft DIR")
        from specjax.default_model import DEFAULT_HEAD_DIR
        a.draft = str(DEFAULT_HEAD_DIR)
    if a.draft is not None:
        from specjax.llm import draft_method
        from specjax.tree import SpecConfig
        spec = SpecConfig(method=draft_method(a.draft), num_steps=a.num_steps, topk=a.topk, num_draft_tokens=a.num_draft_tokens)
    llm = LLM(a.model, dtype=a.dtype, max_batch=a.max_batch, max_seq_len=a.max_seq_len, draft=a.draft, spec=spec,
              tensor_parallel=a.tensor_parallel)
    chat = a.chat if a.chat is not None else bool(llm.tokenizer.chat_template)
    prepared = [_prepare(r, llm, chat) for r in rows]
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
                print(f"### {text}")
            print(o.text)
            if o.error is not None:
                print(f"[error: {o.error}]", file=sys.stderr)
            if o.accept_len_mean is not None:
                print(f"[mean acceptance length {o.accept_len_mean:.2f}]", file=sys.stderr)
    return 0


def cmd_convert(a) -> int:
    from specjax.convert import convert, convert_draft
    (convert_draft if a.draft else convert)(a.src, a.out, dtype=a.dtype)
    print(f"converted {a.src} -> {a.out}")
    return 0


def cmd_download_default(a) -> int:
    from specjax.default_model import download_default
    path = download_default(force=a.force)
    print(f"default model ready at {path}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="specjax", description="Speculative decoding for LLMs in JAX.")
    sub = p.add_subparsers(dest="cmd", required=True)

    g = sub.add_parser("generate", help="generate text")
    g.add_argument("--model", default=None, help="converted model dir (default: SmolLM2-135M-Instruct)")
    src = g.add_mutually_exclusive_group()
    src.add_argument("--prompt")
    src.add_argument("--prompts", help="JSONL: {\"prompt\"} | {\"turns\": [...]} | {\"prompt_ids\": [...]}; "
                     "optional per-line \"json_schema\" / \"regex\" / \"grammar\" / \"choice\"")
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    g.add_argument("--max-batch", type=int, default=8)
    g.add_argument("--max-seq-len", type=int, default=2048)
    mode = g.add_mutually_exclusive_group()
    mode.add_argument("--chat", dest="chat", action="store_true", default=None,
                      help="apply the chat template (default when the model has one)")
    mode.add_argument("--raw", dest="chat", action="store_false", help="use prompts as they are")
    g.add_argument("--output", help="write one JSON object per prompt to this JSONL file")
    g.add_argument("--draft", help="speculative decoding: a converted draft model dir, or 'self'")
    g.add_argument("--num-steps", type=int, default=4, help="tokens drafted per step")
    g.add_argument("--topk", type=int, default=1, help="draft tree branching (1 = chain)")
    g.add_argument("--num-draft-tokens", type=int, default=None)
    g.add_argument("--speculate", action="store_true",
                   help="speculative decoding with the EAGLE-3 head shipped for the default model")
    g.add_argument("--tensor-parallel", type=int, default=1,
                   help="shard the model (heads, MLP, vocabulary, KV heads) over N devices")
    con = g.add_mutually_exclusive_group()
    con.add_argument("--json-schema", metavar="FILE", help="constrain outputs to this JSON schema")
    con.add_argument("--regex", metavar="R", help="constrain outputs to this regular expression")
    con.add_argument("--grammar", metavar="FILE", help="constrain outputs to this EBNF grammar (rule root)")
    con.add_argument("--choice", metavar="A,B,C", help="the output is exactly one of these strings")
    g.set_defaults(fn=cmd_generate)

    c = sub.add_parser("convert", help="convert an HF folder or a .gguf file to a specjax checkpoint")
    c.add_argument("src")
    c.add_argument("out")
    c.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    c.add_argument("--draft", action="store_true",
                   help="SRC is an EAGLE-1 / EAGLE-3 draft head folder (config.json + weights)")
    c.set_defaults(fn=cmd_convert)

    d = sub.add_parser("download-default", help="fetch and convert SmolLM2-135M-Instruct")
    d.add_argument("--force", action="store_true")
    d.set_defaults(fn=cmd_download_default)

    from specjax import eval as spec_eval
    ev = sub.add_parser("eval", help="acceptance length and speed-up of speculative decoding over prompt sets")
    spec_eval.add_arguments(ev)
    ev.set_defaults(fn=spec_eval.cmd_eval)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"specjax: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
