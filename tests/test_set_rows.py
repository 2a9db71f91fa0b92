"""specjax.step.set_rows: the one-row update written without a scatter equals `.at[rows].set(mode="drop")`
(the fused step stores each slot's tree through it), for in-range, negative and out-of-range rows."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.step import set_rows


@pytest.mark.parametrize("shape", [(2, 3, 32), (5, 7), (4,)])
def test_set_rows_equals_a_dropping_scatter(shape):
    rng = np.random.default_rng(0)
    arr = jnp.asarray(rng.integers(0, 100, shape), jnp.int32)
    fn = jax.jit(set_rows)
    n = shape[0]
    for r in (-n - 2, -n, -1, 0, n - 1, n, n + 3):
        rows = jnp.array([r], jnp.int32)
        val = jnp.asarray(rng.integers(100, 200, (1,) + shape[1:]), jnp.int32)
        want = arr.at[rows].set(val, mode="drop")
        np.testing.assert_array_equal(np.asarray(fn(arr, rows, val)), np.asarray(want), err_msg=str(r))
        np.testing.assert_array_equal(np.asarray(set_rows(arr, rows, -5)), np.asarray(arr.at[rows].set(-5, mode="drop")))
    rows = jnp.array([1, n + 1, 0], jnp.int32)  # several rows: the scatter itself
    val = jnp.asarray(rng.integers(100, 200, (3,) + shape[1:]), jnp.int32)
    np.testing.assert_array_equal(np.asarray(set_rows(arr, rows, val)), np.asarray(arr.at[rows].set(val, mode="drop")))
