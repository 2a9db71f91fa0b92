"""Serving benchmark: Poisson arrivals against the real `specjax serve` (a subprocess on 127.0.0.1).

For each decoding mode (plain: --no-speculate; spec: speculation with the shipped head or --draft), the
server is started, warmed up (every prompt-length bucket and batch size compiled), then for each
workload (with / without a shared system prompt of --system-prompt-tokens tokens) and each request rate,
--num-requests streaming chat requests arrive with exponential gaps (rate "inf": all at once).
Reported per run:
  throughput   output tokens / s and requests / s over the run (first send to last token)
  TTFT         send -> first streamed content (p50 / p99, ms)
  ITL          gaps between consecutive streamed content chunks (p50 / p99, ms); a speculative step
               delivers several tokens in one chunk, so also
  TPOT         (last token - first token) / (output tokens - 1) per request (p50, ms)
  tau, prefix hit rate   from the server's /metrics over the run (tokens per speculative step;
               prompt tokens reused from the prefix cache / prompt tokens looked up)
  compiled     from /metrics over the run: new executables of the engine's programs, and XLA
               compilations on the engine thread (count, seconds: every request waits for them) and
               on its background worker (adaptive steps); a warm server compiles nothing in a run
Prefix cache: when `specjax serve --help` offers --no-prefix-cache, runs are made with the cache on and
off; otherwise the server has no prefix cache, and the script says so and makes one run per workload.

Two serving goals get their own measurements (helpers in scripts/serve_workloads.py):
  long prompt  (goal: p99 ITL while a --long-prompt-tokens prompt arrives <= 2x the steady p99; 0: skip)
               per mode, with the first prefix-cache setting: --long-concurrency streaming requests (short
               eval-set prompts, as many output tokens as the context holds) decode; once all stream,
               --long-steady-s to settle, then a steady window of --long-steady-s, then one request of
               N prompt tokens (the system prompt's filler, tagged so that no cached prefix serves it)
               and --long-max-tokens output tokens arrives. Reported: ITL p50 / p99 of the background
               streams in the steady window and from the long request's send to its first token plus a
               margin (--long-margin-ms, default 2x the steady p99), p99 during / steady, the long
               request's TTFT, and the prefill chunk budget (--max-prefill-tokens; the server's default
               unless given: prompts longer than it are prefilled in chunks between decode steps).
               Run once discarded (compiles the long prefill), then measured. --max-seq-len defaults to
               2048, or enough for N + --long-max-tokens (a multiple of 1024) when that is more.
  saturation   (goal: server tok/s at rate inf >= 90 % of LLM.generate's on the same requests) after each
               server stops (its accelerator memory free), a subprocess runs specjax.LLM(...).generate
               with the server's settings (model, draft or none, dtype, max_batch, max_seq_len, prefix
               cache, max_prefill_tokens) on the rate-inf run's requests (chat template, --max-tokens, EOS
               ignored): call 1 compiles, call 2 is timed (call 3 if call 2 compiled anything: the table
               says so); server tok/s / generate tok/s is reported.
               --no-generate-ref skips it.

CPU smoke run (tiny):
  python scripts/bench_serve.py --dtype float32 --modes plain --num-requests 4 --rates 2,inf --max-tokens 8 \\
      --system-prompt-tokens 100 --max-seq-len 512 --max-batch 4 --long-prompt-tokens 300 --long-concurrency 2
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import re
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from serve_workloads import child_env, generate_ref, long_prompt_run, one_request, pct

REPO = Path(__file__).resolve().parent.parent
FILLER = ("The archive keeps records of every voyage: the ship, its crew, the ports it reached, the cargo it "
          "carried and the weather it met. Answer questions about the archive briefly and precisely. ")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="converted model dir (default: the default model)")
    p.add_argument("--draft", default=None, help="draft for the spec mode (default: the shipped EAGLE-3 head)")
    p.add_argument("--modes", default="plain,spec", help="comma-separated: plain, spec")
    p.add_argument("--rates", default="1,4,16,inf", help="requests per second, comma-separated ('inf': all at once)")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=128, help="output tokens per request (EOS ignored)")
    p.add_argument("--system-prompt-tokens", type=int, default=1000, help="length of the shared system prompt")
    p.add_argument("--shared-prefix", choices=["both", "on", "off"], default="both")
    p.add_argument("--prefix-cache", choices=["both", "on", "off"], default="both")
    p.add_argument("--prompts", default=None, help="JSONL prompt set (default: the shipped mt_bench set)")
    p.add_argument("--dtype", choices=["auto", "bfloat16", "float32"], default="auto",
                   help="auto: float32 on the CPU, bfloat16 on GPUs")
    p.add_argument("--max-batch", type=int, default=32)
    p.add_argument("--max-seq-len", type=int, default=None,
                   help="default: 2048, or more to fit --long-prompt-tokens + --long-max-tokens")
    p.add_argument("--max-prefill-tokens", type=int, default=None,
                   help="tokens of one prefill call of the server (default: `specjax serve`'s)")
    p.add_argument("--prefill-chunk", type=int, default=None,
                   help="the server's longest piece of one prompt per prefill call (default: `specjax serve`'s)")
    p.add_argument("--steps-per-call", type=int, default=None,
                   help="the server's plain decoding steps per dispatch (default: `specjax serve`'s)")
    p.add_argument("--spec-steps-per-call", type=int, default=None,
                   help="the server's fused speculative steps per dispatch (default: `specjax serve`'s)")
    p.add_argument("--long-prompt-tokens", type=int, default=4000,
                   help="the long prompt's tokens (0: no long-prompt run)")
    p.add_argument("--long-concurrency", type=int, default=16, help="streams decoding while the long prompt arrives")
    p.add_argument("--long-max-tokens", type=int, default=8, help="output tokens of the long request")
    p.add_argument("--long-steady-s", type=float, default=1.0, help="settling time, then the steady window's length")
    p.add_argument("--long-margin-ms", type=float, default=None,
                   help="the arrival window ends this long after the long request's first token "
                        "(default: 2x the steady ITL p99)")
    p.add_argument("--no-generate-ref", action="store_true", help="no LLM.generate reference for the rate-inf runs")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--startup-timeout", type=float, default=1800.0)
    p.add_argument("--request-timeout", type=float, default=900.0)
    p.add_argument("--json", help="write the results here")
    p.add_argument("--server-log", default=None, help="append the servers' output here (default: discarded)")
    return p.parse_args(argv)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str, timeout: float = 10.0) -> tuple[int, str]:
    with urllib.request.urlopen(url, timeout=timeout) as r:  # noqa: S310 - 127.0.0.1 only
        return r.status, r.read().decode()


def serve_help() -> str:
    out = subprocess.run([sys.executable, "-m", "specjax.cli", "serve", "--help"], capture_output=True, text=True,
                         cwd=REPO, env=child_env(), timeout=300)
    return " ".join(out.stdout.split())


def default_prefill_budget(help_text: str) -> int | None:
    """`specjax serve`'s default --max-prefill-tokens, from its --help (None: no such flag)."""
    m = re.search(r"--max-prefill-tokens MAX_PREFILL_TOKENS (?:(?!--).)*?\(default: (\d+)\)", help_text)
    return int(m.group(1)) if m else None


