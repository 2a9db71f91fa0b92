"""`specjax generate` on bad input: argument errors exit 2 before anything loads, argparse-style and
naming the flag; failed requests exit 1 with their finish_reason "error" (the others still run);
every output reports its finish_reason (stderr for text, always in --output lines); the backend line
at start. Runs on the tiny random model of tests/tiny_dir.py."""
from __future__ import annotations

import json

import pytest
from tiny_dir import make_tiny_model_dir

import specjax.llm
from specjax import machine
from specjax.cli import main
from specjax.scheduler import SchedulerOptions


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny") / "model", num_layers=2)


@pytest.fixture
def no_load(monkeypatch):
    """Fails the test if the command gets as far as building an LLM."""
    class Refuse:
        def __init__(self, *a, **k):
            raise AssertionError("an argument error must stop the command before any model loads")
    monkeypatch.setattr(specjax.llm, "LLM", Refuse)


def usage_error(capsys, argv) -> str:
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2, err
    assert "usage: specjax generate" in err  # argparse-style: usage, then `specjax generate: error: ...`
    return err.split("specjax generate: error: ", 1)[1].strip()


def unconverted(tmp_path, kind):
    if kind == "hf":  # a Hugging Face folder that was never converted
        d = tmp_path / "hf"
        d.mkdir()
        (d / "config.json").write_text("{}")
        return d
    f = tmp_path / "model.gguf"
    f.write_bytes(b"GGUF")
    return f


CASES = [  # (extra arguments, what the message must say)
    (["--temperature", "-1"], "--temperature must be a finite number >= 0, got -1.0"),
    (["--top-p", "2"], "--top-p must be in (0, 1], got 2.0"),
    (["--top-k", "-3"], "--top-k must be an integer >= 0"),
    (["--max-tokens", "0"], "--max-tokens must be an integer >= 1, got 0"),
    (["--max-tokens", "5000"], "--max-tokens 5000 cannot fit --max-seq-len 2048"),
    (["--max-tokens", "64", "--max-seq-len", "64"], "--max-tokens 64 cannot fit --max-seq-len 64"),
    (["--max-batch", "0"], "argument --max-batch: must be an integer >= 1, got 0"),
    (["--max-seq-len", "x"], "argument --max-seq-len: must be an integer >= 1, got 'x'"),
    (["--dtype", "float16"], "argument --dtype: invalid choice: 'float16'"),
    (["--draft", "{tmp}/missing"], "--draft: draft directory {tmp}/missing does not exist"),
    (["--model", "{tmp}/missing"], "--model: model directory {tmp}/missing does not exist"),
    (["--draft", "self", "--num-steps", "2", "--num-draft-tokens", "3"],
     "with --topk=1 (a chain) --num-draft-tokens must equal --num-steps (2), got 3"),
    (["--speculate", "--model", "{tiny}"], "--speculate uses the EAGLE-3 head shipped for the default model"),
    (["--choice", ""], "--choice must hold non-empty strings"),
    (["--speculate-below", "0"], "argument --speculate-below: must be an integer >= 1, got 0"),
    (["--speculate-below", "8"], "--speculate-below applies to speculative decoding: give --speculate or --draft"),
    (["--spec-tiers"], "--spec-tiers runs the shapes of a draft's spec_defaults: give --speculate or --draft"),
    (["--draft", "self", "--num-steps", "2", "--spec-tiers"], "without --num-steps / --topk"),
    (["--json-schema", "{tmp}/missing.json"], "--json-schema: cannot read {tmp}/missing.json"),
    (["--grammar", "{tmp}/missing.ebnf"], "--grammar: cannot read {tmp}/missing.ebnf"),
]


@pytest.mark.parametrize("extra,want", CASES, ids=[" ".join(c[0]) for c in CASES])
def test_argument_errors_exit_2_naming_the_flag(tmp_path, capsys, no_load, tiny, extra, want):
    fill = lambda s: s.replace("{tmp}", str(tmp_path)).replace("{tiny}", str(tiny))  # noqa: E731
    msg = usage_error(capsys, ["generate", "--prompt", "hi", *map(fill, extra)])
    assert fill(want) in msg
    assert "SamplingParams" not in msg and "SpecConfig" not in msg and "_" not in msg.split(" ")[0]


@pytest.mark.parametrize("kind", ["hf", "gguf"])
@pytest.mark.parametrize("flag", ["--model", "--draft"])
def test_unconverted_directory_suggests_convert(tmp_path, capsys, no_load, flag, kind):
    path = unconverted(tmp_path, kind)
    msg = usage_error(capsys, ["generate", "--prompt", "hi", flag, str(path)])
    word = "model" if flag == "--model" else "draft"
    assert msg.startswith(f"{flag}: {word} ")
    assert f"specjax convert {path} OUT_DIR" in msg
    if flag == "--draft":
        assert f"specjax convert --draft {path} OUT_DIR" in msg


