"""`specjax serve` command-line options and entry point (the server itself is specjax.server)."""
from __future__ import annotations

import argparse
import ipaddress
import os
import sys
import threading
from pathlib import Path


def add_arguments(p: argparse.ArgumentParser) -> None:
    from specjax.cli import add_model_arguments, positive_int
    add_model_arguments(p)  # --model --dtype --max-batch --max-seq-len --tensor-parallel --speculate --draft ...
    p.add_argument("--no-speculate", action="store_true",
                   help="plain decoding (default: speculative with the EAGLE-3 head shipped for the default model)")
    p.add_argument("--served-model-name", default=None, metavar="NAME",
                   help="the name clients give as \"model\" (default: the model directory's name)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to bind (127.0.0.1: this machine only; 0.0.0.0 exposes the server)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=os.environ.get("SPECJAX_API_KEY"), metavar="KEY",
                   help="require 'Authorization: Bearer KEY' on every route but /health (default: $SPECJAX_API_KEY)")
    p.add_argument("--num-pages", type=positive_int, default=None,
                   help="KV cache pages (default: every slot can fill its context)")
    p.add_argument("--no-adaptive-steps", dest="adaptive_steps", action="store_false",
                   help="keep --steps-per-call / --spec-steps-per-call fixed (default: they halve, to a quarter, "
                        "while the engine waits for the device, so a new request waits less for the running "
                        "dispatches, and grow back when the host is busy; same outputs)")
    p.add_argument("--seed", type=int, default=0, help="seeds of requests that give none are drawn from this")
    lim = p.add_argument_group("limits")
    lim.add_argument("--max-body-bytes", type=positive_int, default=1 << 20, help="larger request bodies get 413")
    lim.add_argument("--max-prompt-tokens", type=positive_int, default=None,
                     help="longer prompts get 400 (default: --max-seq-len - 1)")
    lim.add_argument("--max-tokens-limit", type=positive_int, default=None,
                     help="the most max_tokens a request may ask for (default: --max-seq-len)")
    lim.add_argument("--max-n", type=positive_int, default=16, help="choices per request (n times the prompts)")
    lim.add_argument("--max-concurrent", type=positive_int, default=256,
                     help="generation requests in flight; more get 429")
    lim.add_argument("--grammar-timeout", type=float, default=10.0,
                     help="seconds one output constraint may take to compile before its request fails")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    mh = p.add_argument_group("multi-host (one process per host; process 0 serves HTTP, see README)")
    mh.add_argument("--coordinator", default=os.environ.get("SPECJAX_COORDINATOR"), metavar="HOST:PORT",
                    help="address of process 0's jax.distributed coordinator, the same on every process "
                         "(default: $SPECJAX_COORDINATOR; unset: one process)")
    mh.add_argument("--num-processes", type=positive_int, default=_env_int("SPECJAX_NUM_PROCESSES"), metavar="N",
                    help="processes in the job (default: $SPECJAX_NUM_PROCESSES)")
    mh.add_argument("--process-id", type=int, default=_env_int("SPECJAX_PROCESS_ID"), metavar="I",
                    help="this process, 0 .. N-1; 0 takes the requests (default: $SPECJAX_PROCESS_ID)")


def _env_int(name: str) -> int | None:
    v = os.environ.get(name)
    return int(v) if v not in (None, "") and v.strip().lstrip("-").isdigit() else None


def resolve_speculation(a) -> str:
    """Speculation on by default (the shipped head for the default model); sets a.draft / a.spec
    (cli.check_model_arguments) and returns a line describing the decoding mode."""
    from specjax.assets import DEFAULT_HEAD_DIR
    from specjax.cli import UsageError, check_model_arguments
    plain = None
    if a.no_speculate:
        if a.draft is not None or a.speculate:
            raise UsageError("--no-speculate contradicts --speculate / --draft")
        plain = "plain decoding (--no-speculate)"
    elif a.draft is None and not a.speculate:
        if a.model is None:
            a.speculate = "head"
        else:
            plain = "plain decoding (no draft for --model: give --draft DIR or --speculate ngram to speculate)"
    check_model_arguments(a)
    if plain is not None:
        return plain
    if a.draft == "ngram":
        return "speculative, n-gram drafter (prompt lookup)"
    if Path(a.draft) == Path(DEFAULT_HEAD_DIR):
        return f"speculative, shipped EAGLE-3 head {a.draft}"
    return f"speculative, draft {a.draft}"


