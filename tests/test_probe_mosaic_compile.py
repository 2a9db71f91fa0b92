"""scripts/probe_mosaic_compile.py runs on the CPU, one process per count of call sites (the reference
attention here: the Mosaic interpreter's lowering is a different program from the GPU's and takes ~40 s)."""
from helpers import load_script


def test_probe_compiles_each_count_of_call_sites_in_its_own_process():
    rows = load_script("probe_mosaic_compile").main(["--sites", "1,3", "--impl", "reference"])
    assert [r["sites"] for r in rows] == [1, 3]
    assert all(r["impl"] == "reference" and r["compile_s"] > 0 and r["lower_s"] > 0 for r in rows)
    assert rows[1]["hlo_chars"] > rows[0]["hlo_chars"]  # two more attention calls
