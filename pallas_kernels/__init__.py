"""Pallas kernels of specjax, each beside a pure-jnp reference with the same signature."""
