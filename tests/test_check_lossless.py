"""scripts/check_lossless.py on the CPU: its one-device-slot variant and its program trace leave greedy tokens
equal to plain decoding's; the trace records the slot state after each program call (the GPU is where it is needed)."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from helpers import IdTokenizer, load_script, tiny_config, tiny_model
from specjax.drafter import DraftInfo
from specjax.engine import BatchOptions, CacheOptions, Draft, Engine
from specjax.request import Request
from specjax.sampling_params import SamplingParams
from specjax.scheduler import SchedulerOptions
from specjax.tree import SpecConfig

PARAMS = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
LENS = (5, 9)


def _engine(spec=True, **opts):
    cfg = tiny_config()
    target = tiny_model(cfg, seed=0)
    d = Draft(target, cfg, DraftInfo("draft"), SpecConfig(method="draft", num_steps=3, topk=2, num_draft_tokens=6))
    return Engine(target, cfg, CacheOptions(page_size=4, max_seq_len=64), BatchOptions(max_batch=1), jnp.float32,
                  draft=d if spec else None, sched=SchedulerOptions(handover=False, unread=1, **opts))


def _run(eng):
    rng = np.random.default_rng(3)
    reqs = [Request(i, None, [int(t) for t in rng.integers(0, 96, size=n)], PARAMS, IdTokenizer(), (96,), 64, 0)
            for i, n in enumerate(LENS)]
    eng.run(reqs)
    return [r.output().token_ids for r in reqs]


def test_first_diffs():
    mod = load_script("check_lossless")
    assert mod.first_diffs([[1, 2, 3], [4, 5], [6, 7]], [[1, 2, 3], [4, 9], [6, 7, 8]]) == [None, 1, 2]


def test_one_device_slot_and_trace_keep_plain_tokens():
    mod = load_script("check_lossless")
    plain = _run(_engine(spec=False))
    with mod.one_device_slot():
        one = _engine()
    assert one.state.cache.seq_lens.shape == (1,) and one.num_slots == 1 and not one.handover
    assert _engine().state.cache.seq_lens.shape == (2,)  # the spare device slot again after the block
    assert _run(one) == plain
    eng, log = _engine(async_loop=False), []
    mod.trace_programs(eng, log)
    assert _run(eng) == plain
    prefills = [r for r in log if r["call"] == "prefill"]
    assert [p["seq_lens"][0] for p in prefills] == list(LENS)  # the prompt's K/V after each prefill
    assert [p["tokens"] for p in prefills] == [[t[0]] for t in plain]
    assert any(r["call"].startswith("step K=") for r in log) and all(len(r["tree"][0]) <= 8 for r in log)


def test_unknown_variant_is_refused(capsys):
    mod = load_script("check_lossless")
    with pytest.raises(SystemExit):
        mod.main(["--model", "x", "--variants", "old,bogus"])
    assert "unknown variant(s) ['bogus']" in capsys.readouterr().err
