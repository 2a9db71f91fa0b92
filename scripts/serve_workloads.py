"""Helpers of scripts/bench_serve.py: timed streaming requests, and the two workloads beyond its Poisson runs.

  one_request       one streaming chat request; the arrival time of each content chunk is recorded
  long_prompt_run   C streaming requests decode steadily; then one long prompt arrives. Inter-token
                    latency (ITL) of the C streams in a steady window before the arrival and in the
                    window from its send to its first token (+ a margin), and the long request's TTFT
  generate_ref      `LLM.generate` on the requests of a run, in a subprocess (this file as a script:
                    python scripts/serve_workloads.py SPEC.json; prints one JSON line)

Windows: a gap between two consecutive chunks of one stream belongs to the window that holds its end
(the chunk that arrived late), so a decode step stalled by a prefill counts where the stall is seen.
"""
from __future__ import annotations

import asyncio
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def child_env() -> dict:
    """The environment of a child process: this checkout first on PYTHONPATH, the caller's entries
    kept (packages installed on a PYTHONPATH, e.g. the server's, stay importable)."""
    old = os.environ.get("PYTHONPATH")
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO)] + ([old] if old else [])))


def pct(xs, q):
    """The q-th percentile (nearest rank) of xs; nan when empty."""
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, math.ceil(q / 100 * len(xs)) - 1))]


def window_gaps(streams, t0: float, t1: float) -> list[float]:
    """Gaps (ms) between consecutive chunk times of each stream whose later chunk arrived in [t0, t1)."""
    return [(b - a) * 1e3 for chunks in streams for a, b in zip(chunks, chunks[1:]) if t0 <= b < t1]


async def one_request(client, model, messages, a, rec: dict, max_tokens: int | None = None, stop=None):
    """max_tokens: default a.max_tokens (EOS ignored). stop: an asyncio.Event; once it is set, the
    stream is closed at its next chunk (the server cancels the request) and rec["stopped"] is True."""
    t0 = time.perf_counter()
    rec.update(sent=t0, chunks=[], tokens=0, prompt_tokens=None, error=None, stopped=False)
    try:
        stream = await client.chat.completions.create(
            model=model, messages=messages, max_tokens=max_tokens or a.max_tokens, temperature=a.temperature,
            stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        async for ch in stream:
            if ch.choices and ch.choices[0].delta.content:
                rec["chunks"].append(time.perf_counter())
            if ch.usage is not None:
                rec["tokens"] = ch.usage.completion_tokens
                rec["prompt_tokens"] = ch.usage.prompt_tokens
            if stop is not None and stop.is_set():
                rec["stopped"] = True
                await stream.close()
                break
    except Exception as e:  # noqa: BLE001 - counted as a failed request
        rec["error"] = f"{type(e).__name__}: {e}"


async def _until(cond, timeout: float, what: str):
    deadline = time.perf_counter() + timeout
    while not cond():
        if time.perf_counter() > deadline:
            raise TimeoutError(what)
        await asyncio.sleep(0.002)


async def long_prompt_run(server, a, background, long_conv) -> dict:
    """background: [(messages, max_tokens)] of the C = a.long_concurrency streams (max_tokens large:
    they are stopped once the measurement is over). Once all C stream, a.long_steady_s to settle, then
    the steady window of a.long_steady_s, then long_conv is sent with max_tokens a.long_max_tokens."""
    import openai
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                                timeout=a.request_timeout)
    stop = asyncio.Event()
    C, S = a.long_concurrency, a.long_steady_s
    bg = [{} for _ in range(C)]
    tasks = [asyncio.create_task(one_request(client, server.model, background[i % len(background)][0], a, bg[i],
                                             max_tokens=background[i % len(background)][1], stop=stop))
             for i in range(C)]
    lrec, ltask, t_end = {}, None, math.inf
    res = dict(concurrency=C, steady_s=S, failed=0, errors=[])
    try:
        await _until(lambda: all(r.get("chunks") or r.get("error") or t.done() for r, t in zip(bg, tasks)),
                     a.request_timeout, "background streams did not start")
        t_ready = time.perf_counter()
        if any(not r["chunks"] for r in bg):
            raise RuntimeError("a background stream ended before its first token")
        await asyncio.sleep(2 * S)
        ltask = asyncio.create_task(one_request(client, server.model, long_conv, a, lrec,
                                                max_tokens=a.long_max_tokens))
        await _until(lambda: lrec.get("chunks") or ltask.done(), a.request_timeout, "long prompt: no first token")
        if not lrec["chunks"]:
            raise RuntimeError(f"long prompt: no content ({lrec['error']})")
        t_send, t_first = lrec["sent"], lrec["chunks"][0]
        steady = window_gaps([r["chunks"] for r in bg], t_ready + S, t_send)
        margin = a.long_margin_ms / 1e3 if a.long_margin_ms is not None else 2 * pct(steady, 99) / 1e3
        t_end = t_first + margin
        await asyncio.sleep(max(0.0, t_end - time.perf_counter()))
        await asyncio.wait_for(ltask, a.request_timeout)
        during = window_gaps([r["chunks"] for r in bg], t_send, t_end)
        res.update(long_prompt_tokens=lrec["prompt_tokens"], long_ttft_ms=(t_first - t_send) * 1e3,
                   margin_ms=margin * 1e3, steady_gaps=len(steady), itl_steady_p50_ms=pct(steady, 50),
                   itl_steady_p99_ms=pct(steady, 99), during_gaps=len(during), itl_during_p50_ms=pct(during, 50),
                   itl_during_p99_ms=pct(during, 99))
        res["p99_ratio"] = res["itl_during_p99_ms"] / res["itl_steady_p99_ms"] if steady and during else None
    except (RuntimeError, TimeoutError, asyncio.TimeoutError) as e:
        res["errors"].append(f"{type(e).__name__}: {e}")
    finally:
        stop.set()
        await asyncio.wait_for(asyncio.gather(*tasks, *([ltask] if ltask else [])), a.request_timeout + 60)
        await client.close()
    # a stream that finished on its own before the windows closed (too few max_tokens) thins them out
    res["bg_ended_early"] = sum(not r["stopped"] and (not r["chunks"] or r["chunks"][-1] < t_end) for r in bg)
    errors = [r["error"] for r in bg + [lrec] if r.get("error")]
    res["failed"] = len(errors) + len(res["errors"])
    res["errors"] = (res["errors"] + sorted(set(errors)))[:3]
    return res


