"""scripts/probe_request_overhead.py: the two-length fit and its argument checks (the runs themselves
are GPU measurements)."""
import pytest

from helpers import load_script


def _load():
    return load_script("probe_request_overhead")


def test_fit_recovers_per_step_and_per_request_costs():
    mod = _load()
    n, per_step, per_req = 8, 1.13e-3, 12.5e-3
    short = dict(wall=n * per_req + 408 * per_step, steps=408)
    long = dict(wall=n * per_req + 716 * per_step, steps=716)
    s, r = mod.fit(n, short, long)
    assert s == pytest.approx(per_step) and r == pytest.approx(per_req)


def test_fit_and_arguments_refuse_what_cannot_be_fitted():
    mod = _load()
    with pytest.raises(SystemExit, match="no more steps"):
        mod.fit(4, dict(wall=1.0, steps=100), dict(wall=1.2, steps=100))
    with pytest.raises(SystemExit):
        mod.main(["--lengths", "256,128"])
    with pytest.raises(SystemExit):
        mod.main(["--lengths", "128"])
    with pytest.raises(SystemExit):
        mod.main(["--prompts", "0"])
    with pytest.raises(SystemExit):
        mod.main(["--admit-ahead", "sometimes"])
