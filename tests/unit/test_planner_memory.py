"""Memory formulas of the planner, checked against hand-computed and measured numbers."""

from __future__ import annotations

import dataclasses

import pytest

from rigpilot.engine.errors import UserError
from rigpilot.engine.hardware.simulated import load_profile
from rigpilot.engine.models.spec import Linear, ModelSpec
from rigpilot.engine.planner.links import Topology
from rigpilot.engine.planner.memory import (
    GIB,
    NF4_BYTES_DQ,
    MemoryModel,
    plan_memory,
    predict_components,
    predict_kv_cache,
)
from rigpilot.engine.planner.model import model_facts, train_flops_per_token
from rigpilot.engine.planner.plan import LoraSettings, Parallelism, Workload


def llama(h: int, inter: int, layers: int, heads: int, kv: int, vocab: int, *, tied: bool = False, ctx: int = 4096) -> ModelSpec:
    d = h // heads
    lin = [
        Linear("q_proj", h, heads * d), Linear("k_proj", h, kv * d), Linear("v_proj", h, kv * d),
        Linear("o_proj", heads * d, h), Linear("gate_proj", h, inter), Linear("up_proj", h, inter),
        Linear("down_proj", inter, h),
    ]
    per_layer = sum(x.in_features * x.out_features for x in lin) + 2 * h
    emb = vocab * h
    total = emb + (0 if tied else emb) + layers * per_layer + h
    return ModelSpec(
        id="tiny", architecture="LlamaForCausalLM", model_type="llama", params_total=total, params_active=total,
        params_embedding=emb, hidden_size=h, num_layers=layers, num_heads=heads, num_kv_heads=kv, head_dim=d,
        intermediate_size=inter, vocab_size=vocab, max_position_embeddings=ctx, tied_embeddings=tied, layer_linears=lin,
    )


def tiny() -> ModelSpec:
    return llama(256, 688, 2, 4, 2, 1000)


def llama_7b() -> ModelSpec:
    spec = llama(4096, 11008, 32, 32, 32, 32000)
    spec.id = "llama-2-7b"
    return spec


def test_tiny_llama_parameter_count_matches_the_real_model():
    # LlamaForCausalLM(hidden 256, intermediate 688, 2 layers, 4 heads, 2 kv heads, vocab 1000) has this many.
    assert tiny().params_total == 1_963_264
    assert llama_7b().params_total == 6_738_415_616


def _components(precision: str, ckpt: str = "none", method: str = "full", targets=None) -> dict[str, int]:
    return predict_components(
        tiny(), precision=precision, method=method, optimizer="adamw", checkpointing=ckpt, micro_batch=2, seq_len=128,
        lora_rank=8, lora_targets=targets,
    )


def test_params_grads_optimizer_by_precision():
    n = tiny().params_total
    amp = _components("bf16")
    assert (amp["params"], amp["grads"], amp["optimizer"]) == (4 * n, 4 * n, 8 * n)  # autocast keeps fp32 weights
    fp32 = _components("fp32")
    assert (fp32["params"], fp32["grads"], fp32["optimizer"]) == (4 * n, 4 * n, 8 * n)
    pure = _components("bf16-true")
    # Weights held in bf16: bf16 grads and Adam states, plus an fp32 master copy.
    assert (pure["params"], pure["grads"], pure["optimizer"]) == (2 * n, 2 * n, 4 * n + 4 * n)


def test_other_optimizers():
    n = tiny().params_total
    kw = dict(precision="bf16", method="full", checkpointing="none", micro_batch=1, seq_len=16)
    assert predict_components(tiny(), optimizer="sgd", **kw)["optimizer"] == 4 * n
    assert predict_components(tiny(), optimizer="adamw8bit", **kw)["optimizer"] == int(n * 2 * (1 + 4 / 256))


