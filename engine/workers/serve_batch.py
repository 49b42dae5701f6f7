"""Continuous batching for the server (engine.workers.serve): requests join and leave the running batch
between decode steps.

The running batch is one left-padded KV cache (transformers' DynamicCache) with its attention mask: every
row's tokens are the last columns of the mask, so a row is exactly what generate() would hold for its
prompt, with padding before it. Requests that arrive while the batch decodes are prefilled together in
one forward (left-padded among themselves, as generate() pads a batch), then their cache is padded on the
left to the batch's length and joins it; a row that ends (its stop, its limit, its client gone) is cut out,
and columns no row uses any more are cut off the left. Positions come from the mask, as in generate(), so
greedy tokens equal generate()'s for each prompt (up to rounding, which the tests check does not change a
token on the tiny models).

Everything here runs on the generation thread; the HTTP side hands requests in through `Batcher.submit`
and hears back through each request's `emit`, which must be thread-safe.
"""

from __future__ import annotations

import queue
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from rigpilot.engine.errors import UserError
from rigpilot.engine.workers.infer import next_token_logits, select_tokens
from rigpilot.engine.workers.serve_adapters import forward_kwargs

# How long the idle loop waits for a request before it looks at the stop flag again.
IDLE_POLL_S = 0.05


@dataclass
class Sampling:
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    logit_bias: dict[int, float] = field(default_factory=dict)  # OpenAI's: added to the token's logit


@dataclass
class Event:
    """What a request's client hears: new text, and once, why it ended with its token counts."""

    text: str
    finish_reason: str | None = None  # "stop" or "length" on the last event
    prompt_tokens: int = 0
    completion_tokens: int = 0


@dataclass
class Request:
    prompt_ids: list[int]
    max_tokens: int
    sampling: Sampling
    stop: list[str]
    emit: Callable[[Event], None]  # called on the generation thread
    cancelled: bool = False  # set by the HTTP side when its client left
    submitted_at: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    tokens: list[int] = field(default_factory=list)
    sent: str = ""  # text already emitted
    generator: torch.Generator | None = None
    adapter: str | None = None  # the LoRA adapter it runs (engine.workers.serve_adapters); None: the base


@dataclass
class Counters:
    """Running totals, read by the metrics reporter (same thread)."""

    finished: int = 0
    dropped: int = 0  # requests whose client left before they ended
    new_tokens: int = 0
    ttft_sum: float = 0.0
    ttft_count: int = 0


class KVBatch:
    """The running batch's tensors: its KV cache, its attention mask and each row's newest token (not yet in
    the cache), and the forwards that grow them. Rows are only numbers here; which request a row is, is the
    Batcher's. On tensor parallel ranks each rank holds its heads' share of the cache and does exactly what
    rank 0 does, told by engine.workers.serve_lockstep."""

    def __init__(self, model: torch.nn.Module, config: Any, device: torch.device, forward: Any = None) -> None:
        """`forward(model, ids, mask, positions, cache, **extra)`: one forward, the next-token logits (on the rank
        that chooses tokens; None on a pipeline stage that only passes hidden states on); next_token_logits
        by default."""
        self.model, self.config, self.device = model, config, device
        self.forward = forward or next_token_logits
        self.cache: Any = None
        self.mask: torch.Tensor | None = None
        self.last: torch.Tensor | None = None

    @property
    def size(self) -> int:
        return 0 if self.mask is None else int(self.mask.shape[0])

    @property
    def kv_cache_bytes(self) -> int:
        """What the running batch's KV cache holds now, padding included."""
        if self.cache is None:
            return 0
        return sum(t.numel() * t.element_size() for layer in _held(self.cache) for t in (layer.keys, layer.values))

    def prefill(self, ids: torch.Tensor, mask: torch.Tensor, **extra: Any) -> torch.Tensor | None:
        """Run new rows' prompts (left-padded `ids`, `mask`) and join them to the batch: their next-token logits."""
        from transformers import DynamicCache

        positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)
        cache = DynamicCache(config=self.config)
        logits = self.forward(self.model, ids, mask, positions, cache, **extra)
        self._join(cache, mask)
        return logits

    def decode(self, **extra: Any) -> torch.Tensor | None:
        """One step of every row: each row's newest token into the cache; the next-token logits."""
        assert self.mask is not None and self.last is not None
        self.mask = torch.cat([self.mask, torch.ones_like(self.mask[:, :1])], dim=1)
        positions = self.mask.sum(-1, keepdim=True) - 1
        return self.forward(self.model, self.last[:, None], self.mask, positions, self.cache, **extra)

    def set_last(self, start: int, tokens: torch.Tensor) -> None:
        """Rows `start`… chose `tokens`: their newest, fed to the next decode."""
        assert self.last is not None
        self.last[start : start + len(tokens)] = tokens

    def _join(self, cache: Any, mask: torch.Tensor) -> None:
        """Pad the newcomers' cache or the batch's on the left to one length, and stack them."""
        new_last = torch.zeros(mask.shape[0], dtype=torch.long, device=self.device)
        if self.mask is None:
            self.cache, self.mask, self.last = cache, mask, new_last
            return
        assert self.last is not None
        width = max(self.mask.shape[1], mask.shape[1])
        for old, new in zip(_held(self.cache), _held(cache), strict=True):
            old.keys = torch.cat([_pad_left(old.keys, width, dim=-2), _pad_left(new.keys, width, dim=-2)])
            old.values = torch.cat([_pad_left(old.values, width, dim=-2), _pad_left(new.values, width, dim=-2)])
        self.mask = torch.cat([_pad_left(self.mask, width, dim=1), _pad_left(mask, width, dim=1)])
        self.last = torch.cat([self.last, new_last])

    def keep(self, keep: list[int]) -> None:
        """Cut the batch down to the rows `keep`, and the columns no row uses any more off the left."""
        if len(keep) == self.size:
            return
        if not keep:
            self.cache, self.mask, self.last = None, None, None
            return
        assert self.mask is not None and self.last is not None
        index = torch.tensor(keep, device=self.device)
        self.mask, self.last = self.mask[index], self.last[index]
        unused = int((self.mask.sum(0) == 0).long().cumprod(0).sum())  # leading columns padding in every row
        self.mask = self.mask[:, unused:]
        for layer in _held(self.cache):
            layer.keys = layer.keys[index, :, unused:]
            layer.values = layer.values[index, :, unused:]


