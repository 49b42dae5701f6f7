"""Tensor-parallel and pipeline splits compute what the unsplit model does, per decoder family and under LoRA.

Tensor parallel runs in-process on 2 gloo ranks (torch.multiprocessing
spawn), one process group for all cases so the start-up is paid once; every
rank also builds the unsplit model from the same seed and compares the loss
and every gradient, and the logits of a KV-cached decode (as inference runs). Pipeline stages are plain modules: two stages of one
model, run one after the other in one process, must give the whole model's
logits.
"""

from __future__ import annotations

import os
import socket
import sys
import traceback
from typing import Any

import pytest
import torch

from rigpilot.engine.capability import PIPELINE_TYPES, TENSOR_PARALLEL_TYPES, why_not
from rigpilot.engine.layout import Layout

VOCAB = 96
SEQ = 8
BATCH = 2


def tiny_config(model_type: str) -> Any:
    """A 2-layer config of the family, from transformers' own config class (heads and widths divisible by 2)."""
    from transformers import AutoConfig

    common: dict[str, Any] = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    extra: dict[str, Any] = {
        "gemma": dict(head_dim=8, tie_word_embeddings=True),
        "gemma2": dict(head_dim=8, tie_word_embeddings=True, sliding_window=4, attn_logit_softcapping=50.0,
                       final_logit_softcapping=30.0),
        "mistral": dict(sliding_window=4),
        "qwen2": dict(),
        "qwen3": dict(head_dim=8),
        "phi3": dict(pad_token_id=0),
        "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
        "qwen2_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                          shared_expert_intermediate_size=24),
        # Layer 0 dense, layer 1 experts: both kinds of MLP in one model.
        "qwen3_moe": dict(head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                          mlp_only_layers=[0]),
    }.get(model_type, {})  # fmt: skip
    config = AutoConfig.for_model(model_type, **{**common, **extra})
    config._attn_implementation = "eager"
    return config


def build(model_type: str, lora: bool, seed: int = 0, dropout: float = 0.0) -> torch.nn.Module:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(model_type), dtype=torch.float32)
    with torch.no_grad():  # weights large enough that errors show
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.2)
    if lora:
        from rigpilot.engine.workers.model_loading import default_lora_targets

        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=dropout, target_modules=default_lora_targets(model)))
        with torch.no_grad():  # peft starts B at zero: make the adapter do something
            for n, p in model.named_parameters():
                if "lora_B" in n:
                    p.normal_(0, 0.2)
    return model


def batch(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (BATCH, SEQ + 1), generator=g)
    return ids[:, :-1], ids[:, 1:]


def loss_of(model: torch.nn.Module, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=inputs, use_cache=False).logits
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())


def grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    out = {}
    for n, p in model.named_parameters():
        if p.grad is not None:
            g = p.grad
            out[n] = (g.full_tensor() if isinstance(g, DTensor) else g).detach().clone()
    return out


# --- tensor parallel on 2 gloo ranks --------------------------------------------------------------


