"""Tied embeddings under pipeline parallel, and accumulation across epochs, train what one plain loop trains.

The reference is a plain single-process loop written here with torch and transformers only, as in
test_workers_reference.py, on datasets small enough that every run crosses two epoch boundaries.
Its order of blocks is spelled out here, not taken from the engine: each epoch is the seeded
permutation of the training blocks, cut into optimizer steps of GLOBAL_BATCH blocks, the leftover
dropped. Each dataset's block count leaves a leftover that is not a multiple of a micro-batch, so a
sampler that ended epochs per micro-batch instead of per step would train other blocks.

The models are tied (the input embedding is the output head): a Llama-3.2-1B-style tiny Llama and a
tiny Gemma 2 (soft-capped logits, sliding windows). Under pipeline parallel the embedding sits on the
first stage and the head on the last; they must still train as one matrix, and the exported folder
must be tied, with logits equal to the reference model's.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from support.paths import CHAT, SHAKESPEARE, TINY_LLAMA_CONFIG
from support.reference_loop import plain_loop
from support.worker_jobs import records, run_job, write_job

pytestmark = pytest.mark.slow

GLOBAL_BATCH = 4
RECIPE: dict[str, Any] = {
    "method": "scratch",
    "precision": "fp32",
    "seq_len": 32,
    "max_steps": 6,
    "learning_rate": 3e-3,
    "warmup_steps": 1,
    "weight_decay": 0.1,
    "grad_clip": 1.0,
    "eval_every": 6,
    "checkpoint_every": 3,
    "seed": 1234,
    "eval_fraction": 0.1,
}
# Gemma 2 as a second tied family: soft-capped logits and sliding windows (narrower than seq_len).
GEMMA2 = {
    "architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "sliding_window": 16, "query_pre_attn_scalar": 16, "attn_logit_softcapping": 50.0,
    "final_logit_softcapping": 30.0, "max_position_embeddings": 256, "tie_word_embeddings": True,
}  # fmt: skip

# name: (model, data, parallelism, ranks, micro_batch, grad_accum); micro x pp_microbatches x dp x accum = 4.
CASES: dict[str, tuple[str, str, dict[str, Any], int, int, int]] = {
    "llama-chat-pp-gpipe": ("llama", "chat", {"pp": 2, "pp_microbatches": 2, "pp_schedule": "GPipe"}, 2, 1, 2),
    "llama-text-pp-1f1b": ("llama", "text", {"pp": 2, "pp_microbatches": 2, "pp_schedule": "1F1B"}, 2, 1, 2),
    "gemma2-chat-pp-1f1b": ("gemma2", "chat", {"pp": 2, "pp_microbatches": 2, "pp_schedule": "1F1B"}, 2, 1, 2),
    "llama-text-pp-fsdp": ("llama", "text", {"pp": 2, "dp_shard": 2, "pp_microbatches": 2}, 4, 1, 1),
    "llama-chat-pp-tp": ("llama", "chat", {"pp": 2, "tp": 2, "pp_microbatches": 2, "pp_schedule": "1F1B"}, 4, 1, 2),
    "llama-text-ddp-accum": ("llama", "text", {"dp_replicate": 2}, 2, 1, 2),
    "llama-chat-accum": ("llama", "chat", {}, 1, 1, 4),
}


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tied")


@pytest.fixture(scope="module")
def models(root: Path) -> dict[str, Path]:
    """Folders of the two tied models: the tiny Llama's tokenizer with a tied config of each family."""
    out = {}
    for name, config in (("llama", {"tie_word_embeddings": True}), ("gemma2", GEMMA2)):
        folder = root / f"model-{name}"
        shutil.copytree(TINY_LLAMA_CONFIG.parent, folder)
        base = json.loads(TINY_LLAMA_CONFIG.read_text())
        merged = {**base, **config} if name == "llama" else {**config, **{k: base[k] for k in ("vocab_size", "bos_token_id", "eos_token_id", "pad_token_id")}}
        (folder / "config.json").write_text(json.dumps(merged, indent=2))
        out[name] = folder / "config.json"
    return out


@pytest.fixture(scope="module")
def datasets(root: Path) -> dict[str, Path]:
    """Small cuts of the shipped text and chat data: 2 steps an epoch, with a leftover of 2 blocks."""
    text = root / "text.txt"
    text.write_text(SHAKESPEARE.read_text()[:850])
    chat = root / "chat.jsonl"
    chat.write_text("\n".join(CHAT.read_text().splitlines()[:20]) + "\n")
    return {"text": text, "chat": chat}


def training_data(model: Path, dataset: Path) -> Any:
    from transformers import AutoTokenizer

    from rigpilot.engine.workers.data import build_dataset, read_dataset

    tokenizer = AutoTokenizer.from_pretrained(model.parent)
    files, docs = read_dataset([str(dataset)], "text")
    r = RECIPE
    return build_dataset(files, docs, tokenizer, r["seq_len"] + 1, r["eval_fraction"], r["seed"], train_on_prompts=False)


def step_order(num_blocks: int, steps: int, seed: int) -> list[torch.Tensor]:
    """The blocks of each optimizer step: per epoch a seeded permutation, cut into whole steps."""
    per_epoch = num_blocks // GLOBAL_BATCH
    out: list[torch.Tensor] = []
    epoch = 0
    while len(out) < steps:
        perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch))
        out += [perm[i * GLOBAL_BATCH : (i + 1) * GLOBAL_BATCH] for i in range(per_epoch)]
        epoch += 1
    return out[:steps]