class Batcher:
    """Requests in, rows of the running batch (`kv`: a KVBatch, or on tensor parallel ranks one that tells the
    other ranks each step, engine.workers.serve_lockstep), tokens chosen and sent back."""

    def __init__(self, kv: Any, tokenizer: Any, config: Any, device: torch.device,
                 max_batch: int, seed: int, adapters: bool = False) -> None:  # fmt: skip
        self.kv, self.tok, self.config, self.device = kv, tokenizer, config, device
        self.adapters = adapters  # whether the model is a peft model whose rows each name their adapter
        self.max_batch = max_batch
        self.eos = tokenizer.eos_token_id
        self.pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (self.eos or 0)
        self.seeds = torch.Generator().manual_seed(seed)  # seeds of requests that bring none
        self.inbox: queue.Queue[Request] = queue.Queue()
        self.waiting: list[Request] = []
        self.rows: list[Request] = []
        self.counters = Counters()
        _check_cache(config)

    def submit(self, request: Request) -> None:
        """Thread-safe: the HTTP side's way in."""
        self.inbox.put(request)

    @property
    def busy(self) -> bool:
        return bool(self.rows or self.waiting or not self.inbox.empty())

    @property
    def kv_cache_bytes(self) -> int:
        return int(self.kv.kv_cache_bytes)

    @property
    def queue_depth(self) -> int:
        return len(self.waiting) + self.inbox.qsize()

    @torch.no_grad()
    def run_once(self) -> None:
        """Take in new requests, admit what fits, and run one decode step of the batch."""
        self._take_inbox(block=not self.rows and not self.waiting)
        self.waiting = [r for r in self.waiting if not self._dropped(r)]
        self._keep([i for i, r in enumerate(self.rows) if not self._dropped(r)])
        room = self.max_batch - len(self.rows)
        if room > 0 and self.waiting:
            joining, self.waiting = self.waiting[:room], self.waiting[room:]
            self._prefill(joining)
        if self.rows:
            self._decode()

    def drop_all(self) -> int:
        """Drop every request left (the server is stopping); how many there were."""
        self._take_inbox(block=False)
        left = len(self.rows) + len(self.waiting)
        self.counters.dropped += left
        self.waiting = []
        self._keep([])
        return left

    # --- admission ----------------------------------------------------------------------------

    def _take_inbox(self, block: bool) -> None:
        try:
            if block:
                self.waiting.append(self.inbox.get(timeout=IDLE_POLL_S))
            while True:
                self.waiting.append(self.inbox.get_nowait())
        except queue.Empty:
            pass

    def _dropped(self, r: Request) -> bool:
        if r.cancelled:
            self.counters.dropped += 1
        return r.cancelled

    def _prefill(self, joining: list[Request]) -> None:
        width = max(len(r.prompt_ids) for r in joining)
        ids = torch.full((len(joining), width), self.pad, dtype=torch.long)
        mask = torch.zeros((len(joining), width), dtype=torch.long)
        for i, r in enumerate(joining):
            ids[i, width - len(r.prompt_ids) :] = torch.tensor(r.prompt_ids)
            mask[i, width - len(r.prompt_ids) :] = 1
            if r.sampling.temperature > 0:
                seed = (
                    r.sampling.seed
                    if r.sampling.seed is not None
                    else int(torch.randint(2**62, (1,), generator=self.seeds))
                )
                r.generator = torch.Generator(device=self.device).manual_seed(seed)
        logits = self.kv.prefill(ids.to(self.device), mask.to(self.device), **self._adapter_kwargs(joining))
        assert logits is not None  # rank 0, which chooses the tokens, always has them
        self.rows += joining
        self._take(joining, logits, range(len(self.rows) - len(joining), len(self.rows)))

    def _keep(self, keep: list[int]) -> None:
        """Cut the batch down to the rows `keep`."""
        if len(keep) == len(self.rows):
            return
        self.rows = [self.rows[i] for i in keep]
        self.kv.keep(keep)

    # --- decoding -----------------------------------------------------------------------------

    def _decode(self) -> None:
        logits = self.kv.decode(**self._adapter_kwargs(self.rows))
        assert logits is not None
        self._take(self.rows, logits, range(len(self.rows)))

    def _adapter_kwargs(self, rows: list[Request]) -> dict[str, Any]:
        return forward_kwargs([r.adapter for r in rows] if self.adapters else None)

    def _take(self, rows: list[Request], logits: torch.Tensor, at: range) -> None:
        """Choose each row's next token, tell its client, and cut out the rows that ended."""
        for i, r in enumerate(rows):
            if r.sampling.logit_bias:
                ids = torch.tensor(list(r.sampling.logit_bias), device=logits.device)
                logits[i, ids] += torch.tensor(list(r.sampling.logit_bias.values()), device=logits.device)
        chosen = logits.argmax(dim=-1)
        for i, r in enumerate(rows):
            if r.sampling.temperature > 0:
                assert r.generator is not None
                chosen[i] = select_tokens(logits[i : i + 1], r.sampling.temperature, r.sampling.top_p, r.generator)[0]
        self.kv.set_last(at.start, chosen)
        now = time.perf_counter()
        ended = set()
        for i, (r, token) in enumerate(zip(rows, chosen.tolist(), strict=True)):
            if r.first_token_at is None:
                r.first_token_at = now
                self.counters.ttft_sum += now - r.submitted_at
                self.counters.ttft_count += 1
            r.tokens.append(token)
            self.counters.new_tokens += 1
            if self._emit(r):
                ended.add(at.start + i)
        if ended:
            self._keep([i for i in range(len(self.rows)) if i not in ended])

    def _emit(self, r: Request) -> bool:
        """Send `r`'s new text; whether it has ended (end of sequence, a stop string, its token limit)."""
        text = self.tok.decode(r.tokens, skip_special_tokens=True)
        hits = [i for i in (text.find(s) for s in r.stop) if i >= 0]
        finish = None
        if hits:
            text, finish = text[: min(hits)], "stop"
        elif self.eos is not None and r.tokens[-1] == self.eos:
            finish = "stop"
        elif len(r.tokens) >= r.max_tokens:
            finish = "length"
        if finish is None:
            text = _safe_prefix(text, r.stop)
        new = text[len(r.sent) :] if text.startswith(r.sent) else ""
        if finish is not None:
            r.sent += new
            r.emit(Event(new, finish, len(r.prompt_ids), len(r.tokens)))
            self.counters.finished += 1
            return True
        if new:
            r.sent += new
            r.emit(Event(new))
        return False


