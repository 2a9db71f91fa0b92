"""One process of a 2-process specjax job on 127.0.0.1 (tests/test_multihost.py starts two).

    python multihost_worker.py COORDINATOR_PORT PROCESS_ID MODEL_DIR OUT.json

Every process runs the same script (SPMD, as with any JAX job); process 0's prompts run, the other
passes None. Each process writes what its LLM calls returned to OUT.json.
"""
from __future__ import annotations

import json
import sys

from specjax import multihost

port, pid, model_dir, out_path = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
multihost.initialize(f"127.0.0.1:{port}", 2, pid)  # before anything else touches JAX

from specjax import LLM  # noqa: E402
from multihost_cases import LLM_ARGS, LONG, PARAMS, PROMPTS, STREAM_PARAMS, STREAM_PROMPTS, output_record  # noqa: E402

lead = pid == 0
llm = LLM(model_dir, **LLM_ARGS)
res = {"generate": [output_record(o) for o in llm.generate(PROMPTS if lead else None, PARAMS if lead else None)]}
res["stream"] = [[d.index, d.token_ids, d.finish_reason] for d in
                 llm.generate_stream(STREAM_PROMPTS if lead else None, STREAM_PARAMS if lead else None)]
early = llm.generate_stream(STREAM_PROMPTS[:1] if lead else None, LONG if lead else None)
res["early"] = next(early).token_ids
early.close()  # process 0 cancels the request; the others cancel it too
try:  # a call that fails on process 0 (a prompt of the wrong type) fails on the others too
    llm.generate([3.5] if lead else None)
    res["bad_call"] = None
except Exception as e:  # noqa: BLE001
    res["bad_call"] = f"{type(e).__name__}: {e}"
res["after_bad_call"] = [output_record(o) for o in llm.generate(PROMPTS[:1] if lead else None,
                                                                PARAMS[:1] if lead else None)]
st = llm.engine.stats()
res["idle"] = [st["running"], st["queue_length"], st["pages_in_use"]]
if lead:
    llm.close()  # releases the others from follow()
else:
    llm.follow()
    res["followed"] = True
with open(out_path, "w") as f:
    json.dump(res, f)
multihost.shutdown()
