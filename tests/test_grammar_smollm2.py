"""Grammar-constrained generation with the real SmolLM2-135M-Instruct (float32) through LLM: JSON
schema outputs (nested objects, enums, arrays, bounded numbers) parse and validate, regex and
choice hold; plain decoding gives the same tokens with the grammar overlap on and off; tree
speculation (a 2-layer draft cut from the model itself) gives the plain tokens with the grammar
overlap on and off; under a device-DFA JSON schema, plain and tree-speculative outputs are the same
with the device DFA on and off (the real-model check of tests/test_json_schema_dfa.py, here to share
this file's engines); streaming deltas concatenate to the text; bad requests fail
alone; the CLI turns --json-schema / --regex / --grammar / --choice and per-line keys into
constraints."""
from __future__ import annotations

import dataclasses
import json
import re

import jax.numpy as jnp
import pytest
from flax import nnx

from specjax import LLM, SamplingParams
from specjax.scheduler import SchedulerOptions

jsonschema = pytest.importorskip("jsonschema")

MAX_SEQ = 320
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "pet": {"type": "object",
                "properties": {"kind": {"enum": ["cat", "dog", "owl"]},
                               "weight": {"type": "number", "minimum": 0, "maximum": 50}},
                "required": ["kind", "weight"], "additionalProperties": False},
        "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 10}, "minItems": 1, "maxItems": 3},
    },
    "required": ["name", "age", "pet", "hobbies"],
    "additionalProperties": False,
}
DATE = r"(19|20)[0-9]{2}-(0[1-9]|1[0-2])-[0-3][0-9]"
CHOICES = ["yes", "no", "maybe"]
QUESTIONS = ["Describe a person with a pet as JSON.", "When did the Berlin wall fall? Give the date.",
             "Is water wet?", "Name three colors."]


def params(i, **kw):
    c = [dict(json_schema=SCHEMA), dict(regex=DATE), dict(choice=CHOICES), {}][i]
    return SamplingParams(max_tokens=[110, 16, 8, 12][i], temperature=0.0, **c, **kw)


@pytest.fixture(scope="module")
def llm():
    from helpers import default_model_or_skip
    default_model_or_skip()  # CI=true: fails instead of skipping
    return LLM(dtype="float32", max_batch=2, max_seq_len=MAX_SEQ)


@pytest.fixture(scope="module")
def prompts(llm):
    return [llm.apply_chat_template([{"role": "user", "content": q}]) for q in QUESTIONS]


@pytest.fixture(scope="module")
def spec(llm):
    """The tree-speculative LLM of the tests below, built (and its programs compiled) once; each test
    sets the scheduler options it runs with."""
    return _spec_llm(llm, SchedulerOptions())


@pytest.fixture(scope="module")
def plain(llm, prompts):
    return llm.generate(prompts, [params(i) for i in range(4)])


def test_outputs_satisfy_their_constraints(llm, plain):
    js, date, choice, free = plain
    assert js.finish_reason == "stop", js.text
    value = json.loads(js.text)
    jsonschema.validate(value, SCHEMA)
    assert value["pet"]["kind"] in ("cat", "dog", "owl") and 0 <= value["pet"]["weight"] <= 50
    assert date.finish_reason == "stop" and re.fullmatch(DATE, date.text), date.text
    assert choice.finish_reason == "stop" and choice.text in CHOICES
    for o in (js, date, choice):
        assert o.token_ids[-1] in llm.eos_ids and o.error is None
    assert free.finish_reason in ("stop", "length") and free.text


def _spec_llm(llm, sched):
    """The same LLM with a tree-speculative engine; the draft is SmolLM2 cut to its first 2 layers."""
    from specjax.checkpoint import load_model
    from specjax.drafter import DraftInfo
    from specjax.engine import BatchOptions, CacheOptions, Draft, Engine
    from specjax.models.llama import Llama, flat_state, load_flat
    from specjax.tree import SpecConfig

    cfg, full = load_model(llm.model_dir, "float32")
    dcfg = dataclasses.replace(cfg, num_layers=2)
    draft = Llama(dcfg, jnp.float32, nnx.Rngs(0))
    load_flat(draft, {k: v for k, v in flat_state(full).items()
                      if not (k.startswith("layers.") and int(k.split(".")[1]) >= 2)})
    spec = SpecConfig(method="draft", num_steps=3, topk=2, num_draft_tokens=5)
    other = LLM.__new__(LLM)
    other.__dict__.update(llm.__dict__)
    other.engine = Engine(full, cfg, CacheOptions(16, MAX_SEQ), BatchOptions(2), jnp.float32,
                          draft=Draft(draft, dcfg, DraftInfo("draft"), spec), sched=sched,
                          grammar=llm.engine._grammar)
    return other


