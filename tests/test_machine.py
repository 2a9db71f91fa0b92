"""specjax.machine: accelerator detection (install.sh relies on it), the backend line every command
logs, the warning when a GPU / TPU is present but JAX runs on the CPU, and dtype "auto"."""
from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from specjax import machine

REPO = Path(__file__).resolve().parent.parent
H100 = "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-0123)"


def fake_nvidia_smi(tmp_path, monkeypatch, out: str, rc: int = 0) -> None:
    """Put an `nvidia-smi` first on PATH that prints `out` for `-L` and exits with rc."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    exe = bin_dir / "nvidia-smi"
    exe.write_text(f"#!/bin/sh\necho '{out}'\nexit {rc}\n")
    exe.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")


def test_nvidia_detection(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no nvidia-smi at all
    assert machine.nvidia_gpus() == []
    fake_nvidia_smi(tmp_path, monkeypatch, H100)
    assert machine.nvidia_gpus() == [H100] and machine.accelerator() == "cuda"


def test_failing_nvidia_smi_is_no_gpu(tmp_path, monkeypatch):
    """nvidia-smi installed but failing (driver not loaded): no GPU, no warning."""
    fake_nvidia_smi(tmp_path, monkeypatch, "NVIDIA-SMI has failed", rc=9)
    assert machine.nvidia_gpus() == []
    assert machine.accelerator_warning() is None


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n")


def test_tpu_detection(tmp_path, monkeypatch):
    for k in [k for k in os.environ if k.startswith("TPU_")]:
        monkeypatch.delenv(k)
    root = tmp_path / "root"
    pci = root / "sys/bus/pci/devices"
    _write(pci / "0000:00:04.0/vendor", "0x1ae0")  # Google's gVNIC network card: not a TPU
    _write(pci / "0000:00:04.0/class", "0x020000")
    _write(pci / "0000:00:05.0/vendor", "0x8086")
    _write(pci / "0000:00:05.0/class", "0x120000")  # someone else's accelerator
    (root / "dev/vfio").mkdir(parents=True)
    (root / "dev/vfio/0").touch()
    assert machine.tpu_devices(str(root)) == []  # a vfio device alone says nothing
    monkeypatch.setenv("TPU_ACCELERATOR_TYPE", "v5litepod-1")
    assert machine.tpu_devices(str(root)) == ["/dev/vfio/0"]  # ... with a TPU environment it does
    monkeypatch.delenv("TPU_ACCELERATOR_TYPE")
    _write(pci / "0000:00:06.0/vendor", "0x1ae0")  # a vfio-bound TPU chip (v5e / v5p / v6e)
    _write(pci / "0000:00:06.0/class", "0x120000")
    assert machine.tpu_devices(str(root)) == ["pci 0000:00:06.0"]
    _write(root / "sys/class/accel/accel0/device/vendor", "0x1ae0")  # TPU v4: /dev/accel0
    assert machine.tpu_devices(str(root)) == ["/dev/accel0", "pci 0000:00:06.0"]


def test_install_script_detection(tmp_path, monkeypatch):
    """scripts/install.sh runs `python -P specjax/machine.py` before anything is installed: it must
    work with the standard library alone and print the accelerator."""
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}

    def detect():
        out = subprocess.run([sys.executable, "-P", "-S", str(REPO / "specjax/machine.py")], env=env,
                             capture_output=True, text=True, cwd=tmp_path, timeout=60)
        assert out.returncode == 0, out.stderr
        return out.stdout.strip()

    assert detect() == machine.accelerator()
    fake_nvidia_smi(tmp_path, monkeypatch, H100)
    env["PATH"] = os.environ["PATH"]
    assert detect() == "cuda"


def test_backend_line():
    line = machine.backend_line()
    n = len(jax.devices())
    assert line.startswith(f"backend {jax.default_backend()} (jax {jax.__version__}): {n} device")
    assert jax.devices()[0].device_kind in line


def test_log_backend_warns_when_a_gpu_is_idle(tmp_path, monkeypatch, caplog):
    """On the CPU backend with an NVIDIA GPU visible: the backend line (INFO) and a WARNING."""
    if jax.default_backend() != "cpu":
        pytest.skip("JAX runs on an accelerator here: the CPU-only warning cannot apply")
    fake_nvidia_smi(tmp_path, monkeypatch, H100)
    with caplog.at_level(logging.INFO, logger="specjax"):
        machine.log_backend(force=True)
    recs = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "specjax"]
    assert recs[0] == (logging.INFO, machine.backend_line())
    assert recs[1][0] == logging.WARNING
    assert "NVIDIA GPU is visible" in recs[1][1] and H100 in recs[1][1] and "JAX runs on the CPU" in recs[1][1]
    caplog.clear()
    monkeypatch.setenv("PATH", str(tmp_path))  # no GPU: the line only
    with caplog.at_level(logging.INFO, logger="specjax"):
        machine.log_backend(force=True)
        machine.log_backend()  # once per process unless forced
    assert [r.levelno for r in caplog.records if r.name == "specjax"] == [logging.INFO]


def test_dtype_auto(tmp_path):
    want = "float32" if jax.default_backend() == "cpu" else "bfloat16"
    assert machine.resolve_dtype("auto") == want
    assert machine.resolve_dtype("bfloat16") == "bfloat16" and machine.resolve_dtype("float32") == "float32"
    with pytest.raises(ValueError, match="dtype must be one of auto, bfloat16, float32"):
        machine.resolve_dtype("float16")
    # LLM: auto is the default and decides the parameters' and the cache's dtype
    sys.path.insert(0, str(Path(__file__).parent))
    from tiny_dir import make_tiny_model_dir

    from specjax import LLM
    d = make_tiny_model_dir(tmp_path / "tiny", num_layers=2)
    llm = LLM(d, max_batch=1, max_seq_len=32)
    assert llm.dtype == want
    assert {x.dtype for x in jax.tree.leaves(llm.engine.state.cache.kv)} == {jnp.dtype(want)}
    # the CLI and its --help default to auto
    from specjax.cli import build_parser
    a = build_parser().parse_args(["generate", "--prompt", "x"])
    assert a.dtype == "auto"
