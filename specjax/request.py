"""Host-side per-request bookkeeping: output tokens, detokenized text, stop conditions.

Host work per delivered token is O(1) in the output length: tokens arrive in bursts (one engine
step's tokens, `Request.extend`), stop ids, the length limit and the grammar's end (its matcher fed
token by token within the one call) are found in the burst, and the
text is decoded incrementally (specjax.detokenize) only where it is needed: stop strings (searched
in the new text only), streaming deltas and the final output."""
from __future__ import annotations

import dataclasses

from specjax.detokenize import IncrementalDetokenizer
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
    constraint_path: str | None = None  # a constrained request: "device_dfa" or "host_grammar" (specjax.engine_dfa)
    dfa_fallback: str | None = None  # why a regex / choice / schema constraint did not run on the device DFA


class Request:
    """One request's generation state. `extend` / `append` return True once it has finished.

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
        self.accept_ema: float | None = None  # estimate of tokens per fused step (specjax.adaptive)
        self._detok = IncrementalDetokenizer(tokenizer, self.token_ids)  # the output's text
        self._max_stop = max(map(len, params.stop), default=0)
        self._per_token_stops = any("\ufffd" in s for s in params.stop)  # may match an incomplete character
        self._scanned = 0  # text searched for stop strings and stable since
        self._stop_cut: int | None = None  # text offset where a stop string begins
        self.error: str | None = None
        self.grammar = None  # specjax.grammar.RequestGrammar of a constrained request
        self.dfa = None  # specjax.dfa_routing.DeviceDFA: the constraint runs on the device (no matcher here)
        self.constraint_path: str | None = None  # "device_dfa" | "host_grammar" for a constrained request
        self.dfa_fallback: str | None = None  # why a regex / choice / schema constraint took the host path
        # engine / scheduler bookkeeping
        self.slot: int | None = None
        self.arrival = 0  # submission order (preemption retracts the youngest)
        self.epoch = 0  # bumped on preemption: outputs of steps dispatched before are dropped
        self.num_preempted = 0
        self.num_cached_tokens = 0  # prompt tokens reused from the prefix cache at the first admission
        self.tree = None  # host copy (tokens [N], parents [N]) of the draft tree it verifies next
        self._streamed = 0  # characters handed out by take_text_delta

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
        return self.extend([token], None if logprob is None else [logprob], None if top is None else [top])

    def extend(self, tokens: list[int], logprobs: list[float] | None = None,
               tops: list[list[tuple[int, float]]] | None = None) -> bool:
        """Append tokens (with their logprob and top-logprobs when requested) up to the one that
        finishes the request; the rest are dropped. The same as appending them one at a time, with
        host work proportional to the new tokens. Returns whether the request has finished."""
        if self.finished:
            return True
        start = len(self.token_ids)
        room = max(self.max_len - start, 1)
        n, reason = len(tokens), None
        if n >= room:
            n, reason = room, "length"
        if not self.stop_ids.isdisjoint(tokens[:n]):
            n, reason = next(i for i in range(n) if tokens[i] in self.stop_ids) + 1, "stop"
        if self.grammar is not None and n:
            n, reason, error = self._advance_grammar(tokens, n, reason)
            if error is not None:
                return self._grammar_failed(tokens, n, logprobs, tops, error)
        self.token_ids.extend(map(int, tokens[:n]))
        if self.params.stop and n:
            n, reason = self._stop_strings(start, n, reason)
        self._add_logprobs(logprobs, tops, n)
        self.finish_reason = reason
        return self.finished

    def _add_logprobs(self, logprobs, tops, n: int) -> None:
        if self.logprobs is None:
            return
        for k in range(n):
            entry = {int(self.token_ids[-n + k]): float(logprobs[k])}
            for tid, lp in (tops[k] if tops else [])[: self.params.logprobs]:
                entry.setdefault(int(tid), float(lp))
            self.logprobs.append(entry)

    def _stop_strings(self, start: int, n: int, reason: str | None) -> tuple[int, str | None]:
        """Stop strings over the n tokens appended after `start`: (tokens kept, finish reason). A
        stop string ends generation at the token that completes it, unless that token is a stop id
        (which stops first, the text uncut)."""
        d = self._detok
        if n > 1 and not self._per_token_stops:  # the burst at once; token by token only if a stop string occurs
            mark, scanned = d.mark(), self._scanned
            if self._find_stop(start + n) is None:
                return n, reason
            d.rewind(mark)
            self._scanned = scanned
        for end in range(start + 1, start + n + 1):
            if end == start + n and reason == "stop":  # a stop id (or the grammar) ends here
                return n, reason
            cut = self._find_stop(end)
            if cut is not None:
                self._stop_cut = cut
                del self.token_ids[end:]
                return end - start, "stop"
        return n, reason

    def _find_stop(self, end: int) -> int | None:
        """Where the first stop string begins in the text of token_ids[:end] (None: nowhere). Text
        scanned before and stable since is not searched again."""
        d = self._detok
        d.update(end)
        lo = max(0, self._scanned - self._max_stop + 1)  # a stop string ending in new text starts here or later
        recent = d.suffix(lo)
        self._scanned = d.stable
        hits = [i for i in (recent.find(s) for s in self.params.stop) if i >= 0]
        return lo + min(hits) if hits else None

    def _advance_grammar(self, tokens, n: int, reason: str | None) -> tuple[int, str | None, str | None]:
        """Feed tokens[:n] to the matcher, which decides token by token: (n, reason, error), cut at
        the token that terminates the grammar (reason "stop") or at the one it fails on (error: why)."""
        from specjax.grammar import GrammarStateError
        g = self.grammar
        before = g.num_accepted
        try:
            k, ended = g.advance(tokens[:n])
        except GrammarStateError as e:  # masked decoding never gets here; fail this request only
            return g.num_accepted - before + 1, None, str(e)
        except Exception as e:  # noqa: BLE001 - the matcher itself broke: this request fails, no other
            return g.num_accepted - before + 1, None, f"grammar error during generation: {type(e).__name__}: {e}"
        return (k, "stop", None) if ended else (n, reason, None)

    def _grammar_failed(self, tokens, n: int, logprobs, tops, error: str) -> bool:
        """The grammar failed on tokens[n - 1]: the request fails with it as its last token, unless a
        stop string ends the output before (as when the tokens arrive one at a time)."""
        start = len(self.token_ids)
        self.token_ids.extend(map(int, tokens[: n - 1]))
        if self.params.stop and n > 1:
            kept, reason = self._stop_strings(start, n - 1, None)
            if reason == "stop":
                self._add_logprobs(logprobs, tops, kept)
                self.finish_reason = reason
                return True
        self.token_ids.append(int(tokens[n - 1]))
        self._add_logprobs(logprobs, tops, n)
        self.fail(error)
        return True

    def final_text(self) -> str:
        self._detok.update()
        text = self._detok.text()
        return text if self._stop_cut is None else text[: self._stop_cut]

    def take_text_delta(self) -> str:
        """Text generated since the last call (streaming). Until the request finishes, text that
        may still change (an incomplete UTF-8 character, an open byte-fallback run) and the tail
        that a stop string could still cut are held back, so the deltas concatenate to the final
        text."""
        d = self._detok
        d.update()
        if self.finished:
            end = len(d) if self._stop_cut is None else self._stop_cut
        else:  # text that no later token changes, less what a stop string could still cut
            end = d.stable if not d.whole else len(d.text().rstrip("\ufffd"))
            end -= self._max_stop - 1 if self.params.stop else 0
        if end <= self._streamed:
            return ""
        delta, self._streamed = d.suffix(self._streamed, end), end
        return delta

    def output(self) -> RequestOutput:
        self.text = self.final_text()
        mean = sum(self.accept_lens) / len(self.accept_lens) if self.accept_lens else None
        return RequestOutput(self.id, self.prompt, self.prompt_ids, self.text, list(self.token_ids),
                             self.finish_reason, self.logprobs, mean, self.error, self.num_cached_tokens,
                             self.constraint_path, self.dfa_fallback)
