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
    finish_reason: str | None  # "stop" | "length" | "error" | "cancelled"
    logprobs: list[dict[int, float]] | None = None
    accept_len_mean: float | None = None  # speculative decoding: mean tokens emitted per step
    error: str | None = None  # why the request failed (finish_reason "error")
    num_cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache (first admission)


class Request:
    """One request's generation state. `append` returns True once it has finished.

    With a grammar (`grammar`, a specjax.grammar.RequestGrammar set by the engine) every appended
    token advances the matcher; the request finishes ("stop") when the grammar terminates.
    """

    def __init__(self, request_id: int, prompt: str | None, prompt_ids: list[int], params: SamplingParams,
                 tokenizer, eos_ids: tuple[int, ...], max_seq_len: int, seed: int):
        self.id = request_id
        self.seed = seed  # params.seed, or one drawn by the caller
        self.prompt = prompt
        self.prompt_ids = list(prompt_ids)
        self.params = params
        self.tokenizer = tokenizer
        self.eos_ids = tuple(eos_ids)
        self.stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_ids))
        self.max_len = min(params.max_tokens, max_seq_len - len(self.prompt_ids))
        self.token_ids: list[int] = []
        self.logprobs: list[dict[int, float]] | None = [] if params.logprobs is not None else None
        self.text = ""
        self.finish_reason: str | None = None
        self.accept_lens: list[int] = []  # tokens emitted by each speculative step
        self._scan_from = 0  # text length already searched for stop strings
        self._stop_cut: int | None = None  # text offset where a stop string begins
        self.error: str | None = None
        self.grammar = None  # specjax.grammar.RequestGrammar of a constrained request
        # engine / scheduler bookkeeping
        self.slot: int | None = None
        self.arrival = 0  # submission order (preemption retracts the youngest)
        self.epoch = 0  # bumped on preemption: outputs of steps dispatched before are dropped
        self.num_preempted = 0
        self.num_cached_tokens = 0  # prompt tokens reused from the prefix cache at the first admission
        self.tree = None  # host copy (tokens [N], parents [N]) of the draft tree it verifies next
        self._streamed = ""  # text handed out by take_text_delta

    @property
    def prefill_ids(self) -> list[int]:
        """What a (re)admission prefills: the prompt plus the tokens generated so far."""
        return self.prompt_ids + self.token_ids

    def fail(self, reason: str) -> None:
        """Finish with finish_reason "error" (invalid constraint, prompt, ...)."""
        if not self.finished:
            self.finish_reason, self.error = "error", reason

    def cancel(self) -> None:
        if not self.finished:
            self.finish_reason = "cancelled"

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
        if self.grammar is not None and not self._advance_grammar(token):
            return True
        if token in self.stop_ids or (self.grammar is not None and self.grammar.is_terminated):
            self.finish_reason = "stop"
        elif self.params.stop and self._hit_stop_string():
            self.finish_reason = "stop"
        elif len(self.token_ids) >= self.max_len:
            self.finish_reason = "length"
        return self.finished

    def _advance_grammar(self, token: int) -> bool:
        from specjax.grammar import GrammarStateError
        try:
            self.grammar.accept([token])
            return True
        except GrammarStateError as e:  # masked decoding never gets here; fail this request only
            self.fail(str(e))
            return False

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

    def final_text(self) -> str:
        text = self.decode()
        return text if self._stop_cut is None else text[: self._stop_cut]

    def take_text_delta(self) -> str:
        """Text generated since the last call (streaming). Until the request finishes, the tail
        that a stop string could still cut and incomplete UTF-8 (U+FFFD) are held back, so the
        deltas concatenate to the final text."""
        if self.finished:
            text = self.final_text()
        else:
            text = self.decode().rstrip("\ufffd")
            text = text[: max(len(text) - max((len(s) for s in self.params.stop), default=1) + 1, 0)]
        if not text.startswith(self._streamed) or len(text) <= len(self._streamed):
            return ""
        delta, self._streamed = text[len(self._streamed):], text
        return delta

    def output(self) -> RequestOutput:
        self.text = self.final_text()
        mean = sum(self.accept_lens) / len(self.accept_lens) if self.accept_lens else None
        return RequestOutput(self.id, self.prompt, self.prompt_ids, self.text, list(self.token_ids),
                             self.finish_reason, self.logprobs, mean, self.error, self.num_cached_tokens)
