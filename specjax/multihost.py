"""Multi-host serving: one controller per host, process 0 leads, every process runs the same engine.

JAX runs one Python process per host (`jax.distributed`); a program over a mesh that spans hosts
must be dispatched by every process, in the same order, with the same host inputs. specjax keeps
that true by running the same Engine on every process, fed the same commands between steps. The
engine is deterministic given those commands and the device outputs (sampled tokens are
replicated: every process reads the same ones), so every process makes the same scheduling
decisions (admission, chunking, preemption, finishing) and dispatches the same programs.

  process 0 (leader): LLM.generate / AsyncLLM / `specjax serve`    processes 1 .. n-1 (followers)
    tokenize, validate, draw seeds -> Request
    Engine.add_request(req)  -> log ("add", request fields)
    Engine.cancel(id)        -> log ("cancel", id)
    steps per dispatch adapted (BatchOptions.adaptive_steps) -> log ("steps", level)
    a program compiled in the background is ready -> log ("compiled", key): the followers take it
                                                      from the same step on (their own worker
                                                      compiled it meanwhile, or their call does)
    Engine.step(): send the log, then "step"  --- Channel --->    Follower.replay(): per message
                   then the step itself                             add_request(Request(fields)) /
                                                                    cancel(id), then Engine.step()
    end of LLM.generate: "end"                ----------------->    LLM.generate returns its outputs
    LLM.close() (`specjax serve` shutdown): "stop" ------------>    LLM.follow() returns

The Channel is JAX's distributed key-value store (the coordinator that jax.distributed.initialize
starts in process 0): host-side messages only, so the device queue keeps the one-step-behind loop
(a device collective here would wait for the step in flight). One message per engine step.

Only process 0 answers: its RequestOutputs / HTTP responses. The followers compute the same
outputs (their LLM.generate returns them too) and answer nobody. A follower compiles a request's
output constraint itself (xgrammar is deterministic); the time bound of `specjax serve`
(--grammar-timeout) applies on process 0, which fails a request before it reaches the others.
"""
from __future__ import annotations

import dataclasses
import json
import queue
import threading
from collections.abc import Callable, Iterator

import jax

from specjax.sampling_params import SamplingParams

__all__ = ["Channel", "Follower", "Leader", "LeaderStopped", "check_mesh", "initialize", "is_multi_process",
           "shutdown"]

POLL_MS = 60_000  # a follower waits for the next message in slices of this (an idle server sends none)
_channels = 0  # multi-process engines made by this process (the same count on every process)


class LeaderStopped(RuntimeError):
    """Process 0 closed its LLM (LLM.close, `specjax serve` shutdown): a follower has nothing to follow."""


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None) -> None:
    """jax.distributed.initialize (before anything else uses JAX), with CPU collectives (gloo) so that
    a mesh over the CPU devices of several processes works. Arguments None: JAX detects them (TPU
    pods, SLURM, Open MPI) or reads JAX_COORDINATOR_ADDRESS etc."""
    try:
        if jax.config.jax_cpu_collectives_implementation in (None, "none"):
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
    except AttributeError:  # a jax without the option: its default applies
        pass
    jax.distributed.initialize(coordinator_address=coordinator_address, num_processes=num_processes,
                               process_id=process_id)


def shutdown() -> None:
    """jax.distributed.shutdown: waits until every process has called it (each leaves cleanly)."""
    jax.distributed.shutdown()


def is_multi_process() -> bool:
    return jax.process_count() > 1


def check_mesh(mesh) -> None:
    """Several processes: the model's mesh must hold devices of every process (each process
    dispatches the programs on its own devices). One process: nothing to check."""
    n = jax.process_count()
    if n == 1:
        return
    have = set() if mesh is None else {d.process_index for d in mesh.devices.flat}
    if len(have) < n:
        tp = 1 if mesh is None else mesh.devices.size
        raise ValueError(f"{n} JAX processes, but tensor_parallel={tp} places the model on the devices of "
                         f"{max(len(have), 1)} of them: shard it over devices of every process (tensor_parallel = "
                         f"jax.device_count() = {jax.device_count()}, or a divisor of the model's KV heads "
                         f"covering all {n} processes)")


def _client():
    from jax._src import distributed
    client = distributed.global_state.client
    if client is None:
        raise RuntimeError("several JAX processes but no jax.distributed client: call "
                           "specjax.multihost.initialize() (or jax.distributed.initialize()) first")
    missing = [m for m in ("key_value_set_bytes", "blocking_key_value_get_bytes", "key_value_delete")
               if not hasattr(client, m)]
    if missing:
        raise RuntimeError(f"jax {jax.__version__}: the distributed client lacks {missing}; multi-host "
                           "serving needs JAX's key-value store")
    return client


