"""Inference on vLLM (kind "infer", backend "vllm"): the same prompts in, the same output/results.jsonl out.

The submission gives an inference job to vLLM only on one machine's real GPUs, with no data parallel
(engine.capability.choose_infer_backend). torchrun then starts one process (engine.jobs.launching
`on_vllm`), this one, and vLLM's offline `LLM` class starts a worker per GPU itself: tensor parallel ×
pipeline parallel of them, on the job's GPUs (CUDA_VISIBLE_DEVICES). vLLM batches and schedules the prompts
itself over its paged KV cache, so the job's batch size does not apply; all prompts go to one generate().

The figures are those of the transformers backend (engine.workers.infer): `kind="infer"` step records and
one `infer_summary`, whose tokens/s is the generated tokens over the wall time of generation. This one
process is rank 0 of a world of one, so its figure is the job's as reported (the CLI and the GUI sum ranks).
Peak memory is left out: vLLM's workers hold the GPU memory (a share of every GPU reserved at start-up,
`gpu_memory_utilization`), not this process, and the machine's telemetry shows it.

vLLM API used (vllm.entrypoints.llm, vllm.sampling_params, vllm.outputs): `LLM(model, tensor_parallel_size,
dtype, trust_remote_code, seed, **EngineArgs such as pipeline_parallel_size and max_model_len)`,
`SamplingParams(max_tokens, temperature, top_p, seed)`, `LLM.generate(prompts, params, use_tqdm=False)`,
which returns one RequestOutput per prompt in the prompts' order, each with `.outputs[0].token_ids/.text`.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from rigpilot.engine.errors import UserError
from rigpilot.engine.jobspec.spec import InferSettings, JobSpec
from rigpilot.engine.report import report
from rigpilot.engine.workers import EXIT_OK
from rigpilot.engine.workers.metrics import status

VLLM_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
# Set by torchrun for its ranks. This process is not one of several ranks to vLLM: its own workers meet in
# a process group vLLM sets up, as in its offline examples run with plain `python`.
TORCHRUN_VARIABLES = (
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
    "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT",
)  # fmt: skip


def sampling_kwargs(s: InferSettings) -> dict[str, Any]:
    """SamplingParams' arguments for the job's settings: greedy at temperature 0, seeded sampling otherwise."""
    kwargs: dict[str, Any] = {"max_tokens": s.max_new_tokens, "temperature": s.temperature, "top_p": s.top_p}
    if s.temperature > 0:
        kwargs["seed"] = s.seed  # per request, so the completions repeat run after run
    return kwargs


def max_model_len(prompt_tokens: list[int], max_new_tokens: int, context: int | None) -> int | None:
    """The sequence length vLLM sizes its KV cache for: the longest prompt plus the new tokens.

    vLLM's default is the model's whole context (128k tokens for many models), which must fit the KV cache
    of at least one sequence or the engine refuses to start; the job needs no more than this. None (vLLM's
    default and its own check) when that exceeds the model's context.
    """
    need = max(prompt_tokens, default=0) + max_new_tokens
    if context is not None and need > context:
        return None
    return need


def llm_kwargs(spec: JobSpec, model: str, seq_len: int | None) -> dict[str, Any]:
    """`vllm.LLM`'s arguments: the plan's degrees, the job's precision, seed and remote-code choice."""
    s = spec.infer
    assert s is not None
    p = spec.parallelism
    kwargs: dict[str, Any] = {
        "model": model,
        "tensor_parallel_size": p.tp,
        "pipeline_parallel_size": p.pp,
        "dtype": VLLM_DTYPES[s.precision],
        "trust_remote_code": spec.trust_remote_code,
        "seed": s.seed,
    }
    if seq_len is not None:
        kwargs["max_model_len"] = seq_len
    return kwargs


def completions(outputs: list[Any]) -> list[tuple[list[int], str]]:
    """(token ids, text) of each RequestOutput's one completion, in the prompts' order."""
    return [(list(o.outputs[0].token_ids), o.outputs[0].text) for o in outputs]


