"""Sharded generation (kind "infer"): prompts in, output/results.jsonl out.

The model is split over the ranks of one replica by pipeline (contiguous layer
ranges per rank; hidden states go stage to stage with send/recv at every
decode step, each stage keeping the KV cache of its own layers) or by tensor
parallelism (DTensor projections; every rank runs the whole forward). Data
parallel degrees make replicas, each generating its share of the prompts.

Decoding follows transformers' generate(): left padding, positions from the
attention mask, and the same causal masks, so greedy output equals the unsplit
model's token for token.
"""

from __future__ import annotations

import functools
import inspect
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from rigpilot.engine.errors import UserError
from rigpilot.engine.jobs.spec import InferSettings, JobSpec
from rigpilot.engine.report import report
from rigpilot.engine.workers import EXIT_OK
from rigpilot.engine.workers.metrics import peak_memory, status
from rigpilot.engine.workers.model_loading import load_model
from rigpilot.engine.workers.parallel_dims import Runtime, init_runtime
from rigpilot.engine.workers.parallelize import apply_tensor_parallel, precision_dtype
from rigpilot.engine.workers.pipeline import DecoderStage, decoder_parts


def load_prompts(s: InferSettings) -> list[str]:
    prompts: list[str] = []
    if s.prompts_file:
        path = Path(s.prompts_file).expanduser()
        if not path.is_file():
            raise UserError(f"prompts file {path} not found")
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise UserError(f"prompts file {path} line {n}: not valid JSON ({e.msg})") from e
            if not isinstance(rec, dict) or not isinstance(rec.get("prompt"), str):
                raise UserError(f'prompts file {path} line {n}: needs a "prompt" string')
            prompts.append(rec["prompt"])
    prompts.extend(s.prompts)
    if any(not p.strip() for p in prompts):
        raise UserError("an empty prompt: every prompt needs some text to continue")
    if not prompts:
        raise UserError('no prompts: give infer.prompts or a prompts_file (JSONL with a "prompt" field)')
    return prompts


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
    model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, cache: Any
) -> torch.Tensor:
    """One forward of a whole causal LM (or its TP shard) against `cache`: each row's next-token logits, fp32.

    The head runs on the last position only (transformers' `logits_to_keep`, as its generate() does):
    over every prompt position a prefill would hold batch × prompt × vocab logits, on a 128k vocabulary
    more than all of a layer's activations. A model whose forward lacks the argument (some remote
    code) gets the whole head: whatever it does after the head (scaling, soft-capping) stays its own.
    """
    out = model(
        input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache, use_cache=True,
        **_keep_last(type(model)),
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


class Generator:
    """Generation for one model replica: the whole model, a tensor-parallel shard, or one pipeline stage."""

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
        self.prev = pp_ranks[runtime.pp_rank - 1] if runtime.pp_rank > 0 else None
        self.next = pp_ranks[runtime.pp_rank + 1] if runtime.pp_rank < self.pp - 1 else None
        self.last_stage_rank = pp_ranks[-1]
        self.pp_group = runtime.mesh["pp"].get_group() if self.pp > 1 else None
        tp_mesh = runtime.mesh["tp"]
        self.tp_group = tp_mesh.get_group() if runtime.dims.tp > 1 else None
        self.tp_first = tp_mesh.mesh.flatten().tolist()[0]
        self.generator = torch.Generator(device=runtime.device).manual_seed(s.seed)
        self.eos = tokenizer.eos_token_id
        self.pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (self.eos or 0)

    @property
    def holds_logits(self) -> bool:
        return self.next is None

    def _forward(
        self, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, cache: Any
    ) -> torch.Tensor | None:
        if self.pp == 1:
            return next_token_logits(self.model, ids, mask, positions, cache)
        if self.prev is None:
            x = ids
        else:
            x = torch.empty((*ids.shape, self.config.hidden_size), dtype=self.dtype, device=self.rt.device)
            dist.recv(x, src=self.prev)
        if self.next is not None:
            hidden = self.model(x, attention_mask=mask, position_ids=positions, past_key_values=cache)
            dist.send(hidden.contiguous(), dst=self.next)
            return None
        logits = self.model(x, attention_mask=mask, position_ids=positions, past_key_values=cache, logits_to_keep=1)
        return logits[:, -1, :].float()

    def _choose(self, logits: torch.Tensor | None, batch: int) -> torch.Tensor:
        """The next token of every row, identical on every rank of the replica."""
        if logits is not None:
            tokens = select_tokens(logits, self.s.temperature, self.s.top_p, self.generator)
        else:
            tokens = torch.empty(batch, dtype=torch.long, device=self.rt.device)
        if self.pp_group is not None:
            dist.broadcast(tokens, src=self.last_stage_rank, group=self.pp_group)
        if self.tp_group is not None:
            dist.broadcast(tokens, src=self.tp_first, group=self.tp_group)
        return tokens

    @torch.no_grad()
    def generate(self, prompts: list[str]) -> BatchResult:
        from transformers import DynamicCache

        t0 = time.perf_counter()
        enc = self.tok(prompts, return_tensors="pt", padding=True)
        ids = enc["input_ids"].to(self.rt.device)
        mask = enc["attention_mask"].to(self.rt.device)
        positions = (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 0)
        cache = DynamicCache(config=self.config)
        batch = ids.shape[0]
        finished = torch.zeros(batch, dtype=torch.bool, device=self.rt.device)
        generated: list[torch.Tensor] = []
        logits = self._forward(ids, mask, positions, cache)
        ttft = 0.0
        for i in range(self.s.max_new_tokens):
            token = self._choose(logits, batch)
            if i == 0:
                ttft = time.perf_counter() - t0
            token = torch.where(finished, torch.full_like(token, self.pad), token)
            generated.append(token)
            if self.eos is not None:
                finished |= token == self.eos
            if bool(finished.all()) or i == self.s.max_new_tokens - 1:
                break
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
            positions = positions[:, -1:] + 1
            logits = self._forward(token[:, None], mask, positions, cache)
        rows = torch.stack(generated, dim=1).tolist() if generated else [[] for _ in range(batch)]
        tokens = [_until_eos(r, self.eos) for r in rows]
        return BatchResult(tokens, ttft, time.perf_counter() - t0)


def _until_eos(row: list[int], eos: int | None) -> list[int]:
    if eos is not None and eos in row:
        return row[: row.index(eos) + 1]
    return row


def build_replica_model(spec: JobSpec, runtime: Runtime, dtype: torch.dtype) -> tuple[torch.nn.Module, Any, Any]:
    s = spec.infer
    assert s is not None
    loaded = load_model(spec, dtype=dtype, for_training=False, seed=s.seed)
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
    model, tokenizer, config = build_replica_model(spec, runtime, dtype)
    tokenizer.padding_side = "left"  # new tokens go on the right, right after every prompt
    gen = Generator(runtime, model, tokenizer, config, s, dtype)
    mine = list(range(runtime.dp_rank, len(prompts), runtime.dims.dp))
    status("generating", prompts=len(mine))
    results: list[dict[str, Any]] = []
    # Every rank of a model replica (its tp × pp ranks) sees the replica's tokens; report this rank's share,
    # so the job's rate is the sum over ranks as for training (engine/report.py).
    share = 1 / (runtime.dims.tp * runtime.dims.pp)
    t_start = time.perf_counter()
    first_ttft: float | None = None
    new_tokens = 0
    for b, start in enumerate(range(0, len(mine), s.batch_size)):
        idx = mine[start : start + s.batch_size]
        out = gen.generate([prompts[i] for i in idx])
        first_ttft = out.ttft if first_ttft is None else first_ttft
        count = sum(len(t) for t in out.tokens)
        new_tokens += count
        report(
            step=b + 1,
            kind="infer",
            batch_size=len(idx),
            time_to_first_token=out.ttft,
            tokens_per_s=share * count / out.seconds if out.seconds > 0 else None,
            peak_memory=peak_memory(runtime.device),
        )
        for i, toks in zip(idx, out.tokens, strict=True):
            results.append(
                {
                    "index": i,
                    "prompt": prompts[i],
                    "completion": tokenizer.decode(toks, skip_special_tokens=True),
                    "tokens": toks,
                }
            )
    elapsed = time.perf_counter() - t_start
    report(
        kind="infer_summary",
        prompts=len(mine),
        new_tokens=new_tokens,
        time_to_first_token=first_ttft,
        tokens_per_s=share * new_tokens / elapsed if elapsed > 0 else None,
        peak_memory=peak_memory(runtime.device),
    )
    keeper = gen.holds_logits and runtime.tp_rank == 0
    gathered: list[Any] | None = [None] * runtime.world_size if runtime.is_main else None
    dist.gather_object(results if keeper else [], gathered, dst=0)
    if runtime.is_main:
        merged = sorted((r for part in gathered or [] for r in part), key=lambda r: r["index"])
        out_dir = job_dir / "output"
        out_dir.mkdir(parents=True, exist_ok=True)
        tmp = out_dir / "results.jsonl.tmp"
        tmp.write_text(
            "".join(json.dumps({k: r[k] for k in ("prompt", "completion", "tokens")}) + "\n" for r in merged)
        )
        tmp.replace(out_dir / "results.jsonl")
        print(f"[rank0] {len(merged)} completions written to {out_dir / 'results.jsonl'}", flush=True)
    status("done", exit_code=EXIT_OK)
    return EXIT_OK