def generate_ref(a, mode: str, prefix_cache: bool | None, runs: dict) -> dict:
    """runs: {workload: [messages] of the run's requests}. LLM.generate with the server's settings
    (model, draft, dtype, max_batch, max_seq_len, prefix cache, max_prefill_tokens, prefill_chunk, steps per call), the same chat
    template, max_tokens, temperature and EOS ignored: call 1 compiles, call 2 is timed (call 3 instead
    if call 2 compiled anything). Returns {workload: {tok_s, seconds, tokens, first_s, timed_call,
    compiles, failed}} or {"error": ...}."""
    draft = None
    if mode == "spec":
        from specjax.assets import DEFAULT_HEAD_DIR
        draft = a.draft or (str(DEFAULT_HEAD_DIR) if a.model is None else None)  # as `specjax serve` decides
    spec = dict(model=a.model, draft=draft, dtype=a.dtype, max_batch=a.max_batch, max_seq_len=a.max_seq_len,
                prefix_cache=prefix_cache is not False, max_prefill_tokens=a.max_prefill_tokens,
                prefill_chunk=a.prefill_chunk, steps_per_call=a.steps_per_call,
                spec_steps_per_call=a.spec_steps_per_call,
                max_tokens=a.max_tokens, temperature=a.temperature, runs=runs)
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(spec, f)
    try:
        log = open(a.server_log, "a") if a.server_log else subprocess.DEVNULL
        out = subprocess.run([sys.executable, __file__, f.name], stdout=subprocess.PIPE, stderr=log, text=True,
                             cwd=REPO, env=child_env(), timeout=a.startup_timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"LLM.generate did not finish within {a.startup_timeout:.0f} s"}
    finally:
        os.unlink(f.name)
    lines = out.stdout.strip().splitlines()
    if out.returncode or not lines:
        return {"error": f"LLM.generate subprocess exited with {out.returncode} (its output: --server-log)"}
    return json.loads(lines[-1])


def _generate_ref_main(spec_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    import jax

    from specjax import LLM, SamplingParams
    compiles = [0]

    def on_event(name, *args, **kw):
        if name == "/jax/core/compile/backend_compile_duration":
            compiles[0] += 1

    jax.monitoring.register_event_duration_secs_listener(on_event)
    kw = {k: spec[k] for k in ("max_prefill_tokens", "prefill_chunk", "steps_per_call",
                                          "spec_steps_per_call") if spec.get(k) is not None}
    llm = LLM(spec["model"], dtype=spec["dtype"], max_batch=spec["max_batch"], max_seq_len=spec["max_seq_len"],
              draft=spec["draft"], prefix_cache=spec["prefix_cache"], **kw)
    params = SamplingParams(max_tokens=spec["max_tokens"], temperature=spec["temperature"], ignore_eos=True)
    out = {}
    for name, convs in spec["runs"].items():
        prompts = [llm.apply_chat_template(c) for c in convs]
        t = time.perf_counter()
        llm.generate(prompts, params)
        first = time.perf_counter() - t
        for call in (2, 3):  # call 2 is timed; call 3 only if call 2 compiled (e.g. prefill shapes of the
            c0 = compiles[0]  # prefix-cache hits that call 1 did not have)
            t = time.perf_counter()
            outs = llm.generate(prompts, params)
            s = time.perf_counter() - t
            if compiles[0] == c0:
                break
        n = sum(len(o.token_ids) for o in outs)
        out[name] = dict(tok_s=n / s, seconds=s, tokens=n, first_s=first, timed_call=call,
                         compiles=compiles[0] - c0, failed=sum(o.finish_reason == "error" for o in outs))
        print(f"[generate_ref] {name}: {n / s:.1f} tok/s (call 1 {first:.1f} s, timed call {call})",
              file=sys.stderr, flush=True)
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(_generate_ref_main(sys.argv[1]))
