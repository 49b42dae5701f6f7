"""LoRA adapters served by name beside their base, over TLS with an API key (kind "serve", --adapter, --listen).

One server for the module: a real worker on a tiny Llama with two adapters saved by peft's save_pretrained,
listening on every interface, so behind the engine's kind of certificate and the job's API key. Each request's
greedy tokens are held to peft's PeftModel.generate() for its adapter (transformers' for the base), with the
three mixed in one batch.
"""

from __future__ import annotations

import json
import os
import ssl
import stat
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest
import torch

from support.paths import REPO
from support.serving import serve_worker
from support.worker_jobs import records, save_random_llama, write_job

pytestmark = pytest.mark.slow  # a worker, peft and three reference models: about 20 s on 2 idle cores

ADAPTERS = {"tuned": 1, "other": 2}  # name -> the seed of its random LoRA weights
PROMPTS = ["The quick brown fox", "Once upon a time", "1 2 3 4 5", "Roses are red,"]


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("adapters")
    out = {"base": save_random_llama(root / "tiny", initializer_range=0.2)}
    for name, seed in ADAPTERS.items():
        base = AutoModelForCausalLM.from_pretrained(out["base"], dtype=torch.float32)
        torch.manual_seed(seed)
        # Random A and B (peft's init leaves B zero, which would change no token).
        config = LoraConfig(r=4, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"],
                            init_lora_weights=False)  # fmt: skip
        get_peft_model(base, config).save_pretrained(root / name)
        out[name] = root / name
    return out


@pytest.fixture(scope="module")
def server(tmp_path_factory, folders):
    tls = tmp_path_factory.mktemp("tls") / "engine"
    subprocess.run([sys.executable, "-m", "rigpilot.engine.api.tls", str(tls)], check=True, cwd=REPO, timeout=120)
    job = write_job(
        tmp_path_factory.mktemp("jobs") / "serve-lora", kind="serve", model=str(folders["base"]), gpus=[0],
        serve={"precision": "fp32", "max_batch": 8, "max_new_tokens": 64, "listen": "0.0.0.0", "base_name": "base",
               "adapters": {n: str(folders[n]) for n in ADAPTERS},
               "tls_cert": str(tls / "engine-cert.pem"), "tls_key": str(tls / "engine-key.pem")},
    )  # fmt: skip
    with serve_worker(job) as (_, serving):
        port = urllib.parse.urlsplit(serving["url"]).port
        yield {"serving": serving, "job": job, "local": f"https://127.0.0.1:{port}/v1"}


def client_with(server, key: str) -> openai.OpenAI:
    # The engine's certificate is self-signed; clients pin it rather than check a chain.
    return openai.OpenAI(base_url=server["local"], api_key=key, max_retries=0, timeout=120,
                         http_client=openai.DefaultHttpxClient(verify=False))  # fmt: skip


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    key = Path(server["serving"]["api_key_file"]).read_text().strip()
    return client_with(server, key)


def reference_texts(folders, name: str, max_new: int) -> list[str]:
    """Greedy generate() of each prompt alone: peft's PeftModel for an adapter, transformers' for the base."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folders["base"])
    model = AutoModelForCausalLM.from_pretrained(folders["base"], dtype=torch.float32)
    if name != "base":
        model = PeftModel.from_pretrained(model, folders[name])
    model.eval()
    texts = []
    for prompt in PROMPTS:
        ids = torch.tensor([tok(prompt)["input_ids"]])
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new,
                                 do_sample=False, pad_token_id=tok.eos_token_id)  # fmt: skip
        texts.append(tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True))
    return texts


def test_the_job_reports_an_https_url_and_keeps_its_key_private(server):
    serving = server["serving"]
    assert serving["url"].startswith("https://") and serving["adapters"] == ",".join(ADAPTERS)
    mode = stat.S_IMODE(os.stat(serving["api_key_file"]).st_mode)
    assert mode == 0o600


def test_models_lists_the_base_and_each_adapter(client):
    assert [m.id for m in client.models.list().data] == ["base", *ADAPTERS]


def test_a_wrong_key_or_none_gets_401_in_openais_shape(server):
    with pytest.raises(openai.AuthenticationError) as caught:
        client_with(server, "rp-wrong").models.list()
    assert caught.value.status_code == 401 and caught.value.response.json()["error"]["code"] == "invalid_api_key"
    context = ssl.create_default_context()
    context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
    with pytest.raises(urllib.error.HTTPError) as plain:
        urllib.request.urlopen(server["local"] + "/models", context=context, timeout=30)
    error = json.loads(plain.value.read())["error"]
    assert plain.value.code == 401 and set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "authentication_error"


def test_each_request_gets_its_adapters_greedy_tokens_in_one_mixed_batch(client, folders):
    max_new = 10
    names = ["base", *ADAPTERS]
    expected = {name: reference_texts(folders, name, max_new) for name in names}
    assert expected["tuned"] != expected["base"] and expected["other"] != expected["tuned"]
    asks = [(name, i) for i in range(len(PROMPTS)) for name in names]

    def ask(job: tuple[str, int]) -> str:
        name, i = job
        r = client.completions.create(model=name, prompt=PROMPTS[i], max_tokens=max_new, temperature=0)
        assert r.model == name
        return r.choices[0].text

    with ThreadPoolExecutor(len(asks)) as pool:
        got = list(pool.map(ask, asks))
    assert got == [expected[name][i] for name, i in asks]


def test_an_unknown_model_names_what_is_served(client):
    with pytest.raises(openai.NotFoundError) as caught:
        client.completions.create(model="nope", prompt="Hi", max_tokens=2)
    assert "'tuned'" in caught.value.response.json()["error"]["message"]


def test_serving_figures_reach_the_jobs_metrics(server, client):
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        serve = [r for r in records(server["job"]) if r.get("kind") == "serve" and r.get("requests")]
        if serve:
            break
        client.completions.create(model="tuned", prompt="Hello", max_tokens=4, temperature=0)
        time.sleep(0.5)
    assert serve, "no serve record"
    keys = {"requests_per_s", "tokens_per_s", "time_to_first_token", "queue_depth", "running", "kv_cache_bytes"}
    assert keys <= set(serve[-1])
    assert any(r["kv_cache_bytes"] > 0 for r in serve) or all(r["running"] == 0 for r in serve)