def write_results(job_dir: Path, prompts: list[str], done: list[tuple[list[int], str]]) -> Path:
    """output/results.jsonl as the transformers backend writes it: prompt, completion, tokens per line."""
    out_dir = job_dir / "output"
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = out_dir / "results.jsonl.tmp"
    lines = (
        json.dumps({"prompt": p, "completion": text, "tokens": tokens}) + "\n"
        for p, (tokens, text) in zip(prompts, done, strict=True)
    )
    tmp.write_text("".join(lines))
    path = out_dir / "results.jsonl"
    tmp.replace(path)
    return path


def _model_reference(spec: JobSpec) -> tuple[Any, str]:
    """The job's model as vLLM takes it (a local folder or a hub id; a preset by its hub id), with its source."""
    from rigpilot.engine.workers.model_loading import resolve_source

    source = resolve_source(spec.model)
    if source.kind == "config" or not source.has_weights:
        raise UserError(f"model {source.ref} has no weights (only config.json): there is nothing to generate with")
    return source, source.location


def _import_vllm() -> tuple[Any, Any]:
    try:
        from vllm import LLM, SamplingParams
    except ImportError as e:
        raise UserError(
            f"vllm does not import in the worker environment ({sys.executable}): {e}; "
            "install it there, or submit the job again with --backend transformers"
        ) from e
    return LLM, SamplingParams


def _shut_down(holder: list[Any]) -> None:
    """Stop vLLM's worker processes before this process exits, else the engine kills them as leftovers.

    `LLM.shutdown()` is not in every vLLM version (it was proposed in vLLM PRs #36283 and #46023); without
    it the engine stops when the LLM object is garbage-collected (vLLM issue #4678). The worker's exit
    (os._exit, engine.workers.__main__) runs no collector, so the last reference is dropped (`holder` holds
    it) and the collector run here.
    """
    shutdown = getattr(holder[0], "shutdown", None)
    if callable(shutdown):
        shutdown()
    holder.clear()
    gc.collect()


def run_infer_vllm(spec: JobSpec, job_dir: Path) -> int:
    from rigpilot.engine.workers.infer import load_prompts
    from rigpilot.engine.workers.model_loading import load_config, load_tokenizer

    s = spec.infer
    if s is None or s.max_new_tokens < 1:
        raise UserError("infer job without infer settings, or max_new_tokens below 1")
    prompts = load_prompts(s)
    for name in TORCHRUN_VARIABLES:
        os.environ.pop(name, None)
    status("loading model", backend="vllm")
    source, model = _model_reference(spec)
    tokenizer = load_tokenizer(source, spec)
    context = getattr(load_config(source, spec), "max_position_embeddings", None)
    lengths = [len(ids) for ids in tokenizer(prompts)["input_ids"]]
    seq_len = max_model_len(lengths, s.max_new_tokens, context if isinstance(context, int) else None)
    LLM, SamplingParams = _import_vllm()
    holder = [LLM(**llm_kwargs(spec, model, seq_len))]
    params = SamplingParams(**sampling_kwargs(s))
    status("generating", prompts=len(prompts), backend="vllm")
    # Step 0 marks the job running while vLLM generates every prompt in one call.
    report(step=0, kind="infer", total_steps=1, batch_size=len(prompts))
    t_start = time.perf_counter()
    outputs = holder[0].generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - t_start
    done = completions(outputs)
    del outputs
    _shut_down(holder)
    new_tokens = sum(len(tokens) for tokens, _ in done)
    rate = new_tokens / elapsed if elapsed > 0 else None
    report(step=1, kind="infer", total_steps=1, batch_size=len(prompts), tokens_per_s=rate)
    report(
        kind="infer_summary",
        prompts=len(prompts),
        new_tokens=new_tokens,
        job_new_tokens=new_tokens,
        generation_s=elapsed,
        tokens_per_s=rate,
        job_tokens_per_s=rate,
        backend="vllm",
        backend_reason=s.backend_reason,
    )
    path = write_results(job_dir, prompts, done)
    print(f"[rank0] {len(done)} completions written to {path} (vLLM)", flush=True)
    status("done", exit_code=EXIT_OK)
    return EXIT_OK
