# session 38: does a fresh buffer address (numpy input, new output) make every call re-record the command buffer?
import time, json
import jax, jax.numpy as jnp
import numpy as np
res = {}
ws = [jnp.ones((576, 576), jnp.bfloat16) * 0.001 for _ in range(300)]
L = 1000
def chain(x, ws):
    for i in range(L):
        x = jnp.tanh(x @ ws[i % len(ws)]) + i
    return x
def run(name, f, make_args, n=40, donate_out=True):
    st = tuple(jnp.ones((64, 4096), jnp.bfloat16) for _ in range(38))
    out = f(st, ws, *make_args()); jax.block_until_ready(out)
    ts = []
    for _ in range(n):
        st = out[0]
        a = make_args()
        jax.block_until_ready(st)
        t = time.perf_counter(); out = f(st, ws, *a); ts.append(time.perf_counter() - t)
        jax.block_until_ready(out)
    res[name] = round(1e3 * float(np.median(ts)), 4)
def body(state, ws, *extra, first=True, fresh_out=False):
    x = state[0][:8, :576]
    if extra and first:
        x = x + extra[0][:, :1].astype(x.dtype)
    x = chain(x, ws)
    if extra and not first:
        x = x + extra[0][:, :1].astype(x.dtype)
    new = (state[0].at[:8, :576].set(x),) + tuple(s.at[0, 0].set(s[0, 0] + 1) for s in state[1:])
    return (new, x[:, :4] * 2) if fresh_out else (new, None)
dev_arg = jnp.ones((8, 4), jnp.int32)
run("stable", jax.jit(lambda s, w: body(s, w), donate_argnums=(0,)), lambda: ())
run("numpy_arg_first", jax.jit(lambda s, w, e: body(s, w, e), donate_argnums=(0,)), lambda: (np.ones((8, 4), np.int32),))
run("numpy_arg_last", jax.jit(lambda s, w, e: body(s, w, e, first=False), donate_argnums=(0,)), lambda: (np.ones((8, 4), np.int32),))
run("device_arg_same", jax.jit(lambda s, w, e: body(s, w, e), donate_argnums=(0,)), lambda: (dev_arg,))
run("fresh_output", jax.jit(lambda s, w: body(s, w, fresh_out=True), donate_argnums=(0,)), lambda: ())
print(json.dumps(res), flush=True)
