"""scripts/repro_one_slot.py on the CPU: a speculative engine of one row without hand-over decodes plain's greedy
tokens with a device state of one slot and of two (the GPU is where one slot went wrong: sessions 44-45)."""
from __future__ import annotations

import pytest

from helpers import load_script


def test_one_and_two_device_slots_equal_plain(tmp_path):
    mod = load_script("repro_one_slot")
    res = mod.main(["--hidden", "32", "--vocab", "128", "--max-tokens", "12", "--json", str(tmp_path / "r.json")])
    assert sorted(res["states"]) == [1, 2]
    assert all(len(t) == 12 for t in res["plain"])
    for s in res["states"].values():
        assert s["tokens"] == res["plain"] and s["match"] and s["first_diff"] == [None, None]
    assert (tmp_path / "r.json").stat().st_size > 0


def test_bad_tree_is_refused(capsys):
    mod = load_script("repro_one_slot")
    with pytest.raises(SystemExit) as e:
        mod.main(["--tree", "3x2"])
    assert e.value.code == 2
    assert "--tree takes depth/topk/tokens" in capsys.readouterr().err