class Channel:
    """Ordered messages from process 0 to every other process over jax.distributed's key-value store.
    Message k goes to each follower p under its own key (`.../k/p`), which p deletes once read."""

    def __init__(self, name: str):
        self._client = _client()
        self.name, self.seq = name, 0
        self.me, self.n = jax.process_index(), jax.process_count()

    def _key(self, seq: int, pid: int) -> str:
        return f"specjax/{self.name}/{seq}/{pid}"

    def send(self, payload: bytes) -> None:
        assert self.me == 0, "only process 0 sends"
        for pid in range(1, self.n):
            self._client.key_value_set_bytes(self._key(self.seq, pid), payload)
        self.seq += 1

    def receive(self) -> bytes:
        """The next message (waits as long as it takes: a server may be idle for hours)."""
        key = self._key(self.seq, self.me)
        while True:
            try:
                payload = self._client.blocking_key_value_get_bytes(key, POLL_MS)
                break
            except Exception as e:  # noqa: BLE001 - jax raises JaxRuntimeError / XlaRuntimeError
                if "DEADLINE_EXCEEDED" not in str(e):
                    raise
        self._client.key_value_delete(key)
        self.seq += 1
        return payload


def new_channel() -> Channel:
    """The channel of the next multi-process engine (named by creation order, the same everywhere)."""
    global _channels
    _channels += 1
    return Channel(f"engine{_channels}")


def request_fields(req) -> dict:
    """What a follower needs to rebuild a Request exactly (JSON: no code crosses the channel)."""
    return {"id": req.id, "prompt": req.prompt, "prompt_ids": list(req.prompt_ids), "seed": req.seed,
            "params": dataclasses.asdict(req.params), "error": req.error if req.finish_reason == "error" else None}


class Leader:
    """Process 0's side: logs the commands given to its Engine and sends them before each step. The
    key-value store calls run on a sender thread (in order), so a step waits for none of them."""

    def __init__(self, channel: Channel):
        self.channel = channel
        self._log: list = []
        self._lock = threading.Lock()  # the engine thread sends; LLM.close may come from another thread
        self.closed = False
        self._out: queue.SimpleQueue = queue.SimpleQueue()  # payloads, None: no more
        self._failed: BaseException | None = None
        self._sender = threading.Thread(target=self._send_loop, name="specjax-multihost-send", daemon=True)
        self._sender.start()

    def add(self, req) -> None:
        with self._lock:
            self._log.append(["add", request_fields(req)])

    def cancel(self, request_id: int) -> None:
        with self._lock:
            self._log.append(["cancel", request_id])

    def steps_level(self, level: int) -> None:
        """The engine's steps-per-dispatch level changed (dispatch_plan.StepsCap, adapted here only)."""
        with self._lock:
            self._log.append(["steps", level])

    def compiled(self, key) -> None:
        """A program compiled in the background is dispatchable from the next step on (its key:
        (program family, dims), JSON-able; specjax.background_compile)."""
        with self._lock:
            self._log.append(["compiled", key])

    def send(self, then: str, error: str | None = None) -> None:
        """Send the logged commands, then `then`: "step" (the followers step once), "end" (the end of
        an LLM.generate call; `error`: why it failed) or "stop" (followers leave LLM.follow; returns
        once every message is delivered)."""
        with self._lock:
            if self._failed is not None:
                raise RuntimeError(f"cannot reach the other processes: {type(self._failed).__name__}: "
                                   f"{self._failed}") from self._failed
            if self.closed:
                raise LeaderStopped("this LLM was closed (LLM.close): its other processes have stopped following")
            msg, self._log = {"commands": self._log, "then": then, "error": error}, []
            self._out.put(json.dumps(msg).encode())
            if then == "stop":
                self.closed = True
                self._out.put(None)
        if then == "stop":
            self._sender.join()

    def _send_loop(self) -> None:
        while (payload := self._out.get()) is not None:
            try:
                self.channel.send(payload)
            except BaseException as e:  # noqa: BLE001 - reported by the next send
                self._failed = e
                return


@dataclasses.dataclass
class Replayed:
    """One message replayed by a follower: the requests it added, then what it did."""
    added: list
    then: str  # "step" | "end" | "stop"
    updates: list  # the engine step's StepUpdates ("step" only)
    error: str | None = None  # "end" of a generate call that failed on process 0: why


class Follower:
    """A process other than 0: replays process 0's commands on its own engine."""

    def __init__(self, channel: Channel, engine, make_request: Callable[[dict], object]):
        self.channel, self.engine, self.make_request = channel, engine, make_request
        engine.steps_cap.adaptive = False  # process 0 adapts its steps per dispatch and sends the changes
        engine.compiles_from_leader = True  # and says when a program compiled in the background is taken
        self.stopped = False

    def replay(self) -> Iterator[Replayed]:
        """Replay messages, one at a time, until "end" or "stop" (yielded last)."""
        if self.stopped:
            raise LeaderStopped("process 0 closed its LLM (LLM.close)")
        while True:
            msg = json.loads(self.channel.receive())
            added = []
            for cmd in msg["commands"]:
                if cmd[0] == "add":
                    req = self.make_request(cmd[1])
                    added.append(req)
                    self.engine.add_request(req)
                elif cmd[0] == "cancel":
                    self.engine.cancel(cmd[1])
                elif cmd[0] == "steps":
                    self.engine.steps_cap.set(cmd[1])
                elif cmd[0] == "compiled":
                    self.engine.mark_compiled(cmd[1])
                else:
                    raise RuntimeError(f"unknown command from process 0: {cmd[0]!r}")
            then = msg["then"]
            updates = self.engine.step() if then == "step" else []
            self.stopped = then == "stop"
            yield Replayed(added, then, updates, msg.get("error"))
            if then != "step":
                return


def params_from(fields: dict) -> SamplingParams:
    return SamplingParams(**fields)
