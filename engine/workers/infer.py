"""Sharded generation (kind "infer"): prompts in, output/results.jsonl out.

The model is split over the ranks of one replica by pipeline (contiguous layer
ranges per rank; hidden states go stage to stage, each stage keeping the KV
cache of its own layers, with one micro-batch in flight per stage and one
more so that the stages overlap, and prompts prefilled in chunks so that the
pipeline fills after one chunk) or by tensor parallelism (DTensor
projections; every rank runs the whole forward). Data parallel degrees make
replicas, each generating its share of the prompts.

Decoding follows transformers' generate(): left padding, positions from the
attention mask, and the same causal masks, so greedy output equals the unsplit
model's token for token. Metrics are written once per batch, never per token;
the job's tokens/s is every generated token over the generation's one wall
time (run_infer)."""

from __future__ import annotations

import functools
import inspect
import json
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from rigpilot.engine.errors import UserError
from rigpilot.engine.jobspec.spec import InferSettings, JobSpec
from rigpilot.engine.report import report
from rigpilot.engine.workers import EXIT_OK
from rigpilot.engine.workers.metrics import peak_memory, status, world_sums
from rigpilot.engine.workers.model_loading import load_model
from rigpilot.engine.workers.parallel_dims import Runtime, init_runtime
from rigpilot.engine.workers.parallelize import apply_tensor_parallel, precision_dtype
from rigpilot.engine.workers.pipeline import DecoderStage, decoder_parts
from rigpilot.engine.workers.prompts import read_prompts

# Positions per prefill forward in a pipeline (Generator._prefill_chunks): small enough that the next stage
# starts soon, large enough that each chunk's fixed cost (reading every weight) stays a small part.
PREFILL_CHUNK = 16
# A job of a few prompts (the app's "Try it", a terminal's `run infer --prompt`) streams its completions as
# they grow, every STREAM_EVERY_S at most: a person waits for them. Larger batches are read when done.
STREAM_PROMPTS = 4
STREAM_EVERY_S = 0.25


def load_prompts(s: InferSettings) -> list[str]:
    return read_prompts(s.prompts_file, s.prompts)


def select_tokens(logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator) -> torch.Tensor:
    """Greedy at temperature 0; otherwise nucleus sampling from a seeded generator."""
    if temperature <= 0:
        return logits.argmax(dim=-1)
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        drop = sorted_probs.cumsum(dim=-1) - sorted_probs >= top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def next_token_logits(
    model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, cache: Any, **extra: Any
) -> torch.Tensor:
    """One forward of a whole causal LM (or its TP shard) against `cache`: each row's next-token logits, fp32.

    The head runs on the last position only (transformers' `logits_to_keep`, as its generate() does):
    over every prompt position a prefill would hold batch × prompt × vocab logits, on a 128k vocabulary
    more than all of a layer's activations. A model whose forward lacks the argument (some remote
    code) gets the whole head: whatever it does after the head (scaling, soft-capping) stays its own.
    `extra`: more arguments of the forward (a served peft model's `adapter_names`).
    """
    # A peft wrapper takes **kwargs and hands them on: what the head takes is its base model's to say.
    inner: torch.nn.Module = getattr(model, "get_base_model", lambda: model)()
    out = model(
        input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache, use_cache=True,
        **_keep_last(type(inner)), **extra,
    )  # fmt: skip
    return out.logits[:, -1, :].float()


@functools.cache
def _keep_last(cls: type) -> dict[str, int]:
    params = inspect.signature(cls.forward).parameters
    for name in ("logits_to_keep", "num_logits_to_keep"):  # the second: its older name, in older transformers
        if name in params:
            return {name: 1}
    return {}


@dataclass
class BatchResult:
    tokens: list[list[int]]
    ttft: float  # seconds from the start of the batch to its first token
    seconds: float


