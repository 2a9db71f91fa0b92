"""Pure helpers of scripts/bench_serve.py (scripts/serve_workloads.py): percentiles and ITL windows."""
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))

from serve_workloads import pct, window_gaps  # noqa: E402


def test_pct_nearest_rank():
    xs = list(range(1, 101))  # 1 .. 100
    assert pct(xs, 50) == 50 and pct(xs, 99) == 99 and pct(xs, 100) == 100 and pct(xs, 0) == 1
    assert pct([3.0, 1.0, 2.0], 50) == 2.0  # unsorted input
    assert pct([7.0], 99) == 7.0
    assert math.isnan(pct([], 50))


def test_window_gaps_by_the_later_chunk():
    streams = [[0.0, 0.1, 0.2, 0.5, 0.6], [0.05, 0.45, 0.55]]
    # gaps ending in [0.2, 0.5): stream 0: 0.1 -> 0.2; stream 1: 0.05 -> 0.45 (started before the window)
    assert [round(g) for g in window_gaps(streams, 0.2, 0.5)] == [100, 400]
    # the end is exclusive, the start inclusive: 0.2 -> 0.5 ends at 0.5
    assert [round(g) for g in window_gaps(streams, 0.5, 0.6)] == [300, 100]
    assert window_gaps(streams, 1.0, 2.0) == [] and window_gaps([[], [0.3]], 0.0, 1.0) == []


def test_steps_per_dispatch_from_metrics():
    """bench_serve's mean steps per dispatch: /metrics deltas summed over the dispatch kinds."""
    from bench_serve import steps_per_dispatch
    d, s = "specjax_decode_dispatches_total", "specjax_decode_dispatch_steps_total"
    m0 = {f'{d}{{kind="decode"}}': 10, f'{s}{{kind="decode"}}': 80}
    m1 = {f'{d}{{kind="decode"}}': 20, f'{s}{{kind="decode"}}': 100, f'{d}{{kind="spec"}}': 5,
          f'{s}{{kind="spec"}}': 10}
    assert steps_per_dispatch(m0, m1) == {"steps_per_dispatch": 30 / 15}
    assert steps_per_dispatch(m1, m1) == {}


def test_compiles_from_metrics():
    """bench_serve's compilations during a run: /metrics deltas; none from a server without the series."""
    from bench_serve import compiled_text, compiles
    m0 = {"specjax_compiled_programs": 12, "specjax_engine_thread_compilations_total": 30,
          "specjax_engine_thread_compile_seconds_total": 50.0, "specjax_background_compilations_total": 1}
    m1 = {"specjax_compiled_programs": 15, "specjax_engine_thread_compilations_total": 32,
          "specjax_engine_thread_compile_seconds_total": 54.5, "specjax_background_compilations_total": 2}
    c = compiles(m0, m1)
    assert c == dict(programs_compiled=3, engine_thread_compiles=2, engine_thread_compile_s=4.5, background_compiles=1)
    assert compiled_text(c) == "3 programs (engine thread: 2 XLA, 4.5 s; background 1)"
    assert compiles({}, {"specjax_engine_steps_total": 5}) == {}