def default_prefill_chunk(help_text: str) -> int | None:
    """`specjax serve`'s default --prefill-chunk, from its --help (None: no such flag)."""
    m = re.search(r"--prefill-chunk PREFILL_CHUNK (?:(?!--).)*?\(default: (\d+)\)", help_text)
    return int(m.group(1)) if m else None


class Server:
    def __init__(self, a, mode: str, prefix_cache: bool | None):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "specjax.cli", "serve", "--port", str(self.port), "--dtype", a.dtype,
               "--max-batch", str(a.max_batch), "--max-seq-len", str(a.max_seq_len), "--log-level", "warning",
               "--max-concurrent", str(max(256, a.num_requests * 2))]
        if a.model:
            cmd += ["--model", a.model]
        if mode == "plain":
            cmd += ["--no-speculate"]
        elif a.draft:
            cmd += ["--draft", a.draft]
        if prefix_cache is False:
            cmd += ["--no-prefix-cache"]
        if a.max_prefill_tokens is not None:
            cmd += ["--max-prefill-tokens", str(a.max_prefill_tokens)]
        for flag in ("prefill_chunk", "steps_per_call", "spec_steps_per_call"):
            if getattr(a, flag) is not None:
                cmd += ["--" + flag.replace("_", "-"), str(getattr(a, flag))]
        log = open(a.server_log, "a") if a.server_log else subprocess.DEVNULL
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO,
                                     env=child_env())
        deadline = time.monotonic() + a.startup_timeout
        while True:
            if self.proc.poll() is not None:
                raise SystemExit(f"specjax serve exited with {self.proc.returncode} ({' '.join(cmd)})")
            try:
                if _get(self.url + "/health")[0] == 200:
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise SystemExit(f"specjax serve did not start within {a.startup_timeout:.0f} s")
            time.sleep(0.5)
        self.model = json.loads(_get(self.url + "/v1/models")[1])["data"][0]["id"]

    def metrics(self) -> dict[str, float]:
        text = _get(self.url + "/metrics")[1]
        return {ln.split(" ")[0]: float(ln.split(" ")[1]) for ln in text.splitlines() if ln and ln[0] != "#"}

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(30)