def test_activations_by_hand_for_bf16_autocast():
    # Per layer and token under autocast with fp32 weights (see memory.py): two RMSNorms keep x in fp32, rsqrt
    # and the fp32 normalized x (2 × (8h + 4)); q, k, v and gate, up each cast the fp32 norm output to bf16
    # (5 × 2h); SDPA keeps q, k, v, out and a per-head log-sum-exp (2·(2h + 2kv) + 4·heads); SwiGLU keeps
    # gate, act(gate), up and the product (4 × 2I). Plus bf16 copies of every weight, once per layer.
    h, kv, inter, heads, layers, vocab, seq, tokens = 256, 128, 688, 4, 2, 1000, 128, 256
    per_token = 2 * (8 * h + 4) + 5 * 2 * h + 2 * (2 * h + 2 * kv) + 4 * heads + 4 * 2 * inter
    assert per_token == 30 * h + 4 * kv + 8 * inter + 4 * heads + 8
    copies = 2 * (h * h + 2 * h * kv + h * h + 3 * h * inter)
    # Outside the layers: input ids, the final norm, the head's bf16 input and weight copy, the fp32
    # log-softmax and int64 labels of the loss, and the fp32 rotary cos/sin tables.
    edge = tokens * (8 + 8 * h + 4 + 2 * h + 4 * vocab + 8) + 2 * vocab * h + 2 * seq * 64 * 4
    expected = layers * (per_token * tokens + copies) + edge
    assert _components("bf16")["activations_saved"] == expected


# Measured with torch.autograd.graph.saved_tensors_hooks on transformers 5's LlamaForCausalLM (SDPA), unique
# storages that are not parameters, tiny() at micro-batch 2 × 128 tokens. The 4-byte scalar of the loss is
# not modelled.
MEASURED = {
    ("fp32", "none"): 12_248_068,
    ("fp32", "full"): 2_339_844,
    ("bf16", "none"): 12_186_628,
    ("bf16", "full"): 2_720_772,
    ("bf16-true", "none"): 7_300_100,
    ("bf16-true", "full"): 1_815_556,
}


@pytest.mark.parametrize(("precision", "ckpt"), sorted(MEASURED))
def test_activations_match_pytorch_measurements(precision, ckpt):
    assert _components(precision, ckpt)["activations_saved"] == pytest.approx(MEASURED[(precision, ckpt)], abs=8)


def test_lora_activations_and_parameters():
    c = _components("bf16", method="lora", targets=["q_proj", "v_proj"])
    lora = 2 * 8 * ((256 + 256) + (256 + 128))  # rank × (in + out) for q and v, two layers
    assert c["params"] == tiny().params_total * 2 + lora * 4  # bf16 base, fp32 adapters
    assert c["grads"] == lora * 4
    assert c["optimizer"] == lora * 8
    assert c["activations_saved"] == pytest.approx(5_580_804, rel=0.005)  # measured as above, peft 0.21
    ckpt = _components("bf16", "full", method="lora", targets=["q_proj", "v_proj"])
    assert ckpt["activations_saved"] == pytest.approx(1_551_364, abs=8)


def test_qlora_quantizes_block_linears_only():
    spec = tiny()
    c = _components("bf16", method="qlora", targets="all-linear")
    linears = 2 * sum(x.in_features * x.out_features for x in spec.layer_linears)
    lora = 2 * 8 * sum(x.in_features + x.out_features for x in spec.layer_linears)
    expected = linears * NF4_BYTES_DQ + (spec.params_total - linears) * 2 + lora * 4
    assert c["params"] == int(expected)


def test_unknown_lora_target_is_a_user_error():
    with pytest.raises(UserError, match="not a linear"):
        _components("bf16", method="lora", targets=["nope_proj"])


def test_checkpointing_orders_activation_memory():
    acts = [_components("bf16", ckpt)["activations_saved"] for ckpt in ("none", "selective", "full")]
    assert acts[0] > acts[1] > acts[2]


def test_kv_cache_exact_and_gqa_aware():
    assert predict_kv_cache(llama_7b(), 1, 4096, 2) == 2 * 1024**3  # 2 × 32 × 32 × 128 × 4096 × 2 bytes
    gqa = llama(4096, 14336, 32, 32, 8, 128256)
    assert predict_kv_cache(gqa, 4, 8192, 2) == 2 * 32 * 8 * 128 * 8192 * 4 * 2
    encoder = dataclasses.replace(tiny(), is_decoder=False)
    assert predict_kv_cache(encoder, 8, 512, 2) == 0


def test_flops_per_token():
    m = model_facts(llama_7b())
    n = 6_738_415_616 - 32000 * 4096  # embedding lookups are not matmuls; the untied head is
    assert m.matmul_params_per_token == n
    assert train_flops_per_token(m, 2048) == 6 * n + 12 * 32 * 4096 * 2048
    assert train_flops_per_token(m, 2048, frozen_base=True) == 4 * n + 12 * 32 * 4096 * 2048


# -- sharding -------------------------------------------------------------------------------------------------


