"""Multi-host: 2 JAX processes on 127.0.0.1 (jax.distributed, CPU collectives), one CPU device each,
the tiny random model sharded over both (tensor_parallel=2). Their outputs equal the single-process
ones (this process: the same model over 2 of its CPU devices): LLM.generate / generate_stream with
process 0's requests on both processes (tests/multihost_worker.py; a stream closed early cancels its
request on both, a call that fails on process 0 fails on both, no page is left held), and `specjax serve` started
on both processes with the multi-host flags (speculative: n-gram drafter; greedy float32 outputs
equal plain decoding), answered by process 0 only. Every wait is bounded; a hung job is killed and
the test fails with both processes' logs."""
from __future__ import annotations

import concurrent.futures as cf
import json
import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import openai
import pytest

from multihost_cases import GREEDY, LLM_ARGS, LONG, PARAMS, PROMPTS, STREAM_PARAMS, STREAM_PROMPTS, output_record
from server_utils import http_get as _get, wait_for
from specjax import LLM
from tiny_dir import make_tiny_model_dir

REPO = Path(__file__).resolve().parent.parent
JOB_TIMEOUT = 300  # seconds for a whole 2-process job (about 25 s here)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict:
    """One CPU device per process (not this test session's 8), specjax and tests/ importable."""
    env = {k: v for k, v in os.environ.items() if k != "JAX_NUM_CPU_DEVICES"}
    env["XLA_FLAGS"] = re.sub(r"--xla_force_host_platform_device_count=\d+", "", env.get("XLA_FLAGS", "")).strip()
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(REPO / "tests"), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["PYTHONUNBUFFERED"] = "1"
    return env


class Job:
    """Two processes with their logs; `finish` waits for both (bounded), else kills them and fails."""

    def __init__(self, argv_of, logs: list[Path]):
        self.logs = logs
        self.procs = []
        for pid, log in enumerate(logs):
            with open(log, "w") as f:
                self.procs.append(subprocess.Popen(argv_of(pid), stdout=f, stderr=subprocess.STDOUT, env=_env(),
                                                   cwd=REPO))

    def tails(self) -> str:
        return "\n".join(f"--- process {i} (exit {p.poll()}):\n{log.read_text()[-3000:]}"
                         for i, (p, log) in enumerate(zip(self.procs, self.logs)))

    def check_alive(self) -> None:
        if any(p.poll() is not None for p in self.procs):
            self.kill()
            pytest.fail(f"a process of the multi-host job exited early:\n{self.tails()}", pytrace=False)

    def finish(self, timeout: float = JOB_TIMEOUT) -> list[int]:
        try:
            return [p.wait(timeout) for p in self.procs]
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"the multi-host job hung (no exit within {timeout:.0f} s; a process waiting on the "
                        f"other?), killed:\n{self.tails()}", pytrace=False)

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait(30)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny") / "model", num_layers=2)


@pytest.fixture(scope="module")
def reference(model_dir):
    """The single-process LLM (tensor_parallel=2 over this process's CPU devices)."""
    return LLM(model_dir, **LLM_ARGS)


def test_llm_on_two_processes_equals_one(model_dir, reference, tmp_path):
    port = _free_port()
    outs = [tmp_path / f"out{i}.json" for i in range(2)]
    job = Job(lambda pid: [sys.executable, str(REPO / "tests" / "multihost_worker.py"), str(port), str(pid),
                           str(model_dir), str(outs[pid])], [tmp_path / f"log{i}.txt" for i in range(2)])
    try:  # the references, while the job runs
        ref = [output_record(o) for o in reference.generate(PROMPTS, PARAMS)]
        ref_stream = [[d.index, d.token_ids, d.finish_reason] for d in
                      reference.generate_stream(STREAM_PROMPTS, STREAM_PARAMS)]
        early = reference.generate_stream(STREAM_PROMPTS[:1], LONG)
        ref_early = next(early).token_ids
        early.close()
    finally:
        codes = job.finish()
    assert codes == [0, 0], job.tails()
    assert ref[3]["finish_reason"] == "error" and "max_seq_len" in ref[3]["error"]
    assert ref[2]["finish_reason"] == "stop" or 40 not in ref[2]["token_ids"]
    for pid, path in enumerate(outs):
        got = json.loads(path.read_text())
        for g, r in zip(got["generate"], ref, strict=True):
            assert (g["token_ids"], g["text"], g["finish_reason"], g["error"]) == \
                (r["token_ids"], r["text"], r["finish_reason"], r["error"]), f"process {pid}"
            if r["logprobs"] is not None:
                for ge, re_ in zip(g["logprobs"], r["logprobs"], strict=True):
                    assert ge.keys() == re_.keys() and all(abs(ge[k] - re_[k]) < 1e-4 for k in ge)
        assert got["stream"] == ref_stream, f"process {pid}"
        assert got["after_bad_call"] == ref[:1], f"process {pid}"
        assert got["early"] == ref_early and got["idle"] == [0, 0, 0], f"process {pid}"  # cancelled: pages freed
    lead, follower = (json.loads(p.read_text()) for p in outs)
    assert lead["bad_call"].startswith("PromptError: prompt 0 must be a string")
    assert follower["bad_call"] == f"RuntimeError: process 0's generate call failed: {lead['bad_call']}"
    assert follower["followed"] is True