def test_tree_speculation_with_grammars_equals_plain(spec, prompts, plain):
    spec.engine.opts = SchedulerOptions(overlap=True)
    got = spec.generate(prompts, [params(i) for i in range(4)])
    assert [o.token_ids for o in got] == [o.token_ids for o in plain]
    assert any(t > 1 for o in got for t in [o.accept_len_mean]), [o.accept_len_mean for o in got]
    spec.engine.opts = SchedulerOptions(overlap=False)  # reference: masks first, then the fused step
    again = spec.generate(prompts, [params(i) for i in range(4)])
    assert [o.token_ids for o in again] == [o.token_ids for o in plain]


# a schema the device DFA takes (SCHEMA's bounded number does not)
DFA_SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "pet": {"type": "object", "properties": {"kind": {"enum": ["cat", "dog", "owl"]},
                                             "legs": {"type": "integer", "minimum": 0, "maximum": 8}},
            "required": ["kind", "legs"]},
    "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 10}, "minItems": 1, "maxItems": 3}},
    "required": ["name", "age", "pet", "hobbies"]}


def test_json_schema_device_dfa_equals_host_path(llm, spec):
    """Greedy outputs under a schema with the device DFA are the host path's, plain and
    tree-speculative, and valid JSON."""
    prompts = [llm.apply_chat_template([{"role": "user", "content": q}])
               for q in ("Describe a person with a pet as JSON.", "Invent a character who loves owls, as JSON.")]
    params = SamplingParams(max_tokens=110, temperature=0.0, json_schema=DFA_SCHEMA)
    runs = {}
    try:
        for name, m in (("plain", llm), ("tree", spec)):
            for dfa in (False, True):
                m.engine.opts = SchedulerOptions(device_dfa=dfa)
                runs[name, dfa] = m.generate(prompts, [params] * 2)
    finally:  # the other tests' engines run with the default options
        llm.engine.opts = SchedulerOptions()
    for (name, dfa), outs in runs.items():
        assert [o.token_ids for o in outs] == [o.token_ids for o in runs["plain", False]], (name, dfa)
        assert all(o.constraint_path == ("device_dfa" if dfa else "host_grammar") for o in outs)
    for o in runs["plain", True]:
        assert o.finish_reason == "stop", o.text
        jsonschema.validate(json.loads(o.text), DFA_SCHEMA)
    assert any(o.accept_len_mean > 1 for o in runs["tree", True])


def test_plain_overlap_off_gives_the_same_tokens(llm, prompts, plain):
    """Plain constrained decoding with the masks computed first (overlap off: one fused step with
    them) gives the tokens of the overlapped loop (forward | sample), for a JSON schema and a regex."""
    llm.engine.opts = SchedulerOptions(overlap=False)
    try:  # the JSON output's first 40 tokens (greedy: the same whatever max_tokens) and the whole date,
        #     one at a time (one mask row: one program to compile)
        got = [llm.generate([prompts[i]], [p])[0] for i, p in
               ((0, SamplingParams(max_tokens=40, temperature=0.0, json_schema=SCHEMA)), (1, params(1)))]
    finally:
        llm.engine.opts = SchedulerOptions()
    assert got[0].token_ids == plain[0].token_ids[:40] and got[1].token_ids == plain[1].token_ids
    assert got[0].finish_reason == "length" and got[1].finish_reason == "stop"


def test_streaming_deltas_concatenate(llm, prompts, plain):
    texts = {i: "" for i in range(4)}
    finals = {}
    events = 0
    for ev in llm.generate_stream(prompts, [params(i) for i in range(4)]):
        texts[ev.index] += ev.text
        events += 1
        if ev.finish_reason is not None:
            finals[ev.index] = ev.output
    assert events > 8
    for i in range(4):
        assert texts[i] == finals[i].text == plain[i].text
        assert finals[i].token_ids == plain[i].token_ids


