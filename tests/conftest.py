"""Session setup: 8 host (CPU) devices, so that sharding tests can build meshes on a CPU-only machine;
the persistent compilation cache off.

Must run before the JAX backend initialises (pytest imports conftest before the test modules).
Everything that does not ask for a mesh keeps running on the default device, jax.devices()[0].
An explicit device count from the environment (JAX_NUM_CPU_DEVICES or the XLA flag) wins.
"""
from __future__ import annotations

import os
import warnings

NUM_CPU_DEVICES = 8
_FLAG = "--xla_force_host_platform_device_count"

# Tests compile from scratch (hermetic, and no test writes to the user's cache): the persistent
# compilation cache is off unless the environment says otherwise; tests/test_compile_cache.py
# turns it on in its own processes.
os.environ.setdefault("SPECJAX_COMPILE_CACHE", "off")

_user_set = "JAX_NUM_CPU_DEVICES" in os.environ or _FLAG in os.environ.get("XLA_FLAGS", "")

import jax  # noqa: E402 - after reading the environment, before any backend exists

if not _user_set:
    try:
        jax.config.update("jax_num_cpu_devices", NUM_CPU_DEVICES)
    except AttributeError:  # older jax without the option: the XLA flag, read when the backend starts
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_FLAG}={NUM_CPU_DEVICES}".strip()
    except RuntimeError as e:  # a backend already exists: multi-device tests will skip
        warnings.warn(f"could not set {NUM_CPU_DEVICES} CPU devices: {e}", stacklevel=1)
