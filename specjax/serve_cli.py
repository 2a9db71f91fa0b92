"""`specjax serve` command-line options and entry point (the server itself is specjax.server)."""
from __future__ import annotations

import argparse
import ipaddress
import os
import sys
import threading
from pathlib import Path


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="converted model dir (default: SmolLM2-135M-Instruct)")
    p.add_argument("--served-model-name", default=None,
                   help="the name clients give as \"model\" (default: the model directory's name)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to bind (default 127.0.0.1: this machine only; 0.0.0.0 exposes the server)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=os.environ.get("SPECJAX_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on every route but /health (default: $SPECJAX_API_KEY)")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    p.add_argument("--max-batch", type=int, default=8, help="requests decoded together (engine slots)")
    p.add_argument("--max-seq-len", type=int, default=2048, help="context: prompt + output tokens")
    p.add_argument("--num-pages", type=int, default=None,
                   help="KV cache pages (default: every slot can fill its context)")
    p.add_argument("--seed", type=int, default=0, help="seeds of requests that give none are drawn from this")
    p.add_argument("--tensor-parallel", type=int, default=1)
    spec = p.add_mutually_exclusive_group()
    spec.add_argument("--speculate", dest="speculate", action="store_true", default=None,
                      help="speculative decoding (default: on, with the EAGLE-3 head shipped for the default model)")
    spec.add_argument("--no-speculate", dest="speculate", action="store_false", help="plain decoding")
    p.add_argument("--draft", help="speculative decoding with this converted draft model / EAGLE head dir, or 'self'")
    p.add_argument("--num-steps", type=int, default=4, help="tokens drafted per step")
    p.add_argument("--topk", type=int, default=1, help="draft tree branching (1 = chain)")
    p.add_argument("--num-draft-tokens", type=int, default=None)
    lim = p.add_argument_group("limits")
    lim.add_argument("--max-body-bytes", type=int, default=1 << 20, help="larger request bodies get 413")
    lim.add_argument("--max-prompt-tokens", type=int, default=None, help="default: max-seq-len - 1")
    lim.add_argument("--max-tokens-limit", type=int, default=None,
                     help="the most max_tokens a request may ask for (default: max-seq-len)")
    lim.add_argument("--max-n", type=int, default=16, help="choices per request (n times the prompts)")
    lim.add_argument("--max-concurrent", type=int, default=256, help="generation requests in flight; more get 429")
    lim.add_argument("--grammar-timeout", type=float, default=10.0,
                     help="seconds one output constraint may take to compile before its request fails")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])


def resolve_draft(a) -> tuple[str | None, str]:
    """(draft for LLM, a line describing the decoding mode)."""
    if a.speculate is False:
        if a.draft is not None:
            raise SystemExit("--no-speculate and --draft contradict each other")
        return None, "plain decoding (--no-speculate)"
    if a.draft is not None:
        return a.draft, f"speculative, draft {a.draft}"
    if a.model is None:
        from specjax.default_model import DEFAULT_HEAD_DIR
        if not Path(DEFAULT_HEAD_DIR).is_dir():
            raise SystemExit(f"the shipped EAGLE-3 head is missing at {DEFAULT_HEAD_DIR}; give --draft DIR or "
                             "--no-speculate")
        return str(DEFAULT_HEAD_DIR), f"speculative, shipped EAGLE-3 head {DEFAULT_HEAD_DIR}"
    if a.speculate:
        raise SystemExit("--speculate uses the EAGLE-3 head shipped for the default model; with --model give "
                         "--draft DIR")
    return None, "plain decoding (no draft for --model: give --draft DIR to speculate)"


def _check_limits(a) -> None:
    for name in ("max_batch", "max_seq_len", "max_body_bytes", "max_n", "max_concurrent", "max_prompt_tokens",
                 "max_tokens_limit"):
        v = getattr(a, name)
        if v is not None and v < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1, got {v}")
    if not a.grammar_timeout > 0:
        raise SystemExit(f"--grammar-timeout must be > 0, got {a.grammar_timeout}")
    if not 0 <= a.port < 65536:
        raise SystemExit(f"--port must be in [0, 65535], got {a.port}")


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def cmd_serve(a) -> int:
    import uvicorn

    from specjax.async_llm import AsyncLLM
    from specjax.llm import LLM, draft_method
    from specjax.server import ServerConfig, build_app
    _check_limits(a)
    draft, mode = resolve_draft(a)
    spec = None
    if draft is not None:
        from specjax.tree import SpecConfig
        spec = SpecConfig(method=draft_method(draft), num_steps=a.num_steps, topk=a.topk,
                          num_draft_tokens=a.num_draft_tokens)
    if not _is_loopback(a.host) and a.api_key is None:
        print(f"specjax serve: warning: listening on {a.host} without --api-key: anyone who can reach it may use it",
              file=sys.stderr)
    llm = LLM(a.model, dtype=a.dtype, max_batch=a.max_batch, max_seq_len=a.max_seq_len, num_pages=a.num_pages,
              seed=a.seed, draft=draft, spec=spec, tensor_parallel=a.tensor_parallel)
    name = a.served_model_name or llm.model_dir.name
    engine = AsyncLLM(llm, grammar_timeout=a.grammar_timeout)
    threading.Thread(target=engine.start_grammar_worker, name="specjax-grammar-start", daemon=True).start()
    cfg = ServerConfig(model_name=name, api_key=a.api_key, max_body_bytes=a.max_body_bytes,
                       max_prompt_tokens=a.max_prompt_tokens, max_tokens=a.max_tokens_limit, max_n=a.max_n,
                       max_concurrent=a.max_concurrent)
    print(f"specjax serve: model {name!r} ({llm.model_dir}, {a.dtype}), {mode}; "
          f"OpenAI API at http://{a.host}:{a.port}/v1", file=sys.stderr, flush=True)

    stopped = threading.Event()

    def stop_engine():
        if not stopped.is_set():
            stopped.set()
            engine.shutdown()
            print("specjax serve: engine stopped", file=sys.stderr, flush=True)

    # uvicorn shuts down gracefully on SIGINT / SIGTERM (the app's shutdown hook stops the engine), then
    # re-raises the signal, so the process ends as the signal says
    try:
        uvicorn.run(build_app(engine, cfg, on_shutdown=stop_engine), host=a.host, port=a.port,
                    log_level=a.log_level, timeout_graceful_shutdown=5)
    finally:
        stop_engine()
    return 0
