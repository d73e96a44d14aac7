"""One generation request: ids, sampling state, incremental text with stop strings, timings, events."""
from __future__ import annotations

import queue
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from trtkv.runtime.sampling import SamplingParams


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" (EOS or stop string) | "length" | "cancelled" | "error"
    stats: dict[str, Any] = field(default_factory=dict)
    prompt: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {"text": self.text, "token_ids": self.token_ids, "finish_reason": self.finish_reason,
                "stats": self.stats}


@dataclass
class StreamEvent:
    text: str  # new text since the previous event
    token_ids: list[int]  # new token ids
    finished: bool = False
    result: GenerationResult | None = None  # on the last event
    error: str | None = None


class IncrementalDetokenizer:
    """Text of a growing id list, decoding only a short window per new token (not the whole output).

    The window starts a few tokens back (``prefix``) because byte-level BPE merges and leading spaces make a
    token's text depend on its neighbours: the new text is ``decode(ids[prefix:]) - decode(ids[prefix:read])``.
    While the newest bytes end in an incomplete UTF-8 character (U+FFFD) nothing is emitted, so multi-byte
    characters are never split (vLLM's ``detokenize_incrementally`` rule)."""

    def __init__(self, decode):
        self.decode = decode
        self.text = ""
        self.prefix = 0  # first token of the decode window
        self.read = 0  # tokens whose text is already in ``text``

    def push(self, ids: list[int]) -> str:
        """Take the whole id list (only its new tail is decoded); returns the text so far."""
        if len(ids) <= self.read:
            return self.text
        before = self.decode(ids[self.prefix:self.read])
        after = self.decode(ids[self.prefix:])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self.text += after[len(before):]
            self.prefix, self.read = self.read, len(ids)
        elif after == before:  # tokens with no text (skipped specials): keep the window short
            self.read = len(ids)
            self.prefix = max(self.prefix, self.read - 6)
        return self.text


class Request:
    def __init__(self, req_id: int, prompt: str, prompt_ids: list[int], params: SamplingParams,
                 generator: torch.Generator, max_positions: int):
        self.req_id = req_id
        self.prompt = prompt
        self.prompt_ids = prompt_ids
        self.params = params
        self.generator = generator
        self.max_new = min(params.max_tokens, max_positions - len(prompt_ids))
        self.generated: list[int] = []
        self.forced_tokens: list[int] | None = None  # teacher forcing (eval): appended instead of sampled tokens
        self._text = ""
        self._text_cut = False  # a stop string cut the text: it no longer follows the ids
        self.detok: IncrementalDetokenizer | None = None
        self.emitted_chars = 0
        self.emitted_tokens = 0
        self.finish_reason: str | None = None
        self.ctx = None  # RequestContext, set at admission
        self.events: queue.Queue[StreamEvent] | None = None
        self.cancelled = False
        self.t_submit = time.perf_counter()
        self.t_first: float | None = None
        self.t_end: float | None = None
        self.decode_steps = 0
        self.peak_live_tokens = 0
        self.result: GenerationResult | None = None
        self._step_logits: torch.Tensor | None = None  # the newest step's logits: [V], or the batch's [b, V] ...
        self._step_row = -1  # ... and this request's row of them
        self.forks: list[Request] = []  # SamplingParams(n=K): the K-1 sibling samples forked after prefill
        self.sample_index = 0  # which of the n samples this request is
        self.kv_pages: dict[str, int] | None = None  # pages per (layer, format) pool admission reserves
        self.kv_groups: dict[str, int] | None = None  # key-scale groups per arena admission reserves (if any)
        self.error: str | None = None  # why the request failed (finish_reason "error")

    @property
    def text(self) -> str:
        """The output's text so far. Decoded when read, not token by token: a step whose text nobody reads (no
        stop strings, no stream) decodes nothing."""
        if self.detok is not None and not self._text_cut and self.detok.read < len(self.generated):
            self._text = self.detok.push(self.generated)
        return self._text

    def cut_text(self, at: int) -> None:
        """End the text at ``at`` (before a stop string); later tokens no longer change it."""
        self._text = self.text[:at]
        self._text_cut = True

    @property
    def last_logits(self) -> torch.Tensor | None:
        """``[V]`` logits of the newest step (forks and search trees sample and score from them)."""
        if self._step_logits is None or self._step_row < 0:
            return self._step_logits
        return self._step_logits[self._step_row]

    @last_logits.setter
    def last_logits(self, row: torch.Tensor | None) -> None:
        self._step_logits, self._step_row = row, -1

    def set_step_logits(self, logits: torch.Tensor, row: int) -> None:
        """The newest step's logits are row ``row`` of the batch's ``logits [b, V]`` (a view made when read, not a
        view a request every step)."""
        self._step_logits, self._step_row = logits, row

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def pending_text(self) -> tuple[str, list[int]]:
        """Text and ids not emitted yet, holding back what could still become a stop string or an
        incomplete UTF-8 character."""
        text = self.text
        if not self.finished:
            hold = 0
            if text.endswith("\ufffd"):
                hold = 1
            for s in self.params.stop:
                for k in range(min(len(s) - 1, len(text)), 0, -1):
                    if text.endswith(s[:k]):
                        hold = max(hold, k)
                        break
            text = text[: len(text) - hold] if hold else text
        delta = text[self.emitted_chars:]
        ids = self.generated[self.emitted_tokens:]
        return delta, ids

    def take_pending(self) -> tuple[str, list[int]]:
        delta, ids = self.pending_text()
        self.emitted_chars += len(delta)
        self.emitted_tokens += len(ids)
        return delta, ids