def _stage(par: Parallelism, method: str = "full", optimizer: str = "adamw"):
    w = Workload(model="llama-2-7b", method=method, seq_len=2048, global_batch=16, optimizer=optimizer,
                 lora=LoraSettings() if method != "full" else None)
    mm = MemoryModel(model_facts(llama_7b()), w)
    return mm.train_stage(par, 0, "hopper")


def _par(**kw) -> Parallelism:
    base = dict(gpu_indices=list(range(8)), dp=8, micro_batch=1, grad_accum=2, checkpointing="full")
    return Parallelism(**{**base, **kw})


def test_zero_stages_shard_the_right_terms():
    n = 6_738_415_616
    ddp = _stage(_par(backend="ddp", zero_stage=0, shard_degree=1))
    assert (ddp.weights, ddp.gradients, ddp.optimizer) == (4 * n, 4 * n, 8 * n)
    z1 = _stage(_par(backend="deepspeed", zero_stage=1, shard_degree=8))
    assert (z1.weights, z1.gradients, z1.optimizer) == (2 * n, 2 * n, pytest.approx(12 * n / 8))
    z2 = _stage(_par(backend="deepspeed", zero_stage=2, shard_degree=8))
    assert (z2.weights, z2.gradients, z2.optimizer) == (2 * n, pytest.approx(2 * n / 8), pytest.approx(12 * n / 8))
    z3 = _stage(_par(backend="deepspeed", zero_stage=3, shard_degree=8))
    assert (z3.weights, z3.gradients, z3.optimizer) == (pytest.approx(2 * n / 8), pytest.approx(2 * n / 8), pytest.approx(12 * n / 8))
    fsdp = _stage(_par(backend="fsdp", zero_stage=3, shard_degree=8))
    assert (fsdp.weights, fsdp.gradients, fsdp.optimizer) == (
        pytest.approx(4 * n / 8), pytest.approx(4 * n / 8), pytest.approx(8 * n / 8),
    )
    hsdp = _stage(_par(backend="fsdp", zero_stage=3, shard_degree=4))
    assert hsdp.optimizer == pytest.approx(8 * n / 4)
    # Activations do not depend on how the states are sharded (same regime).
    assert z3.activations == pytest.approx(fsdp.activations)


def test_offload_moves_state_to_the_host():
    n = 6_738_415_616
    off = _stage(_par(backend="deepspeed", zero_stage=2, shard_degree=8, offload_optimizer=True))
    assert off.optimizer == 0
    assert off.host_offloaded == pytest.approx((12 + 4) * n / 8)  # master + Adam states + fp32 gradients
    both = _stage(_par(backend="deepspeed", zero_stage=3, shard_degree=8, offload_optimizer=True, offload_params=True))
    assert both.weights == 0 and both.optimizer == 0


def test_tensor_parallel_splits_weights_and_sequence_parallel_the_rest():
    one = _stage(_par(dp=1, gpu_indices=[0], backend="single", checkpointing="none"))
    tp = _stage(_par(dp=1, tp=4, gpu_indices=[0, 1, 2, 3], backend="ddp", checkpointing="none"))
    sp = _stage(_par(dp=1, tp=4, gpu_indices=[0, 1, 2, 3], backend="ddp", checkpointing="none", sequence_parallel=True))
    # The engine keeps the embedding whole on every rank (its head is split by vocabulary); norms stay whole.
    embedding = 32000 * 4096 * 4  # fp32 weights
    assert tp.weights == pytest.approx((one.weights - embedding) / 4 + embedding, rel=0.01)
    assert one.activations > tp.activations > sp.activations


def test_pipeline_in_flight_micro_batches():
    kw = dict(gpu_indices=[0, 1, 2, 3], dp=1, pp=4, micro_batch=1, grad_accum=8, checkpointing="none",
              stage_layers=[[0, 8], [8, 16], [16, 24], [24, 32]])
    one_f = _stage(Parallelism(pipeline_schedule="1f1b", **kw))
    gpipe = _stage(Parallelism(pipeline_schedule="gpipe", **kw))
    # The first stage of 1F1B holds p = 4 micro-batches in flight, GPipe all m = 8.
    assert gpipe.activations > one_f.activations * 1.8


def test_lora_keeps_the_base_frozen_and_small_states():
    lora = _stage(_par(dp=1, gpu_indices=[0], backend="single"), method="lora")
    assert lora.weights == pytest.approx(6_738_415_616 * 2, rel=0.05)
    adapters = 16 * 32 * sum(x.in_features + x.out_features for x in llama_7b().layer_linears)  # all-linear, rank 16
    assert lora.gradients == pytest.approx(adapters * 4)
    assert lora.optimizer == pytest.approx(adapters * 8)