def reference_run(model_config: Path, dataset: Path) -> dict[str, Any]:
    """Per-step loss, grad norm and LR, the final eval loss, and the trained model of the plain loop."""
    r = RECIPE
    data = training_data(model_config, dataset)
    n = len(data.train)
    assert n // GLOBAL_BATCH * 2 < r["max_steps"], "the run must cross two epoch boundaries"
    assert n % GLOBAL_BATCH >= 2, "the leftover must not be a whole number of micro-batches of 2"
    out = plain_loop(model_config.parent, data, step_order(n, r["max_steps"], r["seed"]), r)
    model = out["model"]
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    out["probe"] = data.train[:3, :-1]
    return out


_references: dict[tuple[str, str], dict[str, Any]] = {}


def reference(models: dict[str, Path], datasets: dict[str, Path], model: str, data: str) -> dict[str, Any]:
    key = (model, data)
    if key not in _references:
        _references[key] = reference_run(models[model], datasets[data])
    return _references[key]


_jobs: dict[str, Path] = {}


def run_case(root: Path, models: dict[str, Path], datasets: dict[str, Path], case: str, **spec: Any) -> Path:
    """The job of one case, run once per module (`spec`: more of the job's settings, for a job of its own)."""
    name = case + ("-" + "-".join(spec) if spec else "")
    if name not in _jobs:
        model, data, parallelism, nproc, micro_batch, grad_accum = CASES[case]
        dp = parallelism.get("dp_replicate", 1) * parallelism.get("dp_shard", 1)
        assert micro_batch * parallelism.get("pp_microbatches", 1) * dp * grad_accum == GLOBAL_BATCH
        train = {**RECIPE, "dataset": [str(datasets[data])], "micro_batch": micro_batch, "grad_accum": grad_accum}
        job = write_job(
            root / name, kind="train", model=str(models[model]), parallelism=parallelism, train=train, **spec
        )
        run_job(job, nproc)
        _jobs[name] = job
    return _jobs[name]


def assert_trains_the_reference(job: Path, ref: dict[str, Any], first_step: int = 1) -> None:
    """Every step's loss, grad norm and LR, the eval loss, and the exported model against the plain loop's."""
    from transformers import AutoModelForCausalLM

    steps = [r for r in records(job) if r.get("loss") is not None]
    assert [r["step"] for r in steps] == list(range(first_step, RECIPE["max_steps"] + 1))
    for r in steps:
        s = r["step"]
        assert r["loss"] == pytest.approx(ref["loss"][s], abs=1e-5), f"step {s}: {r['loss']} vs {ref['loss'][s]}"
        assert r["grad_norm"] == pytest.approx(ref["grad_norm"][s], rel=1e-4), f"grad norm at step {s}"
        assert r["lr"] == pytest.approx(ref["lr"][s], rel=1e-9)
    (evaluation,) = [r for r in records(job) if r.get("kind") == "eval"]
    assert evaluation["eval_loss"] == pytest.approx(ref["eval_loss"], abs=1e-5)

    # The export is tied exactly as the input was, and computes what the reference model computes.
    config = json.loads((job / "output" / "config.json").read_text())
    assert config.get("tie_word_embeddings", True) is True
    from safetensors import safe_open

    with safe_open(job / "output" / "model.safetensors", "pt") as f:
        assert "lm_head.weight" not in set(f.keys())
    exported = AutoModelForCausalLM.from_pretrained(job / "output", dtype=torch.float32).eval()
    assert exported.get_output_embeddings().weight is exported.get_input_embeddings().weight
    with torch.no_grad():
        got = exported(input_ids=ref["probe"]).logits
        want = ref["model"](input_ids=ref["probe"]).logits
    assert torch.allclose(got, want, atol=1e-4), f"exported logits differ by {(got - want).abs().max():.3g}"


@pytest.mark.parametrize("case", list(CASES))
def test_tied_models_and_epochs_train_what_the_plain_loop_trains(
    root: Path, models: dict[str, Path], datasets: dict[str, Path], case: str
) -> None:
    model, data, *_ = CASES[case]
    assert_trains_the_reference(run_case(root, models, datasets, case), reference(models, datasets, model, data))


def test_a_tied_model_resumes_into_a_pipeline_from_an_unsplit_checkpoint(
    root: Path, models: dict[str, Path], datasets: dict[str, Path]
) -> None:
    # The unsplit model's checkpoint keeps the tied matrix's optimizer state under the embedding's name
    # only; the pipeline's last stage takes its copy of it from the first stage, and the pair goes on as
    # one matrix: the steps after the resume are the plain loop's.
    unsplit = run_case(root, models, datasets, "llama-chat-accum")
    model, data, parallelism, nproc, micro_batch, grad_accum = CASES["llama-chat-pp-gpipe"]
    job = root / "llama-chat-resumed-into-pp"
    shutil.copytree(unsplit / "checkpoints" / "step-3", job / "checkpoints" / "step-3")
    train = {**RECIPE, "dataset": [str(datasets[data])], "micro_batch": micro_batch, "grad_accum": grad_accum}
    write_job(job, kind="train", model=str(models[model]), parallelism=parallelism, train=train, resume=True)
    run_job(job, nproc)
    notes = [r.get("message", "") for r in records(job) if r.get("kind") == "note"]
    assert any("resumed from step-3 at step 3" in n for n in notes), notes
    assert_trains_the_reference(job, reference(models, datasets, model, data), first_step=4)
