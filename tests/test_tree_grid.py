"""scripts/tree_grid.py's timing: a generate call that compiled is repeated (with more requests
than slots, an identical call can be admitted in another order and compile prefill shapes of
prefix-cache hits), and a run where every call compiles is an error, not a figure. Its grid may
carry n-gram branches (a 4th field), kept in the spec_defaults entry it writes."""
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))

from tree_grid import _configs, _timed, best_entry, main, shape_name  # noqa: E402


class FakeLLM:
    """generate() returns outputs of 3 tokens each; the first `compiling` calls add a program."""

    def __init__(self, compiling: int):
        self.compiling, self.calls, self.programs = compiling, 0, 5
        self.engine = SimpleNamespace(num_compiled=lambda: self.programs)

    def generate(self, ids, params):
        self.calls += 1
        if self.calls <= self.compiling:
            self.programs += 1
        return [SimpleNamespace(token_ids=[1, 2, 3], accept_len_mean=2.0) for _ in ids]


def test_timed_repeats_until_nothing_compiles(capsys):
    llm = FakeLLM(compiling=2)
    tps, tau, n = _timed(llm, [[0], [1]], None, tries=3)
    assert llm.calls == 3 and n == 6 and tau == 2.0 and tps > 0
    assert capsys.readouterr().out.count("compiled 1 program(s)") == 2
    llm = FakeLLM(compiling=0)
    _timed(llm, [[0]], None)
    assert llm.calls == 1
    with pytest.raises(RuntimeError, match="every one of 3 identical calls compiled"):
        _timed(FakeLLM(compiling=5), [[0]], None, tries=3)


def test_request_count_whole_waves():
    from tree_grid import request_count
    assert request_count(12, 1) == 12 and request_count(12, 8) == 16 and request_count(12, 32) == 32
    assert request_count(64, 32) == 64 and request_count(65, 32) == 96


def test_plot_writes_a_png(tmp_path):
    from tree_grid import plot
    rows = [{"batch": B, "num_steps": s, "topk": k, "num_draft_tokens": n, "tau": 2.0 + s / 10, "speedup": sp}
            for B, sp0 in ((1, 1.3), (32, 0.7)) for (s, k, n), sp in zip([(4, 1, 4), (5, 4, 16)], (sp0, sp0 - 0.1))]
    plot(rows, str(tmp_path / "g.png"))
    assert (tmp_path / "g.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"



def test_configs_with_an_ngram_branch(capsys):
    assert _configs("5:4:16,7:4:24:7") == [(5, 4, 16, 0), (7, 4, 24, 7)]
    row = {"num_steps": 7, "topk": 4, "num_draft_tokens": 24, "ngram_branch": 7, "tok_s": 3.0, "plain_tok_s": 1.0}
    assert best_entry(row) == {"num_steps": 7, "topk": 4, "num_draft_tokens": 24, "ngram_branch": 7}
    assert shape_name(row) == "7/4/24+7"
    row["ngram_branch"] = 0
    assert best_entry(row) == {"num_steps": 7, "topk": 4, "num_draft_tokens": 24} and shape_name(row) == "7/4/24"
    with pytest.raises(SystemExit):
        main(["--draft", "d", "--configs", "5:4"])
    assert "'5:4' is not num_steps:topk:num_draft_tokens[:ngram_branch]" in capsys.readouterr().err