def test_plan_memory_per_gpu_and_host():
    machine = load_profile("4x-rtx4090")
    topo = Topology(machine, [0, 1, 2, 3])
    w = Workload(model="llama-2-7b", seq_len=2048, global_batch=16)
    mm = MemoryModel(model_facts(llama_7b()), w)
    par = Parallelism(gpu_indices=[0, 1, 2, 3], dp=4, zero_stage=3, shard_degree=4, backend="deepspeed",
                      micro_batch=1, grad_accum=4, checkpointing="full", offload_optimizer=True, offload_params=True)
    memory, host = plan_memory(mm, par, topo)
    assert [m.gpu for m in memory] == [0, 1, 2, 3]
    for m in memory:
        assert m.total == m.weights + m.gradients + m.optimizer + m.activations + m.kv_cache + m.buffers + m.overhead
        assert m.headroom == m.capacity - m.total
        assert 0.5 * GIB <= m.overhead <= 3 * GIB
    assert host.offloaded > 100 * GIB and host.needed > host.offloaded
    assert host.available == 256 * GIB and host.fits


def test_inference_weights_by_bits():
    topo = Topology(load_profile("1x-rtx4090"), [0])
    par = Parallelism(gpu_indices=[0], backend="inference")
    sizes = []
    for bits in (16, 8, 4):
        w = Workload(model="llama-2-7b", task="infer", seq_len=4096, global_batch=1, new_tokens=256, weight_bits=bits)
        memory, _ = plan_memory(MemoryModel(model_facts(llama_7b()), w), par, topo)
        sizes.append(memory[0].weights)
        assert memory[0].kv_cache == 2 * 1024**3
    assert sizes[0] == pytest.approx(6_738_415_616 * 2, rel=1e-6)
    assert sizes[0] > sizes[1] > sizes[2] > sizes[0] / 4.5


def test_gpt2_gelu_new_matches_measurements():
    # GPT-2 (LayerNorm, fused c_attn, Python gelu_new, tied head) at hidden 128, 2 layers, vocab 512, measured by
    # engine.accuracy at micro-batch 2 × 64 tokens with CUDA's autocast policy, which runs gelu_new's pow in fp32.
    h, inter, vocab = 128, 512, 512
    lin = [Linear("c_attn", h, 3 * h, True), Linear("c_proj", h, h, True), Linear("c_fc", h, inter, True),
           Linear("c_proj", inter, h, True)]
    spec = ModelSpec(
        id="tiny-gpt2", architecture="GPT2LMHeadModel", model_type="gpt2", params_total=1_980_416 // 4,
        params_active=1_980_416 // 4, params_embedding=vocab * h + 256 * h, hidden_size=h, num_layers=2, num_heads=4,
        num_kv_heads=4, head_dim=32, intermediate_size=inter, vocab_size=vocab, max_position_embeddings=256,
        tied_embeddings=True, layer_linears=lin,
    )
    kw = dict(method="full", optimizer="adamw", checkpointing="none", micro_batch=2, seq_len=64)
    assert predict_components(spec, precision="fp32", **kw)["activations_saved"] == pytest.approx(4_075_012, rel=0.001)
    assert predict_components(spec, precision="bf16", **kw)["activations_saved"] == pytest.approx(4_042_244, rel=0.001)


@pytest.mark.parametrize("model_type", ["deepseek_v2", "deepseek_v3", "llama"])
def test_kv_cache_matches_what_transformers_caches(model_type):
    """The cache a real forward pass fills, byte for byte: MLA keeps one latent per token and layer."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from rigpilot.engine.models.formulas import spec_from_config

    small = {"vocab_size": 128, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64}  # fmt: skip
    if model_type != "llama":
        small.update(num_key_value_heads=4, moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2,
                     n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=None,
                     qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=12, n_group=1, topk_group=1)  # fmt: skip
    config = AutoConfig.for_model(model_type, **small)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    batch, tokens = 3, 7
    with torch.no_grad():
        cache = model(input_ids=torch.randint(0, 128, (batch, tokens)), use_cache=True).past_key_values
    cached = sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))
    spec = spec_from_config(config.to_dict())
    assert predict_kv_cache(spec, batch, tokens, 4) == cached