@dataclass
class _MicroBatch:
    """Rows of one batch in flight: their KV cache, their inputs for the next forward, the tokens so far."""

    batch: int  # index of the batch it came from
    rows: list[int]  # indices into the generate() call's prompt list
    slot: int  # its place among those in flight: the tag of its messages between stages
    ids: torch.Tensor
    mask: torch.Tensor
    positions: torch.Tensor
    cache: Any
    finished: torch.Tensor
    generated: list[torch.Tensor] = field(default_factory=list)
    token: torch.Tensor | None = None  # the token chosen by the last forward, not yet taken in
    recv: Any = None  # its pending receive from the last stage (stages before the last)
    inbox: tuple[Any, torch.Tensor] | None = None  # the receive of its next input from the stage before
    chunks: deque[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = field(default_factory=deque)  # prefill left
    streamed_at: float = 0.0  # perf_counter() when its tokens so far were last streamed


class Generator:
    """Generation for one model replica: the whole model, a tensor-parallel shard, or one pipeline stage.

    Prefill and decode are one loop over micro-batches in flight. With one stage a batch is one
    micro-batch, run to its end before the next starts, as generate() does. A pipeline keeps `pp`
    micro-batches in flight, `pp + 1` when there are enough (whole batches, or parts of them when
    there are too few: see `_micro_batches` and `_in_flight`): while the last stage turns micro-batch
    j's hidden states into its next token, the first stage already runs micro-batch j+1, so the
    stages overlap instead of waiting on each other at every token. A prompt's prefill goes through
    in chunks (`_prefill_chunks`), so that the next stage starts after the first chunk rather than
    after the whole prompt. Sends are asynchronous and every receive is posted a round ahead of its
    use; a stage waits only for what it needs next. When a micro-batch ends, the next one from the
    queue takes its place at once (its prefill runs while the others decode), so the pipeline stays
    full to the end of the job.

    Every rank of the replica takes the same decisions (which micro-batch runs, which has ended) from the
    same tokens: the last stage sends each token to every other stage, tensor-parallel ranks agree on
    it by a broadcast. The one host sync per token is the end-of-sequence check, as in generate().
    """

    def __init__(
        self,
        runtime: Runtime,
        model: torch.nn.Module,
        tokenizer: Any,
        config: Any,
        s: InferSettings,
        dtype: torch.dtype,
    ) -> None:
        self.rt, self.model, self.tok, self.config, self.s, self.dtype = runtime, model, tokenizer, config, s, dtype
        self.pp = runtime.dims.pp
        pp_ranks = runtime.mesh["pp"].mesh.flatten().tolist()
        self.pp_ranks = pp_ranks
        self.prev = pp_ranks[runtime.pp_rank - 1] if runtime.pp_rank > 0 else None
        self.next = pp_ranks[runtime.pp_rank + 1] if runtime.pp_rank < self.pp - 1 else None
        self.last_stage_rank = pp_ranks[-1]
        tp_mesh = runtime.mesh["tp"]
        self.tp_group = tp_mesh.get_group() if runtime.dims.tp > 1 else None
        self.tp_first = tp_mesh.mesh.flatten().tolist()[0]
        self.generator = torch.Generator(device=runtime.device).manual_seed(s.seed)
        self.eos = tokenizer.eos_token_id
        self.pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (self.eos or 0)
        self._sends: list[Any] = []
        self.first_token_at: float | None = None  # perf_counter() when run() took in its first token
        self._batch_rows: dict[int, list[int]] = {}  # run()'s batches: their rows, in order
        # Called with (rows, tokens so far of each row) as tokens come, at most every STREAM_EVERY_S a
        # micro-batch; set on the rank that writes the completions (run_infer's streaming).
        self.on_tokens: Callable[[list[int], list[list[int]]], None] | None = None

    @property
    def holds_logits(self) -> bool:
        return self.next is None

    # --- one forward of this stage ------------------------------------------------------------

    def _forward(self, mb: _MicroBatch) -> torch.Tensor | None:
        if self.pp == 1:
            return next_token_logits(self.model, mb.ids, mb.mask, mb.positions, mb.cache)
        if self.prev is None:
            x = mb.ids
        else:
            assert mb.inbox is not None
            work, x = mb.inbox
            mb.inbox = None
            work.wait()
        if self.next is not None:
            hidden = self.model(x, attention_mask=mb.mask, position_ids=mb.positions, past_key_values=mb.cache)
            self._send(hidden.contiguous(), self.next, mb.slot)
            return None
        if mb.chunks:  # a prefill chunk before the prompt's last: the cache is all it leaves
            self.model(x, attention_mask=mb.mask, position_ids=mb.positions, past_key_values=mb.cache, head=False)
            return None
        logits = self.model(
            x, attention_mask=mb.mask, position_ids=mb.positions, past_key_values=mb.cache, logits_to_keep=1
        )
        return logits[:, -1, :].float()

    def _send(self, t: torch.Tensor, dst: int, tag: int) -> None:
        # The tensor must live until its send completes; sends complete in order, so the list stays short.
        self._sends = [w for w in self._sends if not w[0].is_completed()]
        self._sends.append((dist.isend(t, dst=dst, tag=tag), t))

    def _post_input(self, mb: _MicroBatch) -> None:
        """Post the receive of `mb`'s next input (hidden states from the stage before) as soon as its shape is known.

        gloo moves a message only once its receive is posted: a receive posted when the stage gets
        to it costs a round trip to the sender (and wakes its threads) on the critical path, where a
        receive posted a whole forward ahead finds the data there. Each slot has its own tag, so
        receives posted in any order meet their own sends.
        """
        if self.prev is None:
            return
        x = torch.empty((*mb.ids.shape, self.config.hidden_size), dtype=self.dtype, device=self.rt.device)
        mb.inbox = (dist.irecv(x, src=self.prev, tag=mb.slot), x)

    def _step(self, mb: _MicroBatch) -> None:
        """Run `mb` through this stage; the last stage chooses its next token and sends it to the other stages.

        A prefill chunk before the prompt's last one fills the cache only: no token, and the micro-batch
        moves on to its next chunk, which no stage has to wait for.
        """
        logits = self._forward(mb)
        rows = mb.ids.shape[0]
        if mb.chunks:
            mb.ids, mb.mask, mb.positions = mb.chunks.popleft()
            self._post_input(mb)
        elif logits is not None:
            token = select_tokens(logits, self.s.temperature, self.s.top_p, self.generator)
            if self.tp_group is not None:
                dist.broadcast(token, src=self.tp_first, group=self.tp_group)
            for dst in self.pp_ranks[:-1]:
                self._send(token, dst, mb.slot)
            mb.token = token
        else:
            mb.token = torch.empty(rows, dtype=torch.long, device=self.rt.device)
            mb.recv = dist.irecv(mb.token, src=self.last_stage_rank, tag=mb.slot)

    def _take_token(self, mb: _MicroBatch) -> bool:
        """Take in `mb`'s chosen token; whether the micro-batch goes on (else it has ended)."""
        if mb.recv is not None:
            mb.recv.wait()
            mb.recv = None
        assert mb.token is not None
        token = torch.where(mb.finished, torch.full_like(mb.token, self.pad), mb.token)
        mb.token = None
        if self.first_token_at is None:
            self.first_token_at = time.perf_counter()
        mb.generated.append(token)
        if self.eos is not None:
            mb.finished |= token == self.eos
        ending = len(mb.generated) >= self.s.max_new_tokens or (self.eos is not None and bool(mb.finished.all()))
        if self.on_tokens is not None and (ending or time.perf_counter() - mb.streamed_at >= STREAM_EVERY_S):
            mb.streamed_at = time.perf_counter()  # its last tokens always go: the stream adds up to the completion
            self.on_tokens(mb.rows, [_until_eos(r, self.eos) for r in torch.stack(mb.generated, dim=1).tolist()])
        if ending:
            return False
        mb.ids = token[:, None]
        mb.mask = torch.cat([mb.mask, torch.ones_like(mb.mask[:, :1])], dim=1)
        mb.positions = mb.positions[:, -1:] + 1
        self._post_input(mb)
        return True

    # --- the loop -------------------------------------------------------------------------------

    def _micro_batches(self, prompts: list[str], batch_size: int) -> list[tuple[int, list[int]]]:
        """(batch index, rows) of every micro-batch, in order.

        A pipeline needs `pp` micro-batches in flight to keep every stage busy. With at least `pp`
        batches each batch is one (the same batches generate() would run, so the same numbers); with
        fewer, every batch is cut into parts, its rows keeping the batch's left padding.
        """
        starts = range(0, len(prompts), batch_size)
        parts = 1 if len(starts) >= self.pp else -(-self.pp // max(len(starts), 1))
        out: list[tuple[int, list[int]]] = []
        for b, start in enumerate(starts):
            rows = list(range(start, min(start + batch_size, len(prompts))))
            n = min(parts, len(rows))
            size, extra = divmod(len(rows), n)
            i = 0
            for k in range(n):
                step = size + (1 if k < extra else 0)
                out.append((b, rows[i : i + step]))
                i += step
        return out

    def _in_flight(self, micro_batches: int) -> int:
        """How many micro-batches run at once: one per stage, and one more in a pipeline with whole batches enough.

        With one per stage, every round each stage waits for the token of the micro-batch it runs
        next, which takes two messages (stage to stage, token back) after the last stage's forward;
        the one more fills that wait with a forward (measured, 2 stages, 6 batches: the last stage
        idles 140 ms instead of 450 ms of 3 s). It costs a batch's KV cache more on every stage,
        so it is never made by cutting batches smaller.
        """
        if self.pp == 1:
            return min(1, micro_batches)  # none where this replica got no prompt (fewer prompts than replicas)
        return min(self.pp + 1 if micro_batches > self.pp else self.pp, micro_batches)

    def _start(self, prompts: list[str], slot: int, batch: int, rows: list[int], encoded: dict) -> _MicroBatch:
        from transformers import DynamicCache

        if batch not in encoded:
            encoded.clear()  # one batch at a time is enough: its micro-batches are queued together
            encoded[batch] = self.tok([prompts[r] for r in self._batch_rows[batch]], return_tensors="pt", padding=True)
        enc = encoded[batch]
        first = self._batch_rows[batch][0]
        sel = [r - first for r in rows]
        ids = enc["input_ids"][sel].to(self.rt.device)
        mask = enc["attention_mask"][sel].to(self.rt.device)
        positions = (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 0)
        finished = torch.zeros(len(rows), dtype=torch.bool, device=self.rt.device)
        chunks = deque(self._prefill_chunks(ids, mask, positions))
        mb = _MicroBatch(batch, rows, slot, *chunks.popleft(), DynamicCache(config=self.config), finished)
        mb.chunks = chunks
        self._post_input(mb)
        return mb

    def _prefill_chunks(
        self, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor
    ) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """The forwards of a prompt's prefill: (ids, mask so far, positions) for each chunk of its positions.

        One forward with a single stage, as generate(). A pipeline cuts it into chunks of
        PREFILL_CHUNK positions: a whole prompt's prefill costs a stage as much as a dozen decode
        steps, and while the first stage runs it the others have nothing to do, then the first
        waits while the last runs it (measured: a sixth of a two-stage job's wall time). In chunks
        the next stage starts after one chunk, and the first stage runs the next chunks meanwhile.
        Each chunk attends to the cache of the ones before: the same keys, values and masks as in one
        forward, though products of another shape may round differently in the last bit (as a batch
        of another size would); the greedy tokens of the tests and of benchmarks/inference_speed.py
        stay generate()'s.
        """
        length = ids.shape[1]
        if self.pp == 1 or length <= PREFILL_CHUNK:
            return [(ids, mask, positions)]
        return [
            (ids[:, i : i + PREFILL_CHUNK], mask[:, : i + PREFILL_CHUNK], positions[:, i : i + PREFILL_CHUNK])
            for i in range(0, length, PREFILL_CHUNK)
        ]

    @torch.no_grad()
    def run(self, prompts: list[str], batch_size: int) -> Iterator[tuple[int, list[int], list[list[int]]]]:
        """Generate for `prompts` in batches of `batch_size`; yields (batch, rows, tokens) as micro-batches end.

        Every rank of the replica must call it with the same prompts.
        """
        self.first_token_at = None
        queue = deque(self._micro_batches(prompts, batch_size))
        self._batch_rows = {}
        for b, rows in queue:
            self._batch_rows.setdefault(b, []).extend(rows)
        encoded: dict[int, Any] = {}
        slots: list[_MicroBatch | None] = []
        for j in range(self._in_flight(len(queue))):
            slots.append(self._start(prompts, j, *queue.popleft(), encoded))
        while any(mb is not None for mb in slots):
            for j, mb in enumerate(slots):
                if mb is None:
                    continue
                # A token chosen in the previous round. The last stage has its own at hand: it takes it
                # in at once (below), so that the receive of the micro-batch's next input is posted a
                # whole round ahead; the other stages wait for theirs only now, when they need it.
                if mb.token is not None and not self._take_token(mb):
                    yield self._ended(mb)
                    mb = slots[j] = self._start(prompts, j, *queue.popleft(), encoded) if queue else None
                    if mb is None:
                        continue
                self._step(mb)
                if self.holds_logits and mb.token is not None and not self._take_token(mb):
                    yield self._ended(mb)
                    slots[j] = self._start(prompts, j, *queue.popleft(), encoded) if queue else None
        for work, _ in self._sends:
            work.wait()
        self._sends.clear()

    def _ended(self, mb: _MicroBatch) -> tuple[int, list[int], list[list[int]]]:
        rows = torch.stack(mb.generated, dim=1).tolist()
        return mb.batch, mb.rows, [_until_eos(r, self.eos) for r in rows]

    def generate(self, prompts: list[str]) -> BatchResult:
        """One batch, start to end (the whole of `prompts` as one batch)."""
        t0 = time.perf_counter()
        tokens: list[list[int]] = [[] for _ in prompts]
        for _, rows, toks in self.run(prompts, len(prompts)):
            for r, t in zip(rows, toks, strict=True):
                tokens[r] = t
        ttft = (self.first_token_at or t0) - t0
        return BatchResult(tokens, ttft, time.perf_counter() - t0)


class _Streamer:
    """A completion's new text as it grows, as `partial` metric records: {"index", "text"} where text is what
    came since the last record of that prompt (the engine pushes metric records to the clients watching)."""

    def __init__(self, tokenizer: Any, mine: list[int]) -> None:
        self.tok, self.mine = tokenizer, mine
        self.sent: dict[int, str] = {}

    def send(self, rows: list[int], tokens: list[list[int]]) -> None:
        for r, toks in zip(rows, tokens, strict=True):
            i = self.mine[r]
            text = self.tok.decode(toks, skip_special_tokens=True)
            before = self.sent.get(i, "")
            # A token's bytes may complete a character the last decode showed as U+FFFD: then resend it all.
            new, again = (text[len(before):], False) if text.startswith(before) else (text, True)
            if new or again:
                report(kind="partial", index=i, text=new, again=again or None)
                self.sent[i] = text


def stop_reason(tokens: list[int], eos: int | None) -> str:
    """Why a completion ended: the model's end-of-sequence token, or the limit of new tokens."""
    if eos is not None and tokens and tokens[-1] == eos:
        return "end_of_sequence"
    return "max_tokens"


def _until_eos(row: list[int], eos: int | None) -> list[int]:
    if eos is not None and eos in row:
        return row[: row.index(eos) + 1]
    return row


def build_replica_model(
    spec: JobSpec, runtime: Runtime, dtype: torch.dtype, seed: int
) -> tuple[torch.nn.Module, Any, Any]:
    """The model one replica generates with (its stage and TP shard on this rank), its tokenizer and config.

    `seed`: set before any random initialisation (engine.workers.model_loading.load_model)."""
    loaded = load_model(spec, dtype=dtype, for_training=False, seed=seed)
    if loaded.objective != "causal":
        raise UserError(f"model {loaded.source.ref} is an encoder (no causal-LM head): it cannot generate text")
    model: torch.nn.Module = loaded.model
    dims = runtime.dims
    if dims.pp > 1:
        model = DecoderStage(decoder_parts(model, "pipeline inference"), runtime.pp_rank, dims.pp)
    if dims.tp > 1:
        apply_tensor_parallel(model, runtime.mesh["tp"])
    model.to(runtime.device)
    model.eval()
    return model, loaded.tokenizer, loaded.config


def run_infer(spec: JobSpec, job_dir: Path) -> int:
    s = spec.infer
    if s is None:
        raise UserError("infer job without infer settings")
    if s.max_new_tokens < 1 or s.batch_size < 1:
        raise UserError("infer settings max_new_tokens and batch_size must be at least 1")
    prompts = load_prompts(s)
    runtime = init_runtime(spec)
    dtype = precision_dtype(s.precision)
    if runtime.device.type == "cpu" and dtype == torch.float16:
        dtype = torch.bfloat16  # few CPU kernels take fp16
    status("loading model")
    model, tokenizer, config = build_replica_model(spec, runtime, dtype, s.seed)
    tokenizer.padding_side = "left"  # new tokens go on the right, right after every prompt
    gen = Generator(runtime, model, tokenizer, config, s, dtype)
    mine = list(range(runtime.dp_rank, len(prompts), runtime.dims.dp))
    if len(prompts) <= STREAM_PROMPTS and gen.holds_logits and runtime.tp_rank == 0:
        gen.on_tokens = _Streamer(tokenizer, mine).send
    batches = -(-len(mine) // s.batch_size)
    status("generating", prompts=len(mine))
    results: list[dict[str, Any]] = []
    # Every rank of a model replica (its tp x pp ranks) sees the replica's tokens: a rank's running figure
    # is its share of its replica's, so the sum over ranks (engine.report's convention) is the job's.
    share = 1 / (runtime.dims.tp * runtime.dims.pp)
    # One start for the whole job: a stage that finished loading first would otherwise time its wait for
    # the others as generation, and each rank's figure would cover a window of its own.
    dist.barrier()
    t_start = time.perf_counter()
    new_tokens = 0
    left = {b: len(mine[b * s.batch_size : (b + 1) * s.batch_size]) for b in range(batches)}
    done = 0
    for b, rows, tokens in gen.run([prompts[i] for i in mine], s.batch_size):
        new_tokens += sum(len(t) for t in tokens)
        for r, toks in zip(rows, tokens, strict=True):
            i = mine[r]
            results.append({"index": i, "prompt": prompts[i], "tokens": toks})
        left[b] -= len(rows)
        if left[b] == 0:  # one record per batch, never per token
            done += 1
            elapsed = time.perf_counter() - t_start
            report(
                step=done,
                kind="infer",
                total_steps=batches,
                batch_size=len(mine[b * s.batch_size : (b + 1) * s.batch_size]),
                time_to_first_token=(gen.first_token_at or t_start) - t_start,
                tokens_per_s=share * new_tokens / elapsed if elapsed > 0 else None,
                peak_memory=peak_memory(runtime.device),
            )
    elapsed = time.perf_counter() - t_start
    # The job's figure, once: every replica's tokens over the generation's wall time (its slowest rank's);
    # each rank reports an equal part of it, so the figure the CLI and the GUI sum is exactly this one.
    (job_tokens,) = world_sums([share * new_tokens], runtime.device)
    wall = torch.tensor([elapsed], dtype=torch.float64, device=runtime.device)
    dist.all_reduce(wall, op=dist.ReduceOp.MAX)
    job_wall = float(wall.item())
    rate = job_tokens / job_wall if job_wall > 0 else None
    report(
        kind="infer_summary",
        prompts=len(mine),
        new_tokens=new_tokens,
        job_new_tokens=round(job_tokens),
        generation_s=job_wall,
        time_to_first_token=(gen.first_token_at or t_start) - t_start,
        tokens_per_s=rate / runtime.world_size if rate is not None else None,
        job_tokens_per_s=rate,
        peak_memory=peak_memory(runtime.device),
        backend="transformers",  # also for jobs from before the choice ("auto" in their job.json)
        backend_reason=s.backend_reason,
    )
    keeper = gen.holds_logits and runtime.tp_rank == 0
    for result in results if keeper else []:
        result["completion"] = tokenizer.decode(result["tokens"], skip_special_tokens=True)
    gathered: list[Any] | None = [None] * runtime.world_size if runtime.is_main else None
    dist.gather_object(results if keeper else [], gathered, dst=0)
    if runtime.is_main:
        merged = sorted((r for part in gathered or [] for r in part), key=lambda r: r["index"])
        out_dir = job_dir / "output"
        out_dir.mkdir(parents=True, exist_ok=True)
        tmp = out_dir / "results.jsonl.tmp"
        lines = [{**{k: r[k] for k in ("prompt", "completion", "tokens")}, "stop_reason": stop_reason(r["tokens"], gen.eos)}
                 for r in merged]  # fmt: skip
        tmp.write_text("".join(json.dumps(line) + "\n" for line in lines))
        tmp.replace(out_dir / "results.jsonl")
        print(f"[rank0] {len(merged)} completions written to {out_dir / 'results.jsonl'}", flush=True)
    status("done", exit_code=EXIT_OK)
    return EXIT_OK
