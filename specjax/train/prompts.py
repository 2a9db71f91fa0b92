"""Training prompts for EAGLE-3 heads, built without the evaluation sets.

    self-instruct  the target writes user messages itself: its chat template up to the user turn,
                   then an opener of a few words that steers the kind (writing, coding, QA,
                   reasoning, extraction, roleplay, translation, advice, ...), sampled at T = 1,
                   top-p 0.95; deduplicated and filtered (length, repetition, template tokens)
    passages       task prompts over real text that ships with the installed Python (module,
                   class and function docstrings and source of the standard library and
                   site-packages, read with `ast`, nothing imported): summarize, answer from the
                   passage, extract fields, list key points, rewrite, translate, explain / document /
                   test / continue code, write code from a description
    -> jsonl rows {"prompt": ..., "source": "self-instruct" | "passage:<task>"}

The head is judged on kinds of prompts it never saw, so these aim for breadth, not for any one set.
"""
from __future__ import annotations

import ast
import json
import random
import re
import sys
import sysconfig
from pathlib import Path

OPENERS = {
    "writing": ["Write a short story about", "Write a poem about", "Write an email to", "Write a blog post on",
                "Write a product description for", "Draft a cover letter for", "Write a speech about",
                "Write a dialogue between", "Compose a haiku about", "Write a limerick about",
                "Write a persuasive essay arguing", "Write a tweet announcing"],
    "coding": ["Write a Python function that", "How do I", "Write a JavaScript function to", "Explain this code:",
               "Write a SQL query that", "What is the difference between a list and", "Fix the bug in",
               "Implement a class in Python that", "Write a bash script that", "How can I optimize",
               "Write a C function that", "What does this regular expression"],
    "qa": ["What is", "Why do", "How does", "Who was", "When did", "Where is", "Explain how",
           "What are the main causes of", "Can you explain", "What happens when", "Is it true that",
           "What are the benefits of"],
    "reasoning": ["Solve the following problem:", "If a train travels", "A farmer has", "Calculate the",
                  "What is the next number in the sequence", "Prove that", "Sarah has 5 apples and",
                  "Which is larger,", "A store sells", "How many ways can", "Estimate how many",
                  "If all cats are"],
    "extraction": ["Extract the names and dates from this text:", "Classify the following review as positive "
                   "or negative:", "List the key points of", "Convert the following data to JSON:",
                   "Summarize the following paragraph:", "Find all the email addresses in",
                   "Identify the main characters in", "Turn these notes into a table:"],
    "roleplay": ["Pretend you are", "You are a pirate captain.", "Imagine you are a detective and",
                 "Act as a travel guide and", "You are a customer support agent.", "Role-play as a teacher "
                 "explaining", "Let's play a game where you", "You are a medieval knight."],
    "translation": ["Translate into French:", "Translate the following sentence into Spanish:",
                    "How do you say", "Translate this paragraph to German:", "What does this Italian phrase mean:",
                    "Translate to English:"],
    "advice": ["Give me tips for", "How can I improve my", "What should I do if", "Suggest a plan for",
               "Recommend some books about", "What is the best way to", "Help me plan a", "Give me ideas for"],
    "chat": ["Hi! Can you", "Tell me about", "I'm feeling", "Do you know", "Tell me a joke about",
             "What do you think about", "Describe", "Compare"],
}

PASSAGE_TASKS = {
    "summarize": ["Summarize the following text in a few sentences:\n\n{doc}",
                  "Give a one-paragraph summary of this documentation:\n\n{doc}",
                  "TL;DR of the following:\n\n{doc}"],
    "rag": ["Answer the question using only the passage below.\n\nPassage:\n{doc}\n\nQuestion: What does "
            "`{name}` do?",
            "Read the documentation and answer.\n\n{doc}\n\nQuestion: What are the parameters of `{name}` and "
            "what does it return?",
            "Context:\n{doc}\n\nBased on the context, when would someone use `{name}`?"],
    "extract": ["Extract the function name, its parameters and its return value from this documentation as "
                "JSON:\n\n{doc}",
                "List the key points of the following text as bullet points:\n\n{doc}",
                "Extract every technical term from this text and define each in one line:\n\n{doc}"],
    "rewrite": ["Rewrite the following text in simpler words:\n\n{doc}",
                "Rewrite this documentation as a friendly explanation for a beginner:\n\n{doc}",
                "Make this text more concise:\n\n{doc}"],
    "translate": ["Translate the following text into French:\n\n{sent}",
                  "Translate the following text into Spanish:\n\n{sent}",
                  "Translate the following text into German:\n\n{sent}",
                  "Translate into Italian:\n\n{sent}", "Translate into Portuguese:\n\n{sent}"],
    "explain_code": ["Explain what this Python code does:\n\n```python\n{code}\n```",
                     "Walk me through this function step by step:\n\n```python\n{code}\n```"],
    "document_code": ["Write a docstring for this function:\n\n```python\n{code_nodoc}\n```",
                      "Add comments to this code:\n\n```python\n{code_nodoc}\n```"],
    "test_code": ["Write unit tests for this function:\n\n```python\n{code}\n```"],
    "continue_code": ["Continue this code:\n\n```python\n{code_head}"],
    "write_code": ["Write a Python function `{name}` that does the following: {first_line}"],
}


def _clean(text: str) -> str:
    return re.sub(r"\n{3,}", "\n\n", text.strip())


