"""What the Mosaic GPU kernels share: the lazy import of the Mosaic GPU Pallas module and the parameters
of its CPU interpreter."""
from __future__ import annotations


def plgpu():
    """jax.experimental.pallas.mosaic_gpu, imported when a kernel is built (GPU-only code path)."""
    import jax.experimental.pallas.mosaic_gpu as mod
    return mod


def interpreter_available() -> bool:
    """Whether this jax has the Mosaic GPU interpreter (kernels run with interpret=True on the CPU)."""
    try:
        import jax.experimental.pallas.mosaic_gpu  # noqa: F401
        from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams  # noqa: F401
    except ImportError:
        return False
    return True


def interpret_params(kernel: str):
    """The interpreter's parameters for `kernel(interpret=True)`; a ValueError naming the kernel where this
    jax has no interpreter."""
    try:
        from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
    except ImportError as e:  # pragma: no cover - depends on the jax version
        raise ValueError(f"{kernel}(interpret=True) needs the Mosaic GPU interpreter "
                         "(jax._src.pallas.mosaic_gpu.interpret), missing in this jax") from e
    return InterpretGPUParams()