def system_prompt(tokenizer, n: int) -> str:
    ids = tokenizer.encode(FILLER * (n // 20 + 2), add_special_tokens=False)[:n]
    return tokenizer.decode(ids)


def prompt_len(tokenizer, conv) -> int:
    """Tokens of a conversation's prompt as the server builds it (the chat template)."""
    return len(tokenizer.encode(tokenizer.apply_chat_template(conv, tokenize=False, add_generation_prompt=True),
                                add_special_tokens=False))


def long_prompt(tokenizer, n: int, tag: str) -> list[dict]:
    """A user message whose prompt has about n tokens: a tag (prompts of different tags share no cached
    prefix past the template's own) and the system prompt's filler."""
    head = f"Request {tag}: "
    return [{"role": "user", "content": head + system_prompt(tokenizer, max(0, n - prompt_len(
        tokenizer, [{"role": "user", "content": head}])))}]


def load_questions(path: str) -> list[str]:
    out = []
    with open(path) as f:
        for line in f:
            if line.strip():
                row = json.loads(line)
                out.append(row["turns"][0] if "turns" in row else row.get("prompt") or row["question"])
    return out


async def run_load(server, a, convs, rate: float) -> dict:
    import openai
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                                timeout=a.request_timeout)
    rng = random.Random(a.seed)
    recs = [{} for _ in range(a.num_requests)]
    tasks = []
    t_start = time.perf_counter()
    for i in range(a.num_requests):
        tasks.append(asyncio.create_task(one_request(client, server.model, convs[i % len(convs)], a, recs[i])))
        if math.isfinite(rate) and i + 1 < a.num_requests:
            await asyncio.sleep(rng.expovariate(rate))
    await asyncio.wait_for(asyncio.gather(*tasks), a.request_timeout + 60)
    await client.close()
    return summarize(recs, t_start)


def summarize(recs, t_start) -> dict:
    ok = [r for r in recs if r["error"] is None and r["chunks"]]
    end = max((r["chunks"][-1] for r in ok), default=t_start)
    dur = max(end - t_start, 1e-9)
    ttft = [(r["chunks"][0] - r["sent"]) * 1e3 for r in ok]
    itl = [(b - a) * 1e3 for r in ok for a, b in zip(r["chunks"], r["chunks"][1:])]
    tpot = [(r["chunks"][-1] - r["chunks"][0]) * 1e3 / (r["tokens"] - 1) for r in ok if r["tokens"] > 1]
    tokens = sum(r["tokens"] for r in ok)
    errors = sorted({r["error"] for r in recs if r["error"]})
    return dict(completed=len(ok), failed=len(recs) - len(ok), errors=errors[:3], duration_s=dur,
                req_per_s=len(ok) / dur, out_tok_per_s=tokens / dur, ttft_p50_ms=pct(ttft, 50),
                ttft_p99_ms=pct(ttft, 99), ttft_mean_ms=sum(ttft) / len(ttft) if ttft else math.nan, itl_p50_ms=pct(itl, 50), itl_p99_ms=pct(itl, 99),
                tpot_p50_ms=pct(tpot, 50))


async def warm_up(server, a, workloads):
    """Compile what the runs will use: 1, 2, 4 .. max_batch concurrent requests of each workload, then
    one discarded all-at-once run over the prompts the runs send."""
    import openai
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                                timeout=a.request_timeout)
    for convs in workloads.values():
        n = 1
        while True:
            recs = [{} for _ in range(n)]
            await asyncio.gather(*(one_request(client, server.model, convs[i % len(convs)], a, recs[i])
                                   for i in range(n)))
            bad = [r["error"] for r in recs if r["error"]]
            if bad:
                raise SystemExit(f"warm-up request failed: {bad[0]}")
            if n >= min(a.max_batch, a.num_requests):
                break
            n = min(2 * n, a.max_batch, a.num_requests)
    await client.close()
    for convs in workloads.values():
        res = await run_load(server, a, convs, float("inf"))
        if res["failed"]:
            raise SystemExit(f"warm-up run failed: {res['errors']}")


