"""Chunked cross-entropy (`--loss-chunks N`, torchtune's chunked loss): the worker's loss computed a chunk of
tokens at a time equals the whole loss of a plain PyTorch step written here, with its gradients, in fp32; it
never holds the whole fp32 logits (PyTorch's MemTracker on CPU tensors, and the planner's trace of it agrees);
and a model without an output head to chunk is refused in one line.

The layouts (DDP, FSDP2, tensor and pipeline parallel) are in test_workers_activation_layouts.py.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from rigpilot.engine.capability import RecipeContext, recipe_why_not
from rigpilot.engine.errors import UserError
from rigpilot.engine.layout import Layout
from rigpilot.engine.recipe import Recipe
from rigpilot.engine.workers import ERROR_PREFIX, EXIT_USER_ERROR
from rigpilot.engine.workers.chunked_loss import TokenLoss

from support.paths import SHAKESPEARE, TINY_LLAMA_CONFIG
from support.worker_jobs import records, run_job, write_job

TINY_GEMMA2 = {  # final logits soft-capped (the loss caps each chunk's), eager attention
    "model_type": "gemma2", "architectures": ["Gemma2ForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "num_hidden_layers": 2, "vocab_size": 512,
    "max_position_embeddings": 256, "sliding_window": 16, "query_pre_attn_scalar": 16,
    "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0,
}  # fmt: skip


def model_of(name: str) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    if name == "llama":
        config = AutoConfig.from_pretrained(TINY_LLAMA_CONFIG.parent)
    else:
        config = AutoConfig.for_model(**TINY_GEMMA2)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.train()
    return model


def batch(vocab: int, seq: int = 40) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(vocab, (2, seq), generator=g)
    labels = torch.randint(vocab, (2, seq), generator=g)
    labels[0, :7] = -100  # a prompt: no loss on it
    labels[1, -3:] = -100
    return ids, labels


@pytest.mark.parametrize("name", ["llama", "gemma2"])
@pytest.mark.parametrize("chunks", [3, 8, 64])  # uneven, even, more chunks than tokens
def test_the_loss_in_chunks_equals_a_plain_whole_loss_with_its_gradients(name: str, chunks: int) -> None:
    plain, worker = model_of(name), model_of(name)
    ids, labels = batch(plain.config.vocab_size)
    # The plain step: transformers' logits (soft-capped by the model), fp32 cross-entropy summed.
    logits = plain(input_ids=ids, use_cache=False).logits
    expected = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum")
    expected.backward()

    loss_fn = TokenLoss(worker, chunks)
    with loss_fn.model_output():
        hidden = worker(input_ids=ids, use_cache=False).logits
    assert hidden.shape[-1] == worker.config.hidden_size  # the head did not run in the forward
    loss = loss_fn(hidden, labels)
    loss.backward()

    assert float(loss.detach()) == pytest.approx(float(expected.detach()), rel=1e-6)
    grads = {n: p.grad for n, p in plain.named_parameters()}
    for n, p in worker.named_parameters():
        assert p.grad is not None, n
        assert float((p.grad - grads[n]).norm()) <= 1e-6 * float(grads[n].norm()) + 1e-12, n
    # The model is itself again: its head back, the soft-capping where the config had it.
    assert isinstance(worker.lm_head, torch.nn.Linear)
    assert worker.config.get_text_config().to_dict().get("final_logit_softcapping") == (
        30.0 if name == "gemma2" else None
    )


def test_the_evaluation_loss_in_chunks_is_the_whole_one() -> None:
    model = model_of("llama")
    ids, labels = batch(model.config.vocab_size)
    loss_fn = TokenLoss(model, 5)
    with torch.no_grad():
        whole = F.cross_entropy(model(input_ids=ids).logits.flatten(0, 1), labels.flatten(), reduction="sum")
        with loss_fn.model_output():
            hidden = model(input_ids=ids).logits
        assert float(loss_fn(hidden, labels)) == pytest.approx(float(whole), rel=1e-6)


def test_one_chunk_is_the_plain_loss_on_the_models_own_logits() -> None:
    model = model_of("llama")
    loss_fn = TokenLoss(model, 1)
    assert loss_fn.head is None
    with loss_fn.model_output():
        out = model(input_ids=batch(512)[0]).logits
    assert out.shape[-1] == model.config.vocab_size


def test_a_model_without_an_output_head_is_refused_in_one_line() -> None:
    from transformers import BertConfig, BertForMaskedLM

    config = BertConfig(vocab_size=128, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=64)  # fmt: skip
    with pytest.raises(UserError) as e:
        TokenLoss(BertForMaskedLM(config), 4)
    # The capability contract's own line (engine.capability._loss_chunks), as the planner and the submission say it.
    assert str(e.value) == recipe_why_not(Recipe(loss_chunks=4), Layout(), RecipeContext(decoder=False))
    assert e.value.reason == "recipe_refused" and e.value.fields == {"setting": "train.loss_chunks", "value": 4}
    TokenLoss(BertForMaskedLM(config), 1)  # the whole loss needs no head of its own


BIG_VOCAB_LLAMA = {
    "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
    "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 8000,
    "max_position_embeddings": 256, "tie_word_embeddings": False,
}  # fmt: skip


@pytest.mark.slow
def test_the_loss_in_chunks_never_holds_the_whole_fp32_logits_measured_and_traced(tmp_path: Path) -> None:
    """One step's peak on CPU tensors under PyTorch's MemTracker, through the planner's trace of the worker's
    own loss: chunks save at least the whole fp32 logits and their gradient, and the fake trace sees it."""
    from rigpilot.engine.workers import memtrace

    (tmp_path / "config.json").write_text(json.dumps(BIG_VOCAB_LLAMA))
    config = memtrace._load_config(str(tmp_path), False)
    micro, seq = 2, 256
    logits_bytes = micro * seq * BIG_VOCAB_LLAMA["vocab_size"] * 4
    peaks = {}
    for chunks in (1, 8):
        workload = {"model": str(tmp_path), "task": "train", "method": "full", "precision": "fp32",
                    "seq_len": seq, "loss_chunks": chunks}  # fmt: skip
        par = {"micro_batch": micro, "grad_accum": 1, "checkpointing": "none"}
        real = memtrace._trace_step(config, 2, workload, par, Layout.from_dict({}), False, real=True)
        fake = memtrace._trace_step(config, 2, workload, par, Layout.from_dict({}), False)
        assert abs(fake.forward_backward - real.forward_backward) <= 0.03 * real.forward_backward
        peaks[chunks] = real.forward_backward
    saved = peaks[1] - peaks[8]
    # The whole logits' fp32 log-probabilities (kept for backward) and their gradient, less one chunk's.
    assert saved >= 1.5 * logits_bytes, (peaks, logits_bytes)


@pytest.mark.slow
def test_the_plans_recipe_reaches_the_trace(tmp_path: Path) -> None:
    from rigpilot.engine.workers import memtrace

    (tmp_path / "config.json").write_text(json.dumps(BIG_VOCAB_LLAMA))
    plan = {
        "workload": {"model": str(tmp_path), "task": "train", "method": "full", "precision": "bf16", "seq_len": 128},
        "parallelism": {"gpu_indices": [0], "micro_batch": 2, "grad_accum": 1, "checkpointing": "none"},
    }
    whole = memtrace.trace_plan(copy.deepcopy(plan))
    chunked = memtrace.trace_plan(copy.deepcopy(plan), recipe=Recipe(loss_chunks=8))
    named = memtrace.trace_plan({**plan, "workload": {**plan["workload"], "loss_chunks": 8}})
    assert chunked["peak"] == named["peak"] < whole["peak"]


@pytest.mark.slow
def test_a_job_of_an_encoder_with_its_loss_in_chunks_stops_with_one_clear_line(tmp_path: Path) -> None:
    """The refusal as a job meets it: the worker's one line, and a record the engine words it from."""
    from support.paths import minilm_folder  # the MiniLM encoder the job tests train

    job = write_job(
        tmp_path / "minilm-chunked",
        kind="train",
        model=str(minilm_folder()),
        train={"dataset": [str(SHAKESPEARE)], "seq_len": 32, "max_steps": 1, "loss_chunks": 4},
    )
    logs = job / "logs"
    run_job(job, 1, expect=EXIT_USER_ERROR, log_dir=logs)
    (log,) = logs.rglob("stderr.log")
    last = log.read_text().strip().splitlines()[-1]
    assert last.startswith(f"{ERROR_PREFIX} loss chunks apply a decoder's output head")
    record = records(job)[-1]
    assert record["error"] == "user_error" and record["reason"] == "recipe_refused"
    assert record["setting"] == "train.loss_chunks"
