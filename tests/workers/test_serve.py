"""A served tiny Llama (kind "serve") on one CPU rank, driven by the official `openai` client.

One server for the module: a real worker process (python -m rigpilot.engine.workers) on a real loopback
socket, reporting its URL through its metrics. Greedy tokens are held to transformers' generate() for each
prompt alone; the cancel test runs last and stops the server.
"""

from __future__ import annotations

import http.client
import json
import signal
import time
import urllib.error
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest
import torch

from support.serving import serve_worker
from support.worker_jobs import records, save_random_llama, write_job

MAX_NEW = 200  # the server's cap; the model's context is 256
PROMPTS = [
    "The quick brown fox",
    "Once upon a time there was",
    "To be or not to be, that is",
    "A",
    "In the beginning the universe was created. This has made a lot of people",
    "Hello",
    "Rigpilot serves models on",
    "Why is the sky blue?",
    "1 2 3 4 5",
    "The capital of France is",
    "She sells sea shells by the sea shore, and the shells she sells",
    "def fib(n):",
    "Roses are red,",
    "It was the best of times, it was the worst of times,",
    "Lorem ipsum dolor sit amet",
    "What is the meaning of life?",
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return save_random_llama(tmp_path_factory.mktemp("served") / "tiny", initializer_range=0.2)


@pytest.fixture(scope="module")
def server(tmp_path_factory, model_dir):
    job = write_job(
        tmp_path_factory.mktemp("jobs") / "serve1", kind="serve", model=str(model_dir), gpus=[0],
        serve={"precision": "fp32", "max_batch": 16, "max_concurrent": 17, "max_new_tokens": MAX_NEW},
    )  # fmt: skip
    with serve_worker(job) as (proc, serving):
        yield {"url": serving["url"], "proc": proc, "job": job}


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server["url"], api_key="unused-on-loopback", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def reference(model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(model_dir)


def generate_text(reference, ids: list[int], max_new: int) -> str:
    """transformers' generate(), greedy, for one prompt alone: the text the server must give."""
    model, tok = reference
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=max_new, do_sample=False, pad_token_id=tok.eos_token_id)  # fmt: skip
    return tok.decode(out[0, len(ids) :], skip_special_tokens=True)


def test_models_lists_the_served_model(client):
    assert [m.id for m in client.models.list().data] == ["tiny"]


def test_a_greedy_completion_is_generates_with_its_usage(client, reference):
    _, tok = reference
    r = client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=12, temperature=0)
    ids = tok(PROMPTS[1])["input_ids"]
    assert r.choices[0].text == generate_text(reference, ids, 12)
    assert r.choices[0].finish_reason in ("length", "stop")
    assert r.usage.prompt_tokens == len(ids)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    if r.choices[0].finish_reason == "length":
        assert r.usage.completion_tokens == 12


def test_streaming_adds_up_to_the_same_completion(client):
    whole = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=12, temperature=0)
    chunks = list(client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=12, temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])


def test_chat_uses_the_models_chat_template_streamed_or_not(client, reference):
    _, tok = reference
    messages = [{"role": "user", "content": "Say something."}]
    r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0)
    ids = tok(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False), add_special_tokens=False)
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == generate_text(reference, ids["input_ids"], 8)
    assert r.usage.prompt_tokens == len(ids["input_ids"])
    stream = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=8, temperature=0, stream=True, stream_options={"include_usage": True}
    )  # fmt: skip
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == r.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens


def test_a_stop_string_ends_the_completion_before_it_streamed_or_not(client):
    full = client.completions.create(model="tiny", prompt=PROMPTS[2], max_tokens=20, temperature=0).choices[0].text
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    assert stop.strip(), f"no text to stop on: {full!r}"
    r = client.completions.create(model="tiny", prompt=PROMPTS[2], max_tokens=20, temperature=0, stop=[stop, "\x00"])
    assert r.choices[0].text == full[: full.index(stop)]
    assert r.choices[0].finish_reason == "stop"
    chunks = list(client.completions.create(model="tiny", prompt=PROMPTS[2], max_tokens=20, temperature=0, stop=stop,
                                            stream=True))  # fmt: skip
    assert "".join(c.choices[0].text for c in chunks) == r.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_a_seed_makes_sampling_reproducible(client):
    def sample(seed: int) -> str:
        return client.completions.create(model="tiny", prompt=PROMPTS[3], max_tokens=12, temperature=1.0, top_p=0.9,
                                         seed=seed).choices[0].text  # fmt: skip

    assert sample(7) == sample(7)