def test_specjax_serve_on_two_processes(model_dir, reference, tmp_path):
    coord, port = _free_port(), _free_port()
    logs = [tmp_path / f"serve{i}.txt" for i in range(2)]
    job = Job(lambda pid: [sys.executable, "-m", "specjax.cli", "serve", "--model", str(model_dir),
                           "--dtype", "float32", "--max-batch", "2", "--max-seq-len", "32", "--tensor-parallel", "2",
                           "--speculate", "ngram", "--port", str(port), "--log-level", "warning",
                           "--coordinator", f"127.0.0.1:{coord}", "--num-processes", "2", "--process-id", str(pid)],
              logs)
    try:
        refs = [o.text for o in reference.generate(PROMPTS[:3], GREEDY)]  # plain decoding

        def up():
            job.check_alive()
            try:
                return _get(port, "/health")[0] == 200
            except OSError:
                return False
        wait_for(up, JOB_TIMEOUT, "the multi-host `specjax serve` to answer /health")
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=120)

        def run(i):
            text, n = "", 0
            for ch in client.completions.create(model="model", prompt=PROMPTS[i], max_tokens=GREEDY.max_tokens,
                                                temperature=0, stream=True):
                n += 1
                assert n < 50, "unbounded stream"
                text += ch.choices[0].text
            return text

        with cf.ThreadPoolExecutor(3) as pool:
            assert list(pool.map(run, range(3), timeout=JOB_TIMEOUT)) == refs
        with pytest.raises(openai.BadRequestError, match="max_seq_len|tokens"):
            client.completions.create(model="model", prompt=PROMPTS[3], max_tokens=4)
        status, text = _get(port, "/metrics")
        assert status == 200 and "specjax_speculative 1" in text and "specjax_spec_steps_total" in text
        job.procs[0].send_signal(signal.SIGTERM)
        codes = job.finish()
    finally:
        job.kill()
    assert codes[0] in (0, -signal.SIGTERM) and codes[1] == 0, job.tails()
    leader, follower = (log.read_text() for log in logs)
    assert "specjax serve: engine stopped" in leader and "Traceback" not in leader + follower, job.tails()
    assert "following process 0" in follower and "process 0 stopped; exiting" in follower, job.tails()


def test_multi_host_flags_come_together(capsys):
    from specjax import cli
    for argv, why in ((["--coordinator", "127.0.0.1:1234"], "got only --coordinator"),
                      (["--coordinator", "h:1", "--num-processes", "2", "--process-id", "2"], r"\[0, 1\], got 2")):
        with pytest.raises(SystemExit) as e:
            cli.main(["serve", "--no-speculate", *argv])
        assert e.value.code == 2 and re.search(why, capsys.readouterr().err)


def test_a_mesh_must_reach_every_process(monkeypatch):
    import jax

    from specjax import multihost, sharding
    mesh = sharding.make_mesh(2)  # this process's devices only
    multihost.check_mesh(mesh)  # one process: fine
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    for m in (mesh, None):
        with pytest.raises(ValueError, match="2 JAX processes, but tensor_parallel=.* of 1 of them"):
            multihost.check_mesh(m)
