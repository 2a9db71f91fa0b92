"""Host-side per-request bookkeeping: output tokens, detokenized text, stop conditions."""
from __future__ import annotations

import dataclasses

from specjax.sampling_params import SamplingParams


@dataclasses.dataclass
class RequestOutput:
    request_id: int
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop" | "length"
    logprobs: list[dict[int, float]] | None = None
    accept_len_mean: float | None = None  # speculative decoding: mean tokens emitted per step


class Request:
    """One request's generation state. `append` returns True once it has finished."""

    def __init__(self, request_id: int, prompt: str | None, prompt_ids: list[int], params: SamplingParams,
                 tokenizer, eos_ids: tuple[int, ...], max_seq_len: int, seed: int):
        self.id = request_id
        self.seed = seed  # params.seed, or one drawn by the caller
        self.prompt = prompt
        self.prompt_ids = list(prompt_ids)
        self.params = params
        self.tokenizer = tokenizer
        self.stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_ids))
        self.max_len = min(params.max_tokens, max_seq_len - len(self.prompt_ids))
        self.token_ids: list[int] = []
        self.logprobs: list[dict[int, float]] | None = [] if params.logprobs is not None else None
        self.text = ""
        self.finish_reason: str | None = None
        self.accept_lens: list[int] = []  # tokens emitted by each speculative step
        self._scan_from = 0  # text length already searched for stop strings
        self._stop_cut: int | None = None  # text offset where a stop string begins

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def append(self, token: int, logprob: float | None = None, top: list[tuple[int, float]] | None = None) -> bool:
        if self.finished:
            return True
        self.token_ids.append(int(token))
        if self.logprobs is not None:
            entry = {int(token): float(logprob)}
            for tid, lp in (top or [])[: self.params.logprobs]:
                entry.setdefault(int(tid), float(lp))
            self.logprobs.append(entry)
        if token in self.stop_ids:
            self.finish_reason = "stop"
        elif self.params.stop and self._hit_stop_string():
            self.finish_reason = "stop"
        elif len(self.token_ids) >= self.max_len:
            self.finish_reason = "length"
        return self.finished

    def _hit_stop_string(self) -> bool:
        text = self.decode()
        hits = [i for i in (text.find(s, max(0, self._scan_from - len(s) - 8)) for s in self.params.stop) if i >= 0]
        self._scan_from = len(text)
        if not hits:
            return False
        self._stop_cut = min(hits)
        return True

    def decode(self) -> str:
        return self.tokenizer.decode(self.token_ids, skip_special_tokens=True)

    def output(self) -> RequestOutput:
        text = self.decode()
        if self._stop_cut is not None:
            text = text[: self._stop_cut]
        self.text = text
        mean = sum(self.accept_lens) / len(self.accept_lens) if self.accept_lens else None
        return RequestOutput(self.id, self.prompt, self.prompt_ids, text, list(self.token_ids),
                             self.finish_reason, self.logprobs, mean)