def _check_limits(a) -> None:
    from specjax.cli import UsageError
    if not a.grammar_timeout > 0:
        raise UsageError(f"--grammar-timeout must be > 0, got {a.grammar_timeout}")
    if not 0 <= a.port < 65536:
        raise UsageError(f"--port must be in [0, 65535], got {a.port}")
    given = [f for f, v in (("--coordinator", a.coordinator), ("--num-processes", a.num_processes),
                            ("--process-id", a.process_id)) if v is not None]
    if given and len(given) < 3:
        raise UsageError(f"multi-host needs --coordinator, --num-processes and --process-id together "
                         f"(or $SPECJAX_COORDINATOR / _NUM_PROCESSES / _PROCESS_ID); got only {', '.join(given)}")
    if given and not 0 <= a.process_id < a.num_processes:
        raise UsageError(f"--process-id must be in [0, {a.num_processes - 1}], got {a.process_id}")


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def cmd_serve(a) -> int:
    from specjax.cli import UsageError, llm_from_args
    from specjax.machine import log_backend
    try:  # argparse-style (usage, exit 2) also under `python -m specjax.cli`, whose UsageError is __main__'s
        _check_limits(a)
        mode = resolve_speculation(a)
    except UsageError as e:
        a.parser.error(str(e))
    if a.coordinator is not None:  # before anything else touches JAX
        from specjax import multihost
        multihost.initialize(a.coordinator, a.num_processes, a.process_id)
    log_backend()
    if a.process_id:
        return _follow(a, mode)
    import uvicorn

    from specjax.async_llm import AsyncLLM
    from specjax.server import ServerConfig, build_app
    if not _is_loopback(a.host) and a.api_key is None:
        print(f"specjax serve: warning: listening on {a.host} without --api-key: anyone who can reach it may use it",
              file=sys.stderr)
    llm = llm_from_args(a, num_pages=a.num_pages, seed=a.seed, adaptive_steps=a.adaptive_steps)
    name = a.served_model_name or llm.model_dir.name
    engine = AsyncLLM(llm, grammar_timeout=a.grammar_timeout)
    threading.Thread(target=engine.start_grammar_worker, name="specjax-grammar-start", daemon=True).start()
    cfg = ServerConfig(model_name=name, api_key=a.api_key, max_body_bytes=a.max_body_bytes,
                       max_prompt_tokens=a.max_prompt_tokens, max_tokens=a.max_tokens_limit, max_n=a.max_n,
                       max_concurrent=a.max_concurrent)
    print(f"specjax serve: model {name!r} ({llm.model_dir}, {llm.dtype}), {mode}; "
          f"OpenAI API at http://{a.host}:{a.port}/v1", file=sys.stderr, flush=True)

    stopped = threading.Event()

    def stop_engine():
        if not stopped.is_set():
            stopped.set()
            engine.shutdown()
            llm.close()  # multi-host: the other processes stop following
            print("specjax serve: engine stopped", file=sys.stderr, flush=True)
            if a.coordinator is not None:  # now, not at exit: uvicorn ends the process by re-raising the signal
                from specjax import multihost
                multihost.shutdown()

    # uvicorn shuts down gracefully on SIGINT / SIGTERM (the app's shutdown hook stops the engine), then
    # re-raises the signal, so the process ends as the signal says
    try:
        uvicorn.run(build_app(engine, cfg, on_shutdown=stop_engine), host=a.host, port=a.port,
                    log_level=a.log_level, timeout_graceful_shutdown=5)
    finally:
        stop_engine()
    return 0


def _follow(a, mode: str) -> int:
    """A process other than 0: the same LLM, running process 0's requests until process 0 stops."""
    from specjax.cli import llm_from_args
    llm = llm_from_args(a, num_pages=a.num_pages, seed=a.seed, adaptive_steps=a.adaptive_steps)
    print(f"specjax serve: process {a.process_id} of {a.num_processes}: model {llm.model_dir} ({llm.dtype}), {mode}; "
          f"following process 0 (which answers the requests)", file=sys.stderr, flush=True)
    llm.follow()
    print(f"specjax serve: process {a.process_id}: process 0 stopped; exiting", file=sys.stderr, flush=True)
    from specjax import multihost
    multihost.shutdown()
    return 0