def test_bad_requests_fail_alone(llm, prompts, plain):
    reqs = [prompts[2], prompts[0], [1] * MAX_SEQ, "", [5, 10 ** 6], prompts[1], prompts[2]]
    ps = [params(2), SamplingParams(json_schema={"type": "object", "properties": {"a": {"type": "nope"}}}),
          params(2), params(2), params(2), dict(temperature=0.0, top_p=3.0), dict(regex="(unclosed")]
    outs = llm.generate(reqs, ps)
    assert outs[0].token_ids == plain[2].token_ids and outs[0].error is None
    words = [None, "json_schema", "max_seq_len", "empty", "token ids", "top_p", "regex"]
    for o, w in zip(outs[1:], words[1:]):
        assert o.finish_reason == "error" and w in o.error and o.token_ids == [], (w, o.error)
    assert all(s is None for s in llm.engine.slots)


def test_cli_constraint_options(tmp_path, monkeypatch, capsys):
    """The CLI maps its constraint options and per-line keys onto per-request parameters and writes
    each line's finish_reason / error (a stand-in LLM records what it was asked)."""
    import specjax.llm
    from specjax.cli import main
    from specjax.request import RequestOutput

    seen = []

    class FakeLLM:
        def __init__(self, *a, **kw):
            from specjax.checkpoint import load_tokenizer
            from specjax.default_model import ensure_default
            self.tokenizer = load_tokenizer(ensure_default())

        def apply_chat_template(self, messages):
            return messages[0]["content"]

        def generate(self, prompts, ps):
            seen.extend(ps)
            outs = []
            for i, p in enumerate(ps):
                try:
                    SamplingParams(**p)
                    outs.append(RequestOutput(i, None, [], "ok", [1], "stop"))
                except ValueError as e:
                    outs.append(RequestOutput(i, None, [], "", [], "error", error=str(e)))
            return outs

    monkeypatch.setattr(specjax.llm, "LLM", FakeLLM)
    schema = tmp_path / "s.json"
    schema.write_text(json.dumps(SCHEMA))
    ebnf = tmp_path / "g.ebnf"
    ebnf.write_text('root ::= "a" | "b"')
    rows = [{"prompt": "x"}, {"prompt": "y", "regex": "[0-9]+"}, {"prompt": "z", "choice": "A,B"},
            {"prompt": "w", "json_schema": json.dumps({"type": "integer"}), "id": 4}, {"prompt": "v", "choice": []}]
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("\n".join(json.dumps(r) for r in rows))
    # exit code 1: one request (the empty choice) failed; the others are written all the same
    assert main(["generate", "--prompts", str(src), "--output", str(out), "--json-schema", str(schema)]) == 1
    assert SamplingParams(**seen[0]).constraint == SamplingParams(json_schema=SCHEMA).constraint
    assert seen[1]["regex"] == "[0-9]+" and "json_schema" not in seen[1]
    assert seen[2]["choice"] == ["A", "B"] and seen[3]["json_schema"] == '{"type": "integer"}'
    got = [json.loads(line) for line in out.read_text().splitlines()]
    assert [g["finish_reason"] for g in got] == ["stop"] * 4 + ["error"]
    assert "choice" in got[4]["error"] and "error" not in got[0] and got[3]["id"] == 4
    assert "regex" not in got[1] and "choice" not in got[2]
    for flag, value, key in (("--regex", "a+", "regex"), ("--grammar", str(ebnf), "grammar"),
                             ("--choice", "p,q", "choice")):
        seen.clear()
        assert main(["generate", "--prompt", "hi", flag, value]) == 0
        assert seen[0][key] == {"regex": "a+", "grammar": 'root ::= "a" | "b"', "choice": ["p", "q"]}[key]
    with pytest.raises(SystemExit) as err:  # a bad flag value: exit code 2, the flag named
        main(["generate", "--prompt", "hi", "--choice", ","])
    assert err.value.code == 2 and "--choice must hold non-empty strings" in capsys.readouterr().err