def _tp_case(model_type: str, lora: bool, sequence_parallel: bool, vocab: bool = False) -> str | None:
    """None when the 2-rank TP model's loss and gradients equal the unsplit model's, else what differs.

    `vocab`: the LM head split by vocabulary and the training loop's own token_loss (labels partly
    ignored) under loss_parallel(), which must then see logits that are never whole on a rank.
    """
    import contextlib

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import loss_parallel

    from rigpilot.engine.workers.parallelize import apply_tensor_parallel, logits_split
    from rigpilot.engine.workers.train import token_loss

    inputs, labels = batch()
    labels = labels.clone()
    labels[0, :3] = -100  # a prompt that is not trained on
    trained = int((labels != -100).sum())  # token_loss sums; the loop divides by the trained tokens
    ref = build(model_type, lora)
    ref_loss = token_loss(ref(input_ids=inputs, use_cache=False).logits, labels) / trained
    ref_loss.backward()
    expected = grads(ref)
    model = build(model_type, lora)
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    apply_tensor_parallel(model, mesh["tp"], sequence_parallel, vocab_parallel=vocab)
    problems = []
    tied = model.config.tie_word_embeddings
    if logits_split(model) != (vocab and not tied):
        problems.append(f"logits_split {logits_split(model)} with vocab={vocab}, tied={tied}")
    with loss_parallel() if logits_split(model) else contextlib.nullcontext():
        logits = model(input_ids=inputs, use_cache=False).logits
        if vocab and not tied:
            if not isinstance(logits, DTensor) or logits.to_local().shape[-1] != VOCAB // 2:
                problems.append(f"logits not vocabulary-sharded: {type(logits).__name__} {tuple(logits.shape)}")
        loss = token_loss(logits, labels) / trained
        loss.backward()
    got = grads(model)
    if abs(float(loss) - float(ref_loss)) > 1e-5:
        problems.append(f"loss {float(loss)} != {float(ref_loss)}")
    if got.keys() != expected.keys():
        problems.append(f"gradients for {sorted(got.keys() ^ expected.keys())}")
    for name in sorted(got.keys() & expected.keys()):
        if not torch.allclose(got[name], expected[name], atol=1e-5, rtol=1e-4):
            problems.append(f"grad {name} off by {float((got[name] - expected[name]).abs().max()):.3g}")
    return "; ".join(problems[:6]) or None


def _tp_decode_case(model_type: str) -> str | None:
    """None when the TP model (as inference builds it) decodes with a KV cache to the unsplit model's logits."""
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import DynamicCache

    from rigpilot.engine.workers.infer import next_token_logits
    from rigpilot.engine.workers.parallelize import apply_tensor_parallel

    def decode(model: torch.nn.Module, step: Any) -> list[torch.Tensor]:
        ids, _ = batch(seed=2)
        cache = DynamicCache(config=model.config)
        out, positions = [], torch.arange(SEQ).expand(BATCH, SEQ)
        with torch.no_grad():
            for _ in range(3):  # a prefill, then one token at a time against the cache
                mask = torch.ones(BATCH, int(positions[0, -1]) + 1, dtype=torch.long)
                logits = step(model, ids, mask, positions, cache)
                out.append(logits)
                ids, positions = logits.argmax(-1)[:, None], positions[:, -1:] + 1
        return out

    def whole_head(model: torch.nn.Module, ids: Any, mask: Any, positions: Any, cache: Any) -> torch.Tensor:
        out = model(input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache, use_cache=True)
        return out.logits[:, -1].float()

    expected = decode(build(model_type, False).eval(), whole_head)
    model = build(model_type, False).eval()
    apply_tensor_parallel(model, init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))["tp"])
    got = decode(model, next_token_logits)  # the worker's own step: the head on the last position only
    worst = max(float((g - e).abs().max()) for g, e in zip(got, expected, strict=True))
    return None if worst < 1e-4 else f"decoded logits off by {worst:.3g}"