def test_bad_prompts_and_schema_files(tmp_path, capsys, no_load):
    assert "give --prompt TEXT or --prompts FILE.jsonl" in usage_error(capsys, ["generate"])
    missing = tmp_path / "nope.jsonl"
    assert f"--prompts: cannot read {missing}: No such file or directory" in usage_error(
        capsys, ["generate", "--prompts", str(missing)])
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a"}\n{"question": "b"}\n')
    assert f"--prompts {bad}:2: a line needs" in usage_error(capsys, ["generate", "--prompts", str(bad)])
    bad.write_text('{"turns": []}\n')
    assert f"--prompts {bad}:1: \"turns\" needs at least one string turn" in usage_error(
        capsys, ["generate", "--prompts", str(bad)])
    bad.write_text("\n")
    assert "no prompts in the file" in usage_error(capsys, ["generate", "--prompts", str(bad)])
    schema = tmp_path / "schema.json"
    schema.write_text("{not json")
    assert "--json-schema is not valid JSON" in usage_error(
        capsys, ["generate", "--prompt", "hi", "--json-schema", str(schema)])


def test_failed_requests_exit_1_and_the_others_run(tiny, tmp_path, capsys):
    """A line with an invalid schema and an empty raw prompt fail alone: finish_reason "error" with
    the reason in their --output lines, the good line runs, the exit status is 1."""
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    rows = [{"prompt": "w5 w6 w7"}, {"prompt": "w8", "json_schema": "{broken"}, {"prompt": ""}]
    src.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    rc = main(["generate", "--model", str(tiny), "--prompts", str(src), "--output", str(out), "--raw",
               "--max-tokens", "4", "--max-seq-len", "64", "--max-batch", "2"])
    err = capsys.readouterr().err
    got = [json.loads(line) for line in out.read_text().splitlines()]
    assert rc == 1 and "2 of 3 requests failed" in err
    assert got[0]["finish_reason"] in ("stop", "length") and got[0]["token_ids"] and "error" not in got[0]
    assert got[1]["finish_reason"] == "error" and "json_schema" in got[1]["error"]
    assert got[2]["finish_reason"] == "error" and "empty" in got[2]["error"]
    # text mode: the same failure, reported on stderr with its reason
    rc = main(["generate", "--model", str(tiny), "--prompt", "", "--raw", "--max-tokens", "4", "--max-seq-len", "64"])
    err = capsys.readouterr().err
    assert rc == 1 and "[finish_reason: error (prompt 0 is empty)]" in err and "1 of 1 request failed" in err


def test_finish_reason_and_backend_line(tiny, tmp_path, capsys, monkeypatch):
    """Truncation is reported as finish_reason "length" with what cut it (--max-tokens, or the
    context: warned about up front); the command starts with the backend line."""
    monkeypatch.setattr(machine, "_logged", False)
    prompt = " ".join(f"w{4 + i % 80}" for i in range(60))
    rc = main(["generate", "--model", str(tiny), "--prompts", str(_jsonl(tmp_path, ["w5 w6 w7", prompt])),
               "--raw", "--max-tokens", "6", "--max-seq-len", "64", "--max-batch", "2",
               "--output", str(tmp_path / "out.jsonl")])
    err = capsys.readouterr().err
    assert rc == 0
    assert err.startswith(f"specjax: {machine.backend_line()}\n")
    assert "prompt 1 has 60 tokens: with --max-seq-len 64 at most 4 of --max-tokens 6 fit" in err
    got = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [g["finish_reason"] for g in got] == ["length", "length"]
    assert [len(g["token_ids"]) for g in got] == [6, 4]
    # text mode: the same outputs, each with its finish_reason on stderr
    rc = main(["generate", "--model", str(tiny), "--prompts", str(_jsonl(tmp_path, ["w5 w6 w7", prompt])),
               "--raw", "--max-tokens", "6", "--max-seq-len", "64", "--max-batch", "2"])
    cap = capsys.readouterr()
    assert rc == 0
    assert "[finish_reason: length (--max-tokens 6 reached)]" in cap.err
    assert "[finish_reason: length (--max-seq-len 64 reached)]" in cap.err
    assert cap.out.splitlines()[1] == got[0]["text"]


def _jsonl(tmp_path, prompts):
    f = tmp_path / "prompts.jsonl"
    f.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    return f


def llm_arguments(monkeypatch, argv) -> dict:
    """The keyword arguments `main(argv)` builds its LLM with (the LLM itself never built)."""
    seen = {}

    class Capture:
        def __init__(self, *a, **k):
            seen.update(k)
            raise SystemExit(0)
    # (not specjax.LLM: its undo would leave the real class as an attribute of specjax, shadowing its
    # lazy __getattr__ and so later patches of specjax.llm.LLM, e.g. in test_grammar_smollm2)
    monkeypatch.setattr(specjax.llm, "LLM", Capture)
    with pytest.raises(SystemExit):
        main(argv)
    return seen