def source_files(limit: int, seed: int) -> list[Path]:
    """Python files of the standard library and site-packages (tests excluded), shuffled."""
    roots = {sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    files = []
    for r in sorted(roots):
        for f in Path(r).rglob("*.py"):
            s = str(f)
            if "/test" in s or "/tests/" in s or "__pycache__" in s or "/idle_test/" in s:
                continue
            files.append(f)
    files.sort()
    random.Random(seed).shuffle(files)
    return files[:limit]


def passages_of(path: Path, max_chars: int = 1200):
    """(name, docstring, source with docstring, source without it) of the documented functions and
    classes of one file, and the module docstring (name = module)."""
    try:
        src = path.read_text(encoding="utf-8")
        tree = ast.parse(src)
    except (OSError, SyntaxError, UnicodeDecodeError, ValueError, RecursionError):
        return
    mdoc = ast.get_docstring(tree)
    if mdoc and len(mdoc) > 200:
        yield path.stem, _clean(mdoc)[:max_chars], None, None
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        doc = ast.get_docstring(node)
        if not doc or len(doc) < 80 or node.name.startswith("_"):
            continue
        code = ast.get_source_segment(src, node)
        if not code or len(code) > max_chars * 2:
            code = None
        nodoc = None
        if code is not None and node.body and isinstance(node.body[0], ast.Expr):
            d = ast.get_source_segment(src, node.body[0])
            nodoc = code.replace(d, "", 1) if d else None
            nodoc = re.sub(r"\n\s*\n", "\n", nodoc) if nodoc else None
        yield node.name, _clean(doc)[:max_chars], code, nodoc


def worker_share(n: int, seed: int, worker: int, workers: int) -> tuple[int, int]:
    """(how many, seed) of one of `workers` processes making n prompts together: seed * workers +
    worker, disjoint between the workers of one seed (one worker: n and seed themselves)."""
    return n // workers + (worker < n % workers), seed * workers + worker


def passage_prompts(n: int, seed: int = 0, max_files: int = 40000, per_file: int = 6,
                    part: tuple[int, int] = (0, 1)) -> list[dict]:
    """n task prompts over docstrings and code of the installed Python (at most per_file passages
    of one file, for breadth), tasks drawn in turn. part (i, N): only every N-th file from the i-th
    (N processes over disjoint files; task choices seeded by worker_share's seed)."""
    i, workers = part
    rng = random.Random(seed * workers + i)
    tasks = list(PASSAGE_TASKS)
    out, seen = [], set()
    for f in source_files(max_files, seed)[i::workers]:
        for k, (name, doc, code, nodoc) in enumerate(passages_of(f)):
            if k >= per_file:
                break
            if len(out) >= n:
                return out
            task = tasks[len(out) % len(tasks)]
            needs = {"explain_code": code, "test_code": code, "continue_code": code, "document_code": nodoc}
            if task in needs and not needs[task]:
                task = rng.choice(["summarize", "rag", "extract", "rewrite", "translate"])
            sents = [s for s in re.split(r"(?<=[.!?])\s+", doc.replace("\n", " ")) if 30 < len(s) < 300]
            if task == "translate" and not sents:
                task = "summarize"
            key = (name, doc[:80], task)
            if key in seen:
                continue
            seen.add(key)
            lines = (code or "").splitlines()
            fields = {"doc": doc, "name": name, "code": code, "code_nodoc": nodoc,
                      "code_head": "\n".join(lines[: max(2, len(lines) // 2)]),
                      "first_line": doc.splitlines()[0].strip().rstrip("."),
                      "sent": " ".join(sents[:3])}
            out.append({"prompt": rng.choice(PASSAGE_TASKS[task]).format(**fields), "source": f"passage:{task}"})
    return out


def _ok(msg: str) -> bool:
    words = msg.split()
    if not 4 <= len(words) <= 300 or "<|" in msg or "|>" in msg:
        return False
    if len(words) > 20 and len(set(words)) / len(words) < 0.35:  # degenerate repetition
        return False
    return True


def self_instruct(llm, n: int, seed: int = 0, max_tokens: int = 96, batch: int = 4096,
                  log=lambda m: print(m, file=sys.stderr, flush=True)) -> list[dict]:
    """n user messages written by the target: chat template up to the user turn + an opener,
    sampled (T = 1, top-p 0.95), deduplicated (case-folded first 64 characters) and filtered."""
    from specjax import SamplingParams
    tmpl = llm.apply_chat_template([{"role": "user", "content": "\x00"}])
    prefix = tmpl[: tmpl.index("\x00")]  # everything before the user's text
    kinds = [(k, o) for k, ops in OPENERS.items() for o in ops]
    rng = random.Random(seed)
    out, seen, rounds = [], set(), 0
    while len(out) < n and rounds < 50:
        picks = [kinds[rng.randrange(len(kinds))] for _ in range(min(batch, 2 * (n - len(out)) + 64))]
        ids = [llm.tokenizer.encode(prefix + o, add_special_tokens=False) for _, o in picks]
        params = [SamplingParams(max_tokens=max_tokens, temperature=1.0, top_p=0.95,
                                 seed=seed * 7_919 + rounds * 1_000_003 + i) for i in range(len(picks))]
        for (kind, opener), o in zip(picks, llm.generate(ids, params)):
            if o.finish_reason != "stop":
                continue  # cut at max_tokens: not a complete message
            msg = (opener + o.text).strip()
            key = re.sub(r"\W+", " ", msg.lower())[:64]
            if key in seen or not _ok(msg):
                continue
            seen.add(key)
            out.append({"prompt": msg, "source": f"self-instruct:{kind}"})
        rounds += 1
        log(f"[prompts] self-instruct round {rounds}: {len(out)} / {n} kept")
    return out[:n]


def write_jsonl(rows: list[dict], path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    return path


def read_jsonl(path: str | Path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]