def _tp_dropout_case() -> str | None:
    """LoRA dropout under TP: row-wise layers draw a mask per rank, and the ranks' random streams stay together."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from rigpilot.engine.workers.parallelize import ShardDropout, apply_tensor_parallel

    model = build("llama", True, dropout=0.5).train()
    apply_tensor_parallel(model, init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))["tp"])
    layer = model.base_model.model.model.layers[0]
    kinds = {n: type(layer.get_submodule(n).lora_dropout["default"]).__name__ for n in ("self_attn.q_proj", "mlp.down_proj")}
    if kinds != {"self_attn.q_proj": "Dropout", "mlp.down_proj": ShardDropout.__name__}:
        return f"dropout modules {kinds}"
    inputs, labels = batch()
    loss_of(model, inputs, labels).backward()
    states: list[Any] = [None, None]
    dist.all_gather_object(states, torch.get_rng_state())
    return None if torch.equal(states[0], states[1]) else "the TP ranks' random streams diverged"


def _tp_worker(rank: int, port: int, cases: list[tuple], results: Any) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        for case in cases:
            try:
                if case[0] == "decode":
                    outcome = _tp_decode_case(case[1])
                elif case[0] == "dropout":
                    outcome = _tp_dropout_case()
                else:
                    outcome = _tp_case(*case)
            except Exception:  # one failing family must not hide the others' results
                outcome = traceback.format_exc(limit=-4)
            if rank == 0:
                results[case] = outcome
    finally:
        dist.destroy_process_group()
    # Every result is in the manager by now. Once in a full CI run a rank aborted in C++ teardown at interpreter
    # exit ("terminate called without an active exception"), after its work, which errored every case; leave
    # without running those destructors.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


TP_FAMILIES = ("mistral", "qwen2", "qwen3", "gemma", "gemma2", "mixtral", "qwen2_moe", "qwen3_moe")
TP_CASES = [
    ("llama", False, False),
    ("llama", True, False),
    ("llama", True, True),
    *[(m, False, False) for m in TP_FAMILIES],
    *[(m, False, True) for m in TP_FAMILIES],
    ("gemma2", True, True),
    ("mixtral", True, True),
    ("llama", False, False, True),
    ("llama", True, True, True),
    ("qwen3_moe", True, False, True),
    ("gemma2", False, False, True),  # tied: the head stays whole
]
DECODE_CASES = [("decode", m) for m in ("llama", *TP_FAMILIES)]


@pytest.fixture(scope="module")
def tp_results() -> dict[tuple, str | None]:
    import torch.multiprocessing as mp

    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_tp_worker, args=(_free_port(), TP_CASES + DECODE_CASES + [("dropout",)], results), nprocs=2, join=True)
        return dict(results)


def _case_id(case: tuple) -> str:
    return "-".join([case[0], *(flag for flag, on in zip(("lora", "sp", "vocab"), case[1:], strict=False) if on)])


@pytest.mark.slow
@pytest.mark.parametrize("case", TP_CASES, ids=[_case_id(c) for c in TP_CASES])
def test_tensor_parallel_computes_the_unsplit_loss_and_gradients(
    tp_results: dict[tuple, str | None], case: tuple
) -> None:
    assert case[0] in TENSOR_PARALLEL_TYPES
    assert tp_results[case] is None, tp_results[case]


# --- pipeline stages --------------------------------------------------------------------------------


@pytest.mark.parametrize("model_type", PIPELINE_TYPES)
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_pipeline_stages_compute_the_unsplit_logits(model_type: str, lora: bool) -> None:
    import copy

    from rigpilot.engine.workers.pipeline import DecoderStage, decoder_parts

    model = build(model_type, lora).eval()
    inputs, _ = batch()
    with torch.no_grad():
        expected = model(input_ids=inputs, use_cache=False).logits
        stages = [DecoderStage(decoder_parts(copy.deepcopy(model), "pp"), i, 2) for i in range(2)]
        got = stages[1](stages[0](inputs))
        # Inference's prefill: the last stage's head on the last position only (Gemma 2's soft-cap included).
        last = stages[1](stages[0](inputs), logits_to_keep=1)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert last.shape == (BATCH, 1, expected.shape[-1])
    torch.testing.assert_close(last, expected[:, -1:], rtol=1e-5, atol=1e-5)
    names = [n for s in stages for n, _ in s.named_parameters()]
    untied = [n for n in names if n.endswith("lm_head.weight")] if model.config.tie_word_embeddings else []
    assert sorted(set(names) - set(untied)) == sorted(n for n, _ in model.named_parameters())
    # Under LoRA only the adapters train, on every stage (the untied head copy included).
    trainable = {n for s in stages for n, p in s.named_parameters() if p.requires_grad}
    assert trainable - set(untied) == {n for n, p in model.named_parameters() if p.requires_grad}
    assert bool(trainable & set(untied)) == (bool(untied) and not lora)


@pytest.mark.parametrize("model_type", PIPELINE_TYPES)
def test_pipeline_stages_decode_left_padded_rows_as_the_unsplit_model(model_type: str) -> None:
    """Inference's way through two stages: a left-padded prefill in two chunks, then decode steps, under sdpa."""
    import copy

    from transformers import DynamicCache

    from rigpilot.engine.workers.pipeline import DecoderStage, decoder_parts

    model = build(model_type, False).eval()
    if not getattr(model.config, "attn_logit_softcapping", None):  # sdpa cannot soft-cap: Gemma 2 stays eager
        model.config._attn_implementation = "sdpa"  # the decode mask a stage builds itself is sdpa's
    stages = [DecoderStage(decoder_parts(copy.deepcopy(model), "pp"), i, 2) for i in range(2)]
    ids, _ = batch(seed=3)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # the first row is shorter: left padding, as generate() pads
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    whole, split = DynamicCache(config=model.config), [DynamicCache(config=model.config) for _ in stages]
    half = SEQ // 2
    with torch.no_grad():
        for step in range(3):
            expected = model(input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=whole,
                             use_cache=True).logits[:, -1]  # fmt: skip
            chunks = [(0, half), (half, SEQ)] if step == 0 else [(0, ids.shape[1])]
            for a, b in chunks:
                keys = mask[:, : mask.shape[1] - ids.shape[1] + b]
                hidden = stages[0](ids[:, a:b], attention_mask=keys, position_ids=positions[:, a:b],
                                   past_key_values=split[0])  # fmt: skip
                got = stages[1](hidden, attention_mask=keys, position_ids=positions[:, a:b],
                                past_key_values=split[1], logits_to_keep=1)[:, -1]  # fmt: skip
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
            ids = expected.argmax(-1)[:, None]
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
            positions = positions[:, -1:] + 1