@pytest.mark.parametrize("extra, expect", [
    ([], (True, SchedulerOptions.dfa_max_states, SchedulerOptions.dfa_max_classes, None, None)),  # engine decides
    (["--no-handover", "--unread", "1"], (True, SchedulerOptions.dfa_max_states, SchedulerOptions.dfa_max_classes,
                                          False, 1)),
    (["--no-device-dfa", "--dfa-max-states", "64", "--dfa-max-classes", "32", "--handover", "--unread", "2"],
     (False, 64, 32, True, 2)),
])
def test_device_dfa_flags_reach_the_scheduler(tiny, monkeypatch, extra, expect):
    """--no-device-dfa / --dfa-max-states / --dfa-max-classes / --handover / --unread become the LLM's
    SchedulerOptions."""
    seen = llm_arguments(monkeypatch, ["generate", "--model", str(tiny), "--prompt", "w5", "--regex", "w[0-9]", *extra])
    s = seen["scheduler"]
    assert (s.device_dfa, s.dfa_max_states, s.dfa_max_classes, s.handover, s.unread) == expect


def test_bad_dfa_limit_is_a_usage_error(capsys, no_load):
    assert "argument --dfa-max-states: must be an integer >= 1, got 0" in usage_error(
        capsys, ["generate", "--prompt", "hi", "--dfa-max-states", "0"])


def test_steps_per_call_flags_reach_the_llm(tiny, monkeypatch):
    """--steps-per-call / --spec-steps-per-call become the LLM's (BatchOptions') steps per dispatch;
    0 is a usage error naming the flag, and BatchOptions refuses it too."""
    seen = llm_arguments(monkeypatch, ["generate", "--model", str(tiny), "--prompt", "w5", "--steps-per-call", "2",
                                       "--spec-steps-per-call", "3"])
    assert (seen["steps_per_call"], seen["spec_steps_per_call"]) == (2, 3)
    monkeypatch.undo()
    llm = specjax.llm.LLM(tiny, max_batch=1, max_seq_len=64, steps_per_call=2, spec_steps_per_call=3)
    assert (llm.engine.batch_opts.steps_per_call, llm.engine.batch_opts.spec_steps_per_call) == (2, 3)
    from specjax.engine import BatchOptions
    for name in ("steps_per_call", "spec_steps_per_call"):
        with pytest.raises(ValueError, match=name):
            BatchOptions(**{name: 0})


def test_bad_steps_per_call_is_a_usage_error(capsys, no_load):
    assert "argument --steps-per-call: must be an integer >= 1, got 0" in usage_error(
        capsys, ["generate", "--prompt", "hi", "--steps-per-call", "0"])


def test_ngram_branch_flag(tiny, monkeypatch, capsys):
    """--ngram-branch L: with a head (--draft) and no tree flags, the head's spec_defaults tree plus
    L n-gram nodes; with tree flags, those; without a draft, or for the n-gram drafter's own tree, or
    deeper than --num-steps: a usage error naming the flag."""
    from specjax.assets import DEFAULT_HEAD_DIR
    from specjax.checkpoint import head_spec_defaults
    seen = llm_arguments(monkeypatch, ["generate", "--model", str(tiny), "--prompt", "w5", "--draft",
                                       str(DEFAULT_HEAD_DIR), "--max-batch", "1", "--ngram-branch", "3"])
    kw, _ = head_spec_defaults(DEFAULT_HEAD_DIR, 1)
    s = seen["spec"]
    assert (s.method, s.num_steps, s.topk, s.num_draft_tokens, s.ngram_branch) == (
        "eagle3", kw["num_steps"], kw["topk"], kw["num_draft_tokens"], 3)
    assert s.num_nodes == kw["num_draft_tokens"] + 4
    seen = llm_arguments(monkeypatch, ["generate", "--model", str(tiny), "--prompt", "w5", "--draft",
                                       str(DEFAULT_HEAD_DIR), "--num-steps", "3", "--topk", "2", "--ngram-branch", "2"])
    assert (seen["spec"].num_steps, seen["spec"].topk, seen["spec"].ngram_branch) == (3, 2, 2)
    assert kw["ngram_branch"] == 7  # the shipped head's batch-1 default carries a branch; --ngram-branch 0: without
    seen = llm_arguments(monkeypatch, ["generate", "--model", str(tiny), "--prompt", "w5", "--draft",
                                       str(DEFAULT_HEAD_DIR), "--max-batch", "1", "--ngram-branch", "0"])
    assert (seen["spec"].num_draft_tokens, seen["spec"].ngram_branch) == (kw["num_draft_tokens"], 0)
    seen = llm_arguments(monkeypatch, ["generate", "--model", str(tiny), "--prompt", "w5", "--draft",
                                       str(DEFAULT_HEAD_DIR), "--max-batch", "1"])
    assert seen["spec"] is None  # no tree flags: the LLM takes the draft's spec_defaults, branch included
    monkeypatch.undo()
    assert "--ngram-branch adds to a draft's tree" in usage_error(capsys, ["generate", "--prompt", "hi",
                                                                           "--ngram-branch", "2"])
    assert "--ngram-branch=2 adds an n-gram branch to a model draft's tree" in usage_error(
        capsys, ["generate", "--prompt", "hi", "--speculate", "ngram", "--topk", "2", "--ngram-branch", "2"])
    assert "--ngram-branch must be an int in [0, --num-steps=3], got 4" in usage_error(
        capsys, ["generate", "--prompt", "hi", "--speculate", "head", "--num-steps", "3", "--topk", "2",
                 "--ngram-branch", "4"])
