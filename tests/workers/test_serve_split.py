"""A served tiny Llama split over two CPU ranks (torchrun, gloo), by tensor parallelism and into two pipeline
stages, driven by the official `openai` client: rank 0 serves, rank 1 repeats its batch's steps
(engine.workers.serve_lockstep, engine.workers.serve_pipeline).

Greedy tokens are held to transformers' generate() of the unsplit model for each prompt alone, with sixteen
clients at once (so rows join and leave the running batch on both ranks); the cancel test runs last, and
every rank ends cancelled.
"""

from __future__ import annotations

import os
import signal
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest
import torch

from support.serving import serve_worker
from support.worker_jobs import records, save_random_llama, write_job

PROMPTS = [
    "The quick brown fox", "Once upon a time there was", "To be or not to be, that is", "A",
    "In the beginning the universe was created. This has made a lot of people", "Hello",
    "Rigpilot serves models on", "Why is the sky blue?", "1 2 3 4 5", "The capital of France is",
    "She sells sea shells by the sea shore", "def fib(n):", "Roses are red,", "It was the best of times,",
    "Lorem ipsum dolor sit amet", "What is the meaning of life?",
]  # fmt: skip


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return save_random_llama(tmp_path_factory.mktemp("served") / "tiny", initializer_range=0.2)


@pytest.fixture(scope="module", params=[{"tp": 2}, {"pp": 2}], ids=["tp2", "pp2"])
def server(request, tmp_path_factory, model_dir):
    job = write_job(
        tmp_path_factory.mktemp("jobs") / "servesplit", kind="serve", model=str(model_dir), gpus=[0, 1],
        parallelism=request.param, serve={"precision": "fp32", "max_batch": 16, "max_concurrent": 16, "max_new_tokens": 64},
    )  # fmt: skip
    with serve_worker(job, ranks=2) as (proc, serving):
        yield {"url": serving["url"], "proc": proc, "job": job}


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server["url"], api_key="unused-on-loopback", max_retries=0, timeout=120)


def test_sixteen_concurrent_clients_get_the_unsplit_models_greedy_tokens(client, model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    lengths = [3 + 2 * (i % 5) for i in range(len(PROMPTS))]  # rows leave the batch at different steps

    def ask(i: int) -> str:
        return client.completions.create(model="tiny", prompt=PROMPTS[i], max_tokens=lengths[i],
                                         temperature=0).choices[0].text  # fmt: skip

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        got = list(pool.map(ask, range(len(PROMPTS))))
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(model_dir)
    want = []
    for prompt, n in zip(PROMPTS, lengths, strict=True):
        ids = tok(prompt, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                                 pad_token_id=tok.eos_token_id)  # fmt: skip
        want.append(tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True))
    assert got == want


def test_a_streamed_chat_and_a_seeded_sample_on_the_split_model(client):
    stream = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}],
                                            max_tokens=8, temperature=0, stream=True)  # fmt: skip
    streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    whole = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=8,
                                           temperature=0).choices[0].message.content  # fmt: skip
    assert streamed == whole

    def sample(seed: int) -> str:
        return client.completions.create(model="tiny", prompt="A", max_tokens=10, temperature=1.0, seed=seed)\
            .choices[0].text  # fmt: skip

    assert sample(5) == sample(5)


def test_cancel_ends_every_rank_cancelled(server):
    proc = server["proc"]
    os.killpg(proc.pid, signal.SIGTERM)  # as the engine's cancel: torchrun's session, every rank in it
    proc.wait(timeout=90)
    for rank in (0, 1):
        last = records(server["job"], rank)[-1]
        assert (last["kind"], last["phase"]) == ("status", "cancelled"), (rank, last)
