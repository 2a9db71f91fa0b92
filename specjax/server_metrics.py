"""/metrics of `specjax serve` in the Prometheus text exposition format (version 0.0.4).

Engine figures come from AsyncLLM.stats (written by the engine thread after each step; KV pages,
prefix cache and prefill counters are the engine's own Engine.stats()); HTTP figures from the
server's own counters. tau (mean tokens per speculative step, the bonus token included) is over
finished requests. Ratios with nothing to measure yet (tau before a speculative step, the prefix-cache
hit rate before a lookup) are not exported: a made-up 0 would read as a measurement. With the prefix
cache off (--no-prefix-cache) specjax_prefix_cache_enabled is 0 and no prefix-cache series exist.
"""
from __future__ import annotations


def _family(lines: list[str], name: str, kind: str, help_text: str, samples) -> None:
    lines.append(f"# HELP {name} {help_text}")
    lines.append(f"# TYPE {name} {kind}")
    for labels, value in samples:
        label = ",".join(f'{k}="{v}"' for k, v in labels.items())
        lines.append(f"{name}{{{label}}} {value}" if label else f"{name} {value}")


def _ttft(out: list[str], s) -> None:
    """Time to first token as this process sees it (request received -> first token handed to the
    HTTP side; the HTTP transfer and the client are not in it), a histogram, and its phases."""
    from specjax.async_llm import TTFT_BUCKETS
    name = "specjax_time_to_first_token_seconds"
    out.append(f"# HELP {name} Time from a request's arrival in the engine API to its first token, in this process.")
    out.append(f"# TYPE {name} histogram")
    for le in TTFT_BUCKETS:
        out.append(f'{name}_bucket{{le="{le}"}} {s.ttft_hist[le]}')
    out.append(f'{name}_bucket{{le="+Inf"}} {s.ttft_count}')
    out.append(f"{name}_sum {sum(s.ttft_phase_s.values()):.6f}")
    out.append(f"{name}_count {s.ttft_count}")
    _family(out, "specjax_time_to_first_token_phase_seconds_total", "counter",
            "Time to first token by phase, summed over first tokens: prepare (validation, tokenization, "
            "constraint compile), pickup (queued until the engine thread takes it: a step was running), "
            "engine (taken until its first token: the running dispatch, the prefill, reading it).",
            [({"phase": p}, f"{s.ttft_phase_s[p]:.6f}") for p in ("prepare", "pickup", "engine")])


def _compiles(out: list[str], e: dict) -> None:
    """Compilations (specjax.compile_watch): one on the engine thread stalls every request."""
    _family(out, "specjax_compiled_programs", "gauge",
            "Executables held by the engine's programs (a new shape or steps per dispatch adds one; constant "
            "once warm).", [({}, e["compiled_programs"])])
    _family(out, "specjax_engine_thread_compilations_total", "counter",
            "XLA compilations on the engine thread (every request waits for each).", [({}, e["engine_thread_compiles"])])
    _family(out, "specjax_engine_thread_compile_seconds_total", "counter", "Seconds of those compilations.",
            [({}, f"{e['engine_thread_compile_s']:.6f}")])
    _family(out, "specjax_background_compilations_total", "counter",
            "Programs compiled on the engine's worker thread (adaptive steps per dispatch).",
            [({}, e["background_compiles"])])
    _family(out, "specjax_background_compile_seconds_total", "counter", "Seconds of those compilations.",
            [({}, f"{e['background_compile_s']:.6f}")])