def _held(cache: Any) -> list[Any]:
    """The cache's layers this rank fills: all of them, or a pipeline stage's own (the others stay empty)."""
    return [layer for layer in cache.layers if layer.is_initialized]


def _check_cache(config: Any) -> None:
    """Refuse a model whose KV cache is not one plain tensor per layer (sliding-window or static layers): padding
    and cutting columns on the left, as joining and leaving the batch do, would misplace its positions."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    kinds = {type(layer).__name__ for layer in DynamicCache(config=config).layers if type(layer) is not DynamicLayer}
    if kinds:
        raise UserError(
            f"serving a model with {', '.join(sorted(kinds))} cache layers (sliding-window attention) is not yet in "
            "this version", reason="serve_model_unsupported", layers=sorted(kinds),
        )  # fmt: skip


def _safe_prefix(text: str, stops: list[str]) -> str:
    """What of `text` can be sent now: not a trailing half character (U+FFFD until its bytes are all there),
    nor a tail that may yet grow into a stop string (which must never reach the client)."""
    text = text.rstrip("\ufffd")
    hold = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), hold, -1):
            if text.endswith(s[:n]):
                hold = n
                break
    return text[: len(text) - hold]


def _pad_left(t: torch.Tensor, width: int, dim: int) -> torch.Tensor:
    missing = width - t.shape[dim]
    if missing == 0:
        return t
    pads = [0, 0] * (t.dim() - 1 - (dim % t.dim())) + [missing, 0]
    return F.pad(t, pads)
