# session 38: host seconds of one jit call (device drained) vs number of arguments, donated arguments, kernels
import time, json, sys
import jax, jax.numpy as jnp
import numpy as np

def timeit(f, args, n=40):
    out = f(*args); jax.block_until_ready(out)
    ts = []
    for _ in range(n):
        jax.block_until_ready(args)
        t = time.perf_counter(); out = f(*args); ts.append(time.perf_counter() - t)
        jax.block_until_ready(out)
    return round(1e3 * float(np.median(ts)), 4)

res = {}
# (a) N read-only args, trivial use
for N in (1, 10, 100, 300, 600):
    xs = [jnp.ones((576, 576), jnp.bfloat16) * i for i in range(N)]
    f = jax.jit(lambda *xs: sum(x[0, 0].astype(jnp.float32) for x in xs))
    res[f"args{N}"] = timeit(f, xs)
# (b) N donated args, each updated at one element, returned
for N in (10, 60, 200):
    def g(*xs):
        return tuple(x.at[0, 0].set(x[0, 0] + 1) for x in xs)
    f = jax.jit(g, donate_argnums=tuple(range(N)))
    xs = [jnp.ones((64, 4096), jnp.bfloat16) for _ in range(N)]
    out = f(*xs); jax.block_until_ready(out)
    ts = []
    for _ in range(40):
        xs = out
        jax.block_until_ready(xs)
        t = time.perf_counter(); out = f(*xs); ts.append(time.perf_counter() - t)
        jax.block_until_ready(out)
    res[f"donated{N}"] = round(1e3 * float(np.median(ts)), 4)
# (c) L chained small matmuls (cuBLAS calls / fusions in one command buffer), 2 args
for L in (10, 100, 500, 2000):
    w = jnp.ones((64, 64), jnp.bfloat16) * 0.01
    def h(x, w):
        for i in range(L):
            x = jnp.tanh(x @ w) + i
        return x
    f = jax.jit(h)
    res[f"kernels{L}"] = timeit(f, (jnp.ones((8, 64), jnp.bfloat16), w))
print(json.dumps(res))
# (e) 38 donated state arrays + 300 read-only weights + L chained kernels: the engine's shape of call
ws = [jnp.ones((576, 576), jnp.bfloat16) * 0.001 for _ in range(300)]
for L in (100, 2000):
    def k(state, ws):
        x = state[0][:8, :576]
        for i in range(L):
            x = jnp.tanh(x @ ws[i % len(ws)]) + i
        return (state[0].at[:8, :576].set(x),) + tuple(s.at[0, 0].set(s[0, 0] + 1) for s in state[1:])
    f = jax.jit(k, donate_argnums=(0,))
    st = tuple(jnp.ones((64, 4096), jnp.bfloat16) for _ in range(38))
    st = f(st, ws); jax.block_until_ready(st)
    ts = []
    for _ in range(40):
        jax.block_until_ready(st)
        t = time.perf_counter(); st = f(st, ws); ts.append(time.perf_counter() - t)
    jax.block_until_ready(st)
    res[f"engine_like{L}"] = round(1e3 * float(np.median(ts)), 4)
print(json.dumps(res))