def test_sixteen_concurrent_clients_each_get_generates_greedy_tokens(client, reference):
    _, tok = reference
    # Different lengths, so that requests leave the batch at different steps and others join it.
    lengths = [3 + 2 * (i % 5) for i in range(len(PROMPTS))]

    def ask(i: int) -> str:
        return (
            client.completions.create(model="tiny", prompt=PROMPTS[i], max_tokens=lengths[i], temperature=0)
            .choices[0]
            .text
        )

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        got = list(pool.map(ask, range(len(PROMPTS))))
    want = [generate_text(reference, tok(p)["input_ids"], n) for p, n in zip(PROMPTS, lengths, strict=True)]
    assert got == want


@pytest.mark.parametrize(
    ("args", "status", "param"),
    [
        ({"model": "no-such-model"}, 404, "model"),
        ({"temperature": 5}, 400, "temperature"),
        ({"n": 2}, 400, "n"),
        ({"max_tokens": MAX_NEW + 1}, 400, "max_tokens"),
        ({"stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
        ({"prompt": ""}, 400, "prompt"),
        ({"prompt": "word " * 300}, 400, "prompt"),  # past the model's 256 positions
        ({"logprobs": 2}, 400, "logprobs"),
    ],
)
def test_bad_requests_get_openais_error_shape(client, args, status, param):
    with pytest.raises(openai.APIStatusError) as caught:
        client.completions.create(**{"model": "tiny", "prompt": "hi", "max_tokens": 4, **args})
    assert caught.value.status_code == status
    error = caught.value.response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param and error["message"]


def exchange(url: str, body: bytes | None = None) -> tuple[int, dict]:
    """A plain HTTP exchange (the standard library's), for what the openai client never sends."""
    req = urllib.request.Request(url, data=body, headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_a_body_too_large_or_not_json_is_refused_in_the_same_shape(server):
    # Refused from its Content-Length, before a byte of it is read (the client never has to send it).
    address = urllib.parse.urlsplit(server["url"])
    conn = http.client.HTTPConnection(address.hostname, address.port, timeout=60)
    conn.putrequest("POST", "/v1/completions")
    conn.putheader("Content-Type", "application/json")
    conn.putheader("Content-Length", str(2 << 20))
    conn.endheaders()
    big = conn.getresponse()
    assert big.status == 413 and json.loads(big.read())["error"]["code"] == "request_too_large"
    conn.close()
    status, bad = exchange(f"{server['url']}/completions", b"{nope")
    assert status == 400 and bad["error"]["code"] == "invalid_json"
    status, missing = exchange(f"{server['url']}/nowhere")
    assert status == 404 and missing["error"]["type"] == "not_found_error"


def test_a_full_server_says_429_and_clients_that_disconnect_free_their_slots(server, client, reference):
    _, tok = reference
    streams = []
    try:
        for i in range(17):  # the server's max_concurrent; banning the end of sequence keeps each one running
            s = client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": PROMPTS[i % 16]}], max_tokens=MAX_NEW,
                temperature=0, stream=True, logit_bias={str(tok.eos_token_id): -100},
            )  # fmt: skip
            next(iter(s))  # its first chunk (the role) came: it holds a slot
            streams.append(s)
        with pytest.raises(openai.RateLimitError) as caught:
            client.completions.create(model="tiny", prompt="one more", max_tokens=2)
        assert caught.value.response.json()["error"]["type"] == "rate_limit_error"
    finally:
        for s in streams:
            s.close()
    _wait_until(lambda: exchange(server["url"].removesuffix("/v1") + "/health")[1]["active"] == 0)
    assert client.completions.create(model="tiny", prompt="after", max_tokens=2).choices[0].text is not None
    # Dropped from the batch before their 200 tokens, not left to run out.
    _wait_until(lambda: any(r.get("dropped", 0) >= 17 for r in records(server["job"]) if r.get("kind") == "serve"))


def test_cancel_stops_the_server_cleanly(server):
    proc = server["proc"]
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 143  # EXIT_CANCELLED: the engine records the job as cancelled
    last = records(server["job"])[-1]
    assert (last["kind"], last["phase"]) == ("status", "cancelled")
    with pytest.raises(urllib.error.URLError):
        exchange(f"{server['url']}/models")


def test_a_model_with_sliding_window_attention_is_refused_until_a_later_version():
    from transformers import MistralConfig

    from rigpilot.engine.errors import UserError
    from rigpilot.engine.workers.serve_batch import _check_cache

    config = MistralConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, sliding_window=16)  # fmt: skip
    with pytest.raises(UserError) as e:
        _check_cache(config)
    assert e.value.reason == "serve_model_unsupported" and "not yet in this version" in str(e.value)


def _wait_until(check, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            pytest.fail("the condition never came true")
        time.sleep(0.1)