def render_metrics(llm, state) -> str:
    """llm: specjax.async_llm.AsyncLLM; state: the server's counters (in_flight, responses, prompt_tokens)."""
    s = llm.stats
    out: list[str] = []
    _family(out, "specjax_engine_up", "gauge", "1 while the engine thread runs.", [({}, int(llm.error is None))])
    _family(out, "specjax_http_responses_total", "counter", "HTTP responses by route and status code.",
            [({"route": r, "code": c}, n) for (r, c), n in sorted(dict(state.responses).items())])
    _family(out, "specjax_requests_in_flight", "gauge", "Generation HTTP requests being answered.",
            [({}, state.in_flight)])
    _family(out, "specjax_requests_finished_total", "counter",
            "Engine requests (one per prompt and choice) finished, by finish reason.",
            [({"finish_reason": r}, n) for r, n in sorted(dict(s.finished).items())])
    _family(out, "specjax_prompt_tokens_total", "counter", "Prompt tokens of the requests submitted to the engine.",
            [({}, state.prompt_tokens)])
    _family(out, "specjax_generation_tokens_total", "counter", "Tokens generated.", [({}, s.generation_tokens)])
    _family(out, "specjax_engine_steps_total", "counter", "Engine steps run.", [({}, s.engine_steps)])
    _family(out, "specjax_requests_running", "gauge", "Requests holding an engine slot.", [({}, s.running)])
    _family(out, "specjax_requests_waiting", "gauge", "Requests queued for a slot (queue length).",
            [({}, s.waiting)])
    e = s.engine
    _family(out, "specjax_requests_prefilling", "gauge", "Requests whose prompt is being prefilled in chunks.",
            [({}, e["prefilling"])])
    _family(out, "specjax_kv_pages_used", "gauge",
            "KV cache pages held by requests (a page shared through the prefix cache counts once).",
            [({}, s.kv_pages_used)])
    _family(out, "specjax_kv_pages_total", "gauge", "KV cache pages that requests can hold.",
            [({}, s.kv_pages_total)])
    _family(out, "specjax_kv_pages_cached", "gauge",
            "KV cache pages no request holds, kept for prefix-cache reuse (free: evicted when needed).",
            [({}, e["pages_cached"])])
    _family(out, "specjax_prefill_tokens_total", "counter",
            "Tokens prefilled (prompts; prompt + output again after a preemption), not counting those whose KV "
            "came from the prefix cache.",
            [({}, e["prefill_tokens"])])
    _family(out, "specjax_preemptions_total", "counter", "Requests preempted (KV pages ran out; resumed later).",
            [({}, e["num_preempted"])])
    _family(out, "specjax_speculative", "gauge", "1 if the engine decodes speculatively.",
            [({}, int(llm.speculative))])
    if llm.speculative:
        _family(out, "specjax_spec_steps_total", "counter", "Speculative steps of finished requests.",
                [({}, s.spec_steps)])
        _family(out, "specjax_spec_tokens_total", "counter", "Tokens emitted by those steps.", [({}, s.spec_tokens)])
        if s.spec_steps:
            _family(out, "specjax_spec_tau", "gauge",
                    "Mean acceptance length: tokens per speculative step (bonus token included).",
                    [({}, f"{s.spec_tokens / s.spec_steps:.4f}")])
    _ttft(out, s)
    if "steps_per_call_cap" in e:  # an Engine's stats (tests may render a few counters only)
        kinds = ("decode", "spec", "lite", "lazy")
        _family(out, "specjax_decode_dispatches_total", "counter", "Decode dispatches (programs run) by kind.",
                [({"kind": k}, e[f"{k}_dispatches"]) for k in kinds])
        _family(out, "specjax_decode_dispatch_steps_total", "counter",
                "Steps those dispatches ran by kind (steps per dispatch = this / dispatches).",
                [({"kind": k}, e[f"{k}_dispatch_steps"]) for k in kinds])
        _family(out, "specjax_steps_per_dispatch_cap", "gauge",
                "Steps one decode dispatch may run now (adaptive: lower while the engine waits for the device).",
                [({}, e["steps_per_call_cap"])])
    if "compiled_programs" in e:
        _compiles(out, e)
    enabled = bool(e["prefix_cache"])
    _family(out, "specjax_prefix_cache_enabled", "gauge", "1 if prompt prefixes reuse cached KV pages.",
            [({}, int(enabled))])
    if enabled:
        for key, help_text in (
                ("queries", "Admissions that looked up their prompt's prefix."),
                ("hits", "Admissions that reused at least one cached page."),
                ("queried_tokens", "Tokens of the looked-up prompts."),
                ("hit_tokens", "Prompt tokens whose KV came from the prefix cache."),
                ("evictions", "Cached pages evicted to make room.")):
            _family(out, f"specjax_prefix_cache_{key}_total", "counter", help_text,
                    [({}, e[f"prefix_cache_{key}"])])
        if e["prefix_cache_queried_tokens"]:
            _family(out, "specjax_prefix_cache_hit_rate", "gauge",
                    "Prefix-cache hit rate: hit tokens / looked-up tokens.",
                    [({}, f"{e['prefix_cache_hit_rate']:.4f}")])
    return "\n".join(out) + "\n"
