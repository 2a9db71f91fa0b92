"""specjax as a package: a wheel built from this source tree, installed into a fresh virtual
environment and run outside the repository, finds its shipped EAGLE-3 head and prompt sets (package
data) and keeps the default model in SPECJAX_HOME.

The venv sees the heavy dependencies through --system-site-packages and gets the wheel with
--no-deps, so nothing is downloaded; the default model is linked into SPECJAX_HOME (converted once
by ensure_default)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from specjax.assets import PROMPT_SETS
from specjax.default_model import ensure_default

REPO = Path(__file__).resolve().parent.parent
SOURCES = ("pyproject.toml", "README.md", "specjax", "pallas_kernels")


def run(cmd, **kw):
    out = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=300, **kw)
    assert out.returncode == 0, f"{cmd} failed ({out.returncode}):\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """A wheel built from a copy of the sources (the checkout stays clean: no build/ or egg-info)."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    src.mkdir()
    for name in SOURCES:
        p = REPO / name
        if p.is_dir():
            shutil.copytree(p, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
        else:
            shutil.copy2(p, src / name)
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", tmp / "dist", src])
    (whl,) = (tmp / "dist").glob("specjax-*.whl")
    return whl


def test_wheel_holds_the_package_data(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    head = "specjax/assets/eagle3-smollm2-135m/"
    shipped = {str(p.relative_to(REPO)) for p in (REPO / head).rglob("*") if p.is_file()}
    assert shipped and shipped <= names  # every file of the head, the orbax checkpoint's included
    assert {f"specjax/assets/prompts/{s}.jsonl" for s in PROMPT_SETS} <= names
    assert "specjax/cli.py" in names and "pallas_kernels/kv_compact.py" in names


def test_fresh_venv_generate_outside_the_repo(wheel, tmp_path):
    model = ensure_default().resolve()
    venv, home, work = tmp_path / "venv", tmp_path / "home", tmp_path / "work"
    run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", venv])  # pip: this one's
    py = venv / "bin" / "python"
    run([sys.executable, "-m", "pip", "--python", py, "install", "--no-deps", "--no-index", wheel])
    home.mkdir()
    work.mkdir()
    (home / "smollm2-135m-instruct").symlink_to(model, target_is_directory=True)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env["SPECJAX_HOME"] = str(home)

    probe = run([py, "-c", "import json, sysconfig, specjax, specjax.assets as A, specjax.default_model as D; "
                 "print(json.dumps({'pkg': specjax.__file__, 'head': str(D.DEFAULT_HEAD_DIR), "
                 "'model': str(D.DEFAULT_MODEL_DIR), 'sets': {s: str(A.prompt_file(s)) for s in A.PROMPT_SETS}, "
                 "'site': sysconfig.get_path('purelib')}))"], cwd=work, env=env)
    where = json.loads(probe.stdout)
    site = Path(where["site"])
    assert Path(where["pkg"]).is_relative_to(site)  # the wheel's copy, not the checkout's
    assert Path(where["head"]).is_relative_to(site) and (Path(where["head"]) / "specjax.json").is_file()
    assert where["model"] == str(home / "smollm2-135m-instruct")
    assert all(Path(f).is_relative_to(site) and Path(f).stat().st_size > 0 for f in where["sets"].values())

    # a speculative generate with the shipped head over two shipped gsm8k prompts
    lines = Path(where["sets"]["gsm8k"]).read_text().splitlines()[:2]
    (work / "in.jsonl").write_text("\n".join(lines) + "\n")
    gen = run([venv / "bin" / "specjax", "generate", "--speculate", "--prompts", "in.jsonl", "--output", "out.jsonl",
               "--max-tokens", "12", "--max-seq-len", "256", "--max-batch", "2", "--temperature", "0"],
              cwd=work, env=env)
    assert gen.stderr.startswith("specjax: backend ")  # the backend line comes first
    outs = [json.loads(x) for x in (work / "out.jsonl").read_text().splitlines()]
    assert len(outs) == 2
    assert all(o["finish_reason"] in ("stop", "length") and o["token_ids"] and o["text"] for o in outs)
    assert sum(o["accept_len_mean"] for o in outs) / 2 > 1.0  # the head's drafts are accepted
    assert not (site / "checkpoints").exists()  # nothing written under site-packages