def test_capability_tables_say_what_the_workers_split() -> None:
    for mt in TENSOR_PARALLEL_TYPES:
        assert why_not(Layout(tp=2, sequence_parallel=True), method="lora", model_type=mt) is None
    for mt in PIPELINE_TYPES:
        assert why_not(Layout(pp=2), method="lora", model_type=mt) is None
    reason = why_not(Layout(tp=2), model_type="phi3")
    assert reason is not None and "fused qkv_proj" in reason and "\n" not in reason
    assert "not one of them" in (why_not(Layout(tp=2), "infer", model_type="gpt2") or "")
    assert "not one of them" in (why_not(Layout(pp=2), model_type="gpt2") or "")


def test_tensor_parallel_refuses_fused_projections_with_the_capability_reason() -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    from rigpilot.engine.errors import UserError
    from rigpilot.engine.workers.parallelize import apply_tensor_parallel

    with pytest.raises(UserError, match=r"tensor parallel supports .*model type 'phi3' is not one of them"):
        # The model type is checked before the mesh is used.
        apply_tensor_parallel(build("phi3", False), DeviceMesh.__new__(DeviceMesh))
    assert not dist.is_initialized()


@pytest.mark.slow
@pytest.mark.parametrize("case", DECODE_CASES, ids=[m for _, m in DECODE_CASES])
def test_tensor_parallel_decodes_with_a_kv_cache_as_the_unsplit_model(tp_results: dict, case: tuple) -> None:
    assert tp_results[case] is None, tp_results[case]


@pytest.mark.slow
def test_lora_dropout_under_tensor_parallel_keeps_the_ranks_together(tp_results: dict) -> None:
    assert tp_results[("dropout",)] is None, tp_results[("dropout",)]


def test_shard_dropout_draws_a_mask_per_rank_from_the_shared_stream() -> None:
    from rigpilot.engine.workers.parallelize import ShardDropout

    x = torch.ones(2, 8, 512)
    outs, states = [], []
    for rank in (0, 1):
        torch.manual_seed(7)
        outs.append(ShardDropout(0.25, rank).train()(x))
        states.append(torch.get_rng_state())
    assert torch.equal(states[0], states[1])  # one draw each from the shared generator
    assert not torch.equal(outs[0], outs[1])  # but masks of their own
    assert 0.7 < float((outs[0] != 0).float().mean()) < 0.8
    torch.testing.assert_close(outs[0].unique(), torch.tensor([0.0, 1 / 0.75]))
    torch.manual_seed(7)
    assert torch.equal(ShardDropout(0.25, 0).train()(x), outs[0])  # recomputation redraws the same mask
    assert torch.equal(ShardDropout(0.25, 0).eval()(x), x)