def add_generate_ref(a, mode, cache, inf_runs, workloads) -> None:
    """LLM.generate on the requests of the rate-inf runs (after their server stopped): tok/s, server / it."""
    print(f"[bench_serve] LLM.generate on the rate-inf requests ({mode}, prefix cache {inf_runs[0]['prefix_cache']})",
          flush=True)
    ref = generate_ref(a, mode, cache, {r["workload"]: [workloads[r["workload"]][i % len(workloads[r["workload"]])]
                                                         for i in range(a.num_requests)] for r in inf_runs})
    for r in inf_runs:
        g = ref.get(r["workload"], {})
        r.update(generate_tok_per_s=g.get("tok_s"), generate_timed_call=g.get("timed_call"),
                 generate_error=ref.get("error") or (f"{g['failed']} failed" if g.get("failed") else None),
                 server_over_generate=r["out_tok_per_s"] / g["tok_s"] if g.get("tok_s") else None)
        print(f"[bench_serve] {mode} | {r['workload']} | rate inf: server {r['out_tok_per_s']:.1f} tok/s, "
              f"LLM.generate {g.get('tok_s', math.nan):.1f} tok/s" + (f" ({r['generate_error']})"
                                                                       if r["generate_error"] else ""), flush=True)


def main(argv=None) -> int:
    a = parse_args(argv)
    sys.path.insert(0, str(REPO))
    from specjax.checkpoint import load_tokenizer
    from specjax.default_model import ensure_default
    tokenizer = load_tokenizer(a.model or ensure_default())
    rates = [float(r) for r in a.rates.split(",")]
    from specjax.assets import prompt_file
    questions = load_questions(a.prompts or prompt_file("mt_bench"))
    system = system_prompt(tokenizer, a.system_prompt_tokens)
    workloads = {}
    if a.shared_prefix in ("both", "off"):
        workloads["no shared prefix"] = [[{"role": "user", "content": q}] for q in questions]
    if a.shared_prefix in ("both", "on"):
        workloads[f"shared {a.system_prompt_tokens}-token system prompt"] = [
            [{"role": "system", "content": system}, {"role": "user", "content": q}] for q in questions]
    need = a.long_prompt_tokens + a.long_max_tokens + 16 if a.long_prompt_tokens > 0 else 0
    if a.max_seq_len is None:
        a.max_seq_len = max(2048, -(-need // 1024) * 1024)
    elif need > a.max_seq_len:
        raise SystemExit(f"--long-prompt-tokens {a.long_prompt_tokens} + --long-max-tokens {a.long_max_tokens} "
                         f"need --max-seq-len >= {need}")
    if a.long_prompt_tokens > 0 and a.max_batch <= a.long_concurrency:
        raise SystemExit(f"--long-concurrency {a.long_concurrency} needs --max-batch >= {a.long_concurrency + 1} "
                         "(a free slot for the long prompt)")
    # the long-prompt run's background: the plain questions, generating as long as the context allows
    background = [(c, a.max_seq_len - n - 1) for c in ([{"role": "user", "content": q}] for q in questions)
                  if (n := prompt_len(tokenizer, c)) + 64 < a.max_seq_len]
    if a.long_prompt_tokens > 0 and not background:
        raise SystemExit(f"no prompt leaves 64 tokens to generate in --max-seq-len {a.max_seq_len}")
    for name, convs in workloads.items():  # room for max_tokens in the context
        fits = [c for c in convs if a.max_tokens + prompt_len(tokenizer, c) < a.max_seq_len]
        if not fits:
            raise SystemExit(f"no prompt of {name!r} leaves {a.max_tokens} tokens in --max-seq-len {a.max_seq_len}")
        workloads[name] = fits
    help_text = serve_help()
    budget = a.max_prefill_tokens or default_prefill_budget(help_text)
    piece = a.prefill_chunk or default_prefill_chunk(help_text) or budget
    if "--no-prefix-cache" in help_text:
        caches = {"both": [True, False], "on": [True], "off": [False]}[a.prefix_cache]
    else:
        caches = [None]
        print("[bench_serve] prefix cache: `specjax serve` has no prefix cache (no --no-prefix-cache flag); "
              "every run is without one, and --prefix-cache is a no-op", flush=True)
    results, long_results = [], []
    for mode in a.modes.split(","):
        for cache in caches:
            label = {None: "n/a (none)", True: "on", False: "off"}[cache]
            print(f"[bench_serve] starting specjax serve ({mode}, prefix cache {label})", flush=True)
            server = Server(a, mode, cache)
            try:
                t0, w0 = time.perf_counter(), server.metrics()
                asyncio.run(warm_up(server, a, workloads))
                c = compiles(w0, server.metrics())
                print(f"[bench_serve] warm-up {time.perf_counter() - t0:.0f} s" + (
                      f"; compiled: {compiled_text(c)}" if c else ""), flush=True)
                for wname, convs in workloads.items():
                    for rate in rates:
                        m0 = server.metrics()
                        res = asyncio.run(run_load(server, a, convs, rate))
                        m1 = server.metrics()
                        steps = m1.get("specjax_spec_steps_total", 0) - m0.get("specjax_spec_steps_total", 0)
                        toks = m1.get("specjax_spec_tokens_total", 0) - m0.get("specjax_spec_tokens_total", 0)
                        looked = (m1.get("specjax_prefix_cache_queried_tokens_total", 0)
                                  - m0.get("specjax_prefix_cache_queried_tokens_total", 0))
                        reused = (m1.get("specjax_prefix_cache_hit_tokens_total", 0)
                                  - m0.get("specjax_prefix_cache_hit_tokens_total", 0))
                        res.update(mode=mode, prefix_cache=label, workload=wname, rate=rate,
                                   tau=toks / steps if steps else None,
                                   prefix_hit_rate=reused / looked if looked else None, **server_ttft(m0, m1),
                                   **compiles(m0, m1))
                        results.append(res)
                        print(f"[bench_serve] {mode} | {wname} | rate {rate:g}: {res['out_tok_per_s']:.1f} tok/s, "
                              f"TTFT p50 {res['ttft_p50_ms']:.0f} ms, ITL p99 {res['itl_p99_ms']:.0f} ms"
                              + (f", compiled during the run: {compiled_text(res)}" if "programs_compiled" in res else "")
                              + (f", {res['failed']} failed: {res['errors']}" if res["failed"] else ""), flush=True)
                if a.long_prompt_tokens > 0 and cache == caches[0]:
                    for i in range(2):  # the first run compiles the long prefill: discarded
                        res = asyncio.run(long_prompt_run(server, a, background,
                                                          long_prompt(tokenizer, a.long_prompt_tokens, str(i))))
                    res.update(mode=mode, prefix_cache=label, prefill_budget=budget,
                               prefill_chunk=max(16, min(budget, piece, a.max_seq_len)) if budget else None)  # Scheduler.chunk
                    long_results.append(res)
                    print(f"[bench_serve] {mode} | long prompt: {res.get('long_prompt_tokens')} tokens, ITL p99 "
                          f"steady {res.get('itl_steady_p99_ms', math.nan):.1f} ms, during "
                          f"{res.get('itl_during_p99_ms', math.nan):.1f} ms"
                          + (f", {res['failed']} failed: {res['errors']}" if res["failed"] else ""), flush=True)
            finally:
                server.stop()
            inf_runs = [r for r in results if (r["mode"], r["prefix_cache"], r["rate"]) == (mode, label, math.inf)]
            if inf_runs and not a.no_generate_ref:
                add_generate_ref(a, mode, cache, inf_runs, workloads)
    print_table(results, a)
    print_goals(results, long_results, a)
    if a.json:
        Path(a.json).write_text(json.dumps(dict(args=vars(a), results=results, long_prompt=long_results), indent=1))
    return 0 if all(r["failed"] == 0 for r in results + long_results) else 1


def server_ttft(m0: dict, m1: dict) -> dict:
    """The server's own mean time to first token over a run and its phases (ms; /metrics deltas):
    what the client's TTFT spends outside the server is the difference."""
    name = "specjax_time_to_first_token"
    n = m1.get(f"{name}_seconds_count", 0) - m0.get(f"{name}_seconds_count", 0)
    if not n:
        return {}
    out = {"server_ttft_mean_ms": (m1[f"{name}_seconds_sum"] - m0.get(f"{name}_seconds_sum", 0)) * 1e3 / n}
    for p in ("prepare", "pickup", "engine"):
        key = f'{name}_phase_seconds_total{{phase="{p}"}}'
        out[f"server_ttft_{p}_ms"] = (m1.get(key, 0) - m0.get(key, 0)) * 1e3 / n
    return {**out, **steps_per_dispatch(m0, m1)}


def steps_per_dispatch(m0: dict, m1: dict) -> dict:
    """Mean decode steps per dispatch over a run (all kinds; /metrics deltas): with adaptive steps
    (`specjax serve`'s default) it shows where the cap ran, e.g. low at light load, high at saturation."""
    keys = [k for k in m1 if k.startswith("specjax_decode_dispatches_total")]
    n = sum(m1[k] - m0.get(k, 0) for k in keys)
    steps = sum(m1[k.replace("dispatches_total", "dispatch_steps_total")]
                - m0.get(k.replace("dispatches_total", "dispatch_steps_total"), 0) for k in keys)
    return {"steps_per_dispatch": steps / n} if n else {}


def compiles(m0: dict, m1: dict) -> dict:
    """Compilations between two /metrics readings (a server without the counters: {}):
    programs_compiled (new executables of the engine's programs), engine_thread_compiles / _s (XLA
    compilations on the engine thread: stalls), background_compiles (its worker: adaptive steps)."""
    if "specjax_compiled_programs" not in m1:
        return {}

    def delta(name):
        return m1.get(name, 0) - m0.get(name, 0)
    return dict(programs_compiled=int(delta("specjax_compiled_programs")),
                engine_thread_compiles=int(delta("specjax_engine_thread_compilations_total")),
                engine_thread_compile_s=delta("specjax_engine_thread_compile_seconds_total"),
                background_compiles=int(delta("specjax_background_compilations_total")))


def compiled_text(c: dict) -> str:
    """'3 programs (engine thread: 2 XLA, 4.1 s; background 1)'."""
    return (f"{c['programs_compiled']} programs (engine thread: {c['engine_thread_compiles']} XLA, "
            f"{c['engine_thread_compile_s']:.1f} s; background {c['background_compiles']})")


def print_table(results, a) -> None:
    print(f"\n{a.num_requests} requests x {a.max_tokens} output tokens, {a.dtype}, max_batch {a.max_batch}, "
          f"max_seq_len {a.max_seq_len}\n")
    print("| mode | prefix cache | workload | rate (req/s) | done | req/s | out tok/s | TTFT p50 / p99 (ms) "
          "| ITL p50 / p99 (ms) | TPOT p50 (ms) | tau | prefix hit rate | compiled in run: programs / engine "
          "thread XLA (s) / background |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        tau = "" if r["tau"] is None else f"{r['tau']:.2f}"
        hit = "" if r["prefix_hit_rate"] is None else f"{r['prefix_hit_rate']:.0%}"
        comp = (f"{r['programs_compiled']} / {r['engine_thread_compiles']} ({r['engine_thread_compile_s']:.1f}) / "
                f"{r['background_compiles']}" if "programs_compiled" in r else "")
        print(f"| {r['mode']} | {r['prefix_cache']} | {r['workload']} | {r['rate']:g} | {r['completed']} | "
              f"{r['req_per_s']:.2f} | {r['out_tok_per_s']:.1f} | {r['ttft_p50_ms']:.0f} / {r['ttft_p99_ms']:.0f} | "
              f"{r['itl_p50_ms']:.1f} / {r['itl_p99_ms']:.1f} | {r['tpot_p50_ms']:.1f} | {tau} | {hit} | {comp} |")
    rows = [r for r in results if "server_ttft_mean_ms" in r]
    if rows:
        print("\nTime to first token inside the server (mean ms, from /metrics; the rest of the client's TTFT is "
              "HTTP and the client)\n")
        print("| mode | prefix cache | rate | client TTFT mean | server TTFT mean | prepare | pickup | engine "
              "| steps / dispatch |")
        print("|---|---|---|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['mode']} | {r['prefix_cache']} | {r['rate']:g} | {r.get('ttft_mean_ms', math.nan):.1f} | "
                  f"{r['server_ttft_mean_ms']:.1f} | {r['server_ttft_prepare_ms']:.1f} | "
                  f"{r['server_ttft_pickup_ms']:.1f} | {r['server_ttft_engine_ms']:.1f} | "
                  f"{r.get('steps_per_dispatch', math.nan):.2f} |")


def print_goals(results, long_results, a) -> None:
    sat = [r for r in results if "generate_tok_per_s" in r]
    if sat:
        print("\nSaturation (rate inf) vs LLM.generate on the same requests (goal: server / generate >= 0.90)\n")
        print("| mode | prefix cache | workload | server out tok/s | LLM.generate tok/s | server / generate |")
        print("|---|---|---|---|---|---|")
        for r in sat:
            g = "" if r["generate_tok_per_s"] is None else f"{r['generate_tok_per_s']:.1f}" + (
                f" (call {r['generate_timed_call']})" if r["generate_timed_call"] != 2 else "")
            ratio = (f"{r['server_over_generate']:.2f}" if r["server_over_generate"] is not None
                     else r["generate_error"] or "")
            print(f"| {r['mode']} | {r['prefix_cache']} | {r['workload']} | {r['out_tok_per_s']:.1f} | {g} | {ratio} |")
    if long_results:
        print(f"\nLong prompt arriving during {a.long_concurrency} streams (goal: ITL p99 during <= 2x steady)\n")
        print("| mode | prefix cache | prompt tokens | prefill budget / chunk | ITL p50 / p99 steady (ms) "
              "| ITL p50 / p99 during (ms) | p99 during / steady | long TTFT (ms) | gaps steady / during "
              "| margin (ms) |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        for r in long_results:
            if "itl_during_p99_ms" not in r:
                print(f"| {r['mode']} | {r['prefix_cache']} | failed: {'; '.join(r['errors'])} |||||||")
                continue
            ratio = "" if r["p99_ratio"] is None else f"{r['p99_ratio']:.2f}"
            note = f" ({r['bg_ended_early']} streams ended early)" if r["bg_ended_early"] else ""
            print(f"| {r['mode']} | {r['prefix_cache']} | {r['long_prompt_tokens']} | {r['prefill_budget']} / "
                  f"{r['prefill_chunk']} | "
                  f"{r['itl_steady_p50_ms']:.1f} / {r['itl_steady_p99_ms']:.1f} | {r['itl_during_p50_ms']:.1f} / "
                  f"{r['itl_during_p99_ms']:.1f} | {ratio}{note} | {r['long_ttft_ms']:.0f} | {r['steady_gaps']} / "
                  f"{r['during_gaps']} | {r['margin_ms']:.0f} |")


if __name__ == "__main__":
    sys.exit(main())
