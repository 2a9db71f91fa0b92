"""What this machine has and what JAX runs on.

    hardware (stdlib only, no JAX)        nvidia_gpus(), tpu_devices() -> accelerator(): cuda | tpu | cpu
    JAX's backend (imports jax)           backend_line(): "backend gpu (jax 0.11.2): 1 device: NVIDIA H100 ..."
    log_backend()                         that line once per process (logger "specjax", INFO) and a
                                          WARNING when an accelerator is present but JAX runs on the CPU
    resolve_dtype("auto")                 float32 on the CPU, bfloat16 on accelerators

`python -P specjax/machine.py` prints accelerator() (scripts/install.sh picks the JAX build with it);
the hardware half must therefore import nothing but the standard library.
"""
from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

log = logging.getLogger("specjax")

GOOGLE_PCI_VENDOR = "0x1ae0"
DTYPE_CHOICES = ("auto", "bfloat16", "float32")
ATTENTION_CHOICES = ("auto", "reference", "pallas", "mosaic_gpu", "tpu", "cudnn")  # specjax.attention's names
_logged = False


def nvidia_gpus() -> list[str]:
    """`nvidia-smi -L` lines ("GPU 0: NVIDIA H100 80GB HBM3 (UUID: ...)"); [] without a working nvidia-smi."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return []
    try:
        out = subprocess.run([exe, "-L"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return []
    if out.returncode != 0:
        return []
    return [line.strip() for line in out.stdout.splitlines() if line.startswith("GPU ")]


def _read(path: str) -> str:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return ""


def tpu_devices(root: str = "/") -> list[str]:
    """Cloud TPU chips of this VM: /dev/accel* whose PCI vendor is Google (TPU v2-v4), PCI processing
    accelerators (class 0x12....) from Google (vfio-bound TPUs: v5e, v5p, v6e; Google's network
    devices are class 0x02), or, where sysfs says nothing, /dev/accel* or /dev/vfio/<n> on a VM whose
    environment names a TPU (TPU_* variables). root: the file system root (tests)."""
    r = Path(root)
    found = [f"/dev/{d.name}" for d in sorted(r.glob("sys/class/accel/accel*"))
             if _read(f"{d}/device/vendor") == GOOGLE_PCI_VENDOR]
    found += [f"pci {d.name}" for d in sorted(r.glob("sys/bus/pci/devices/*"))
              if _read(f"{d}/vendor") == GOOGLE_PCI_VENDOR and _read(f"{d}/class").startswith("0x12")]
    if not found and any(k.startswith("TPU_") for k in os.environ):
        found = [f"/{p.relative_to(r)}" for p in sorted(r.glob("dev/accel*"))]
        found += [f"/{p.relative_to(r)}" for p in sorted(r.glob("dev/vfio/*")) if p.name.isdigit()]
    return found


def accelerator() -> str:
    """"cuda" where nvidia-smi lists a GPU, "tpu" on a Cloud TPU VM, else "cpu"."""
    if nvidia_gpus():
        return "cuda"
    if tpu_devices():
        return "tpu"
    return "cpu"


# ----------------------------------------------------------------------------- JAX's side

def backend_line() -> str:
    """One line: JAX's backend, its version and the devices (grouped by kind)."""
    import jax

    devices = jax.devices()
    kinds: dict[str, int] = {}
    for d in devices:
        kinds[d.device_kind] = kinds.get(d.device_kind, 0) + 1
    what = ", ".join(k if n == 1 else f"{n} x {k}" for k, n in kinds.items())
    n = len(devices)
    return f"backend {jax.default_backend()} (jax {jax.__version__}): {n} device{'s' if n != 1 else ''}: {what}"


def accelerator_warning() -> str | None:
    """Why JAX running on the CPU here is probably a mistake, or None."""
    import jax

    if jax.default_backend() != "cpu":
        return None
    gpus = nvidia_gpus()
    if gpus:
        return (f"an NVIDIA GPU is visible ({gpus[0]}) but JAX runs on the CPU: install the CUDA build of JAX "
                "(bash scripts/install.sh, or pip install -e \".[cuda12]\")")
    tpus = tpu_devices()
    if tpus:
        return (f"a TPU is visible ({tpus[0]}) but JAX runs on the CPU: install the TPU build of JAX "
                "(bash scripts/install.sh, or pip install -e \".[tpu]\")")
    return None


def log_backend(force: bool = False) -> None:
    """Log backend_line() (INFO) and accelerator_warning() (WARNING), once per process unless force."""
    global _logged
    if _logged and not force:
        return
    _logged = True
    log.info(backend_line())
    why = accelerator_warning()
    if why:
        log.warning("WARNING: %s", why)


def resolve_dtype(dtype: str) -> str:
    """"auto" -> "float32" on the CPU (several times faster there), "bfloat16" on GPUs and TPUs;
    "bfloat16" / "float32" as given."""
    if dtype not in DTYPE_CHOICES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPE_CHOICES)}, got {dtype!r}")
    if dtype != "auto":
        return dtype
    import jax
    return "float32" if jax.default_backend() == "cpu" else "bfloat16"


class _Stderr(logging.StreamHandler):
    """A handler that writes to the sys.stderr of the moment (so redirections made later still apply)."""

    def __init__(self):
        super().__init__(sys.stderr)

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, _value):
        pass


def console_logging() -> None:
    """Show the "specjax" logger's INFO lines on stderr as `specjax: ...` (the CLI calls this)."""
    if not any(isinstance(h, _Stderr) for h in log.handlers):
        h = _Stderr()
        h.setFormatter(logging.Formatter("specjax: %(message)s"))
        log.addHandler(h)
    log.setLevel(logging.INFO)


if __name__ == "__main__":  # scripts/install.sh: which JAX build this machine needs
    print(accelerator())
