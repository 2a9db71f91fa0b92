"""Data parallelism for EAGLE-3 training: one process, the first n local devices.

    params, optimizer state, embed, target, t2d   replicated on every device
    batch [B, T] (B = n x per-device batch)        split over the 1-D mesh axis "data"

The training step is the one-device program under jit: its loss is a mean over the global batch,
so XLA's partitioner sums the per-device gradients (an all-reduce) and every device applies the
same update. With one device the placement is that device itself (the program of one GPU).
Mesh axes are AxisType.Auto (sharding propagation), not the Explicit default of jax.make_mesh.
"""
from __future__ import annotations

import dataclasses

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec, SingleDeviceSharding

AXIS = "data"


@dataclasses.dataclass(frozen=True)
class DataParallel:
    """Where training arrays live (hashable: part of the jitted programs' cache keys)."""
    replicated: jax.sharding.Sharding  # params, optimizer state, target, packed rows
    batch: jax.sharding.Sharding  # a global batch, split on its leading axis
    num_devices: int

    @classmethod
    def over(cls, n: int | None = None) -> DataParallel:
        """The first n local devices (None or 0: all of them)."""
        devices = jax.local_devices()
        n = n or len(devices)
        if not 1 <= n <= len(devices):
            raise ValueError(f"{n} devices asked for, {len(devices)} available ({devices[0].platform})")
        if n == 1:
            one = SingleDeviceSharding(devices[0])
            return cls(one, one, 1)
        mesh = Mesh(np.asarray(devices[:n]), (AXIS,), axis_types=(jax.sharding.AxisType.Auto,))
        return cls(NamedSharding(mesh, PartitionSpec()), NamedSharding(mesh, PartitionSpec(AXIS)), n)
