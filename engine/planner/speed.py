"""Step time: compute at each GPU's achievable rate, communication over the links a plan uses, bubbles.

Training FLOPs per token are 6N + 12·L·h·s (4N for frozen base weights), plus a
forward pass again under full recomputation. The blocks' memory-bound elementwise ops
(norms, rotary, activation, residual adds) are timed apart by the bytes they stream,
forward and backward every step and forward again under any recomputation: selective
recomputation reruns only them. FSDP2 splits each
gathered unit into its parameters on the compute stream, once per gather per
micro-batch, so accumulation steps are not free. Communication volumes are the
standard ones: a ring all-reduce moves 2(n-1)/n of the buffer over each link,
reduce-scatter and all-gather (n-1)/n. DDP and ZeRO gradient reduction hides
behind the last micro-batch's backward pass, FSDP's gathers behind each
micro-batch's compute; tensor-parallel all-reduces (two per layer forward, two
backward in Megatron's layout) sit on the critical path. A pipeline of p stages
and m micro-batches idles for (p-1)/(m+p-1) of its time. FSDP2's CPU offload
copies each unit's parameter shard to the GPU at every all-gather and each
gradient shard back per micro-batch over the GPU's PCIe link, prefetched one
unit ahead so only what the compute cannot cover (and the first unit) shows;
the host accumulates the gradient shards and runs AdamW on the CPU, all of it
streaming through host memory whose bandwidth the ranks on one NUMA node share.

The training recipe (engine.recipe): the optimizer step touches the bytes of its master weights, gradients and
state (pure bf16 and 8-bit AdamW touch fewer); chunked cross-entropy runs the head's forward again in backward
(an upper bound: the chunks are recomputed); activation offloading copies every saved block activation out
to host RAM in forward and back in backward over the GPU's PCIe link, overlapped with the micro-batch's
compute where the link is fast enough, so it costs max(0, transfer - compute); torch.compile changes the
share of peak compute reached to the one fitted to published compiled runs (resources/speed_priors.json).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from rigpilot.engine.planner.links import MEMORY_BW_EFFICIENCY, Link, Topology
from rigpilot.engine.planner.memory import (
    DDP_BUCKET_BYTES,
    INT8_BYTES,
    NF4_BYTES_DQ,
    MemoryModel,
    ceil_div,
    stage_range,
)
from rigpilot.engine.planner.model import ModelFacts, train_flops_per_token
from rigpilot.engine.planner.plan import CommItem, Figure, Parallelism, Timing, Workload

OVERLAP = 0.85  # share of compute that communication can hide behind (NCCL kernels take SMs too)
QLORA_RATE = 0.65  # NF4 weights are dequantized before every matmul
INT8_RATE = 0.4  # LLM.int8 decomposes outliers: slow
# Selective checkpointing (engine.workers.parallelize) keeps every matmul and attention output and recomputes the
# rest of the block's forward in backward: norms, rotary embedding, the activation function, residual adds. Those
# ops are memory-bound, so their recompute costs the bytes they stream at the GPU's memory bandwidth, not FLOPs.
# Bytes per element (bf16 tensors, 2 bytes each read or written), eager as transformers writes them: RMSNorm
# upcasts to fp32 and runs to(fp32), pow, mean, x*rsqrt, to(bf16) and *weight as six kernels (6+8+4+8+6+4);
# LayerNorm is one kernel (read, write); a residual add reads two and writes one; rotary runs q*cos, the negated
# half, cat, *sin and the add (4+2+4+4+6); SiLU(gate)*up reads and writes the MLP width twice (4+6), a plain
# activation once. torch.compile fuses each chain into one kernel that reads its inputs and writes its output once.
# Published scale of the effect: torchtitan's docs/performance.md (13B, 64 A100, local batch 2) measures no
# checkpointing at 2162 tok/s and op-level SAC, which also recomputes every second matmul, at 1904.
EAGER_ELEMENTWISE_BYTES = {"rmsnorm": 36.0, "layernorm": 4.0, "residual": 6.0, "rope": 20.0, "gated": 10.0, "act": 4.0}
COMPILED_ELEMENTWISE_BYTES = {"rmsnorm": 6.0, "layernorm": 6.0, "residual": 0.0, "rope": 4.0, "gated": 6.0, "act": 4.0}
# The same elementwise ops run in every step, not only when recomputed: once forward and, as their backward, about
# twice those bytes. SiLU(gate)*up streams 10 bytes per element forward and 18 backward (g*silu, g*up, then
# silu_backward reading g and gate); eager RMSNorm's autograd runs each of its six kernels' backward plus two
# reductions; each branch point of the residual stream sums two gradients (6 bytes) where the forward's add costs
# nothing in backward. So 3 passes of the forward's bytes, from that tally, not fitted (2.5 or 4 move the held-out
# medians by up to 3 points; benchmarks/published_runs.py). Their time is not a share of the matmuls' FLOPs: per
# token they scale with the width h and the matmuls with h², so a 7B layer spends about twice the share of its time
# on them that a 70B layer does. Counting them apart lets one fitted matmul efficiency hold across model sizes
# (fms-fsdp's 7B, no checkpointing, runs at 57% MFU eager and 68% compiled, where compile fuses these chains:
# https://pytorch.org/blog/maximizing-training-throughput/).
ELEMENTWISE_TRAIN_PASSES = 3.0
CPU_ADAM_PARAMS_PER_CORE_S = 1.0e8  # DeepSpeed's CPU Adam, AVX2/AVX-512
# torch.optim.AdamW on the CPU (fp32, for-each-tensor): reads parameter, gradient, exp_avg and exp_avg_sq, writes
# the first three and its sqrt(v)+eps temporary and reads it back: 16 + 12 + 8 bytes per parameter.
CPU_OPTIMIZER_BYTES = {"adamw": 36.0, "adamw8bit": 16.0, "sgd": 16.0}
# DeepSpeed's fused CPU Adam: reads fp32 parameter, gradient and both moments, writes three back and the bf16 copy.
DEEPSPEED_CPU_ADAM_BYTES = 30.0
# Accumulating an offloaded fp32 gradient shard on the host (a += b): two reads and a write per element.
HOST_ACCUMULATE_BYTES = 12.0
# Host memory bandwidth a NUMA node's cores reach streaming (STREAM-triad-like), by CPU class, assumed: the machine
# model does not measure it, and plans that offload say which figure they used. (pattern, GB/s, class in words)
HOST_MEMORY_CLASSES = (
    # 8- and 12-channel DDR5 sockets (Xeon 4th/5th gen Scalable, EPYC 9004/9005): 307-614 GB/s peak.
    (re.compile(r"xeon.*\b(platinum|gold|silver|bronze) [3-9][45]\d\d|xeon.*\bw[579]-[23]\d\d\d|epyc 9\d\d[45]|threadripper pro 7\d\d\d"),
     200.0, "DDR5 server or workstation socket"),
    # 8-channel DDR4-3200 sockets (older Xeon Scalable, EPYC 7002/7003, Threadripper PRO 3000/5000): 205 GB/s peak.
    (re.compile(r"epyc|xeon|threadripper pro"), 120.0, "DDR4 server or workstation socket"),
    # 4-channel HEDT (Threadripper 2000/3000/7000 non-PRO): 100-166 GB/s peak.
    (re.compile(r"threadripper"), 80.0, "four-channel HEDT socket"),
)
HOST_MEMORY_DESKTOP = (60.0, "two-channel desktop socket")  # DDR4/DDR5 desktops: 50-90 GB/s peak
HOST_STREAM_PER_CORE_GBS = 10.0  # one core streaming: caps a rank's share when it has few cores (OMP threads)
DECODE_OVERHEAD_PER_LAYER_S = 0.25e-3  # eager PyTorch launches a few dozen kernels per layer per token
DECODE_QUANT_FACTOR = {16: 1.0, 8: 2.5, 4: 1.5}  # dequantization on every decode step
OPTIMIZER_BYTES = {"adamw": 28.0, "adamw8bit": 12.0, "sgd": 16.0}  # touched per parameter in one step
def optimizer_step_bytes(optimizer: str, master_bytes: int, state_bytes: float) -> float:
    """Bytes one optimizer step touches per parameter: AdamW reads and writes the weight and its state and reads
    the gradient (28 for fp32 master weights, 14 in pure bf16; 8-bit AdamW's state is a quarter of that)."""
    if optimizer not in ("adamw", "adamw8bit"):
        return OPTIMIZER_BYTES.get(optimizer, 28.0)
    return 3.0 * master_bytes + 2.0 * state_bytes


def recompute_bytes_per_token(m: ModelFacts, compile: bool, tp: int = 1, sequence_parallel: bool = False) -> float:
    """Bytes one block's memory-bound forward ops stream per token on one rank: what selective checkpointing runs
    again. Tensor parallel splits rotary, the q/k norms and the activation by heads and columns; the block's norms
    and residual adds run over the whole hidden size on every rank unless sequence parallel splits the tokens."""
    b = COMPILED_ELEMENTWISE_BYTES if compile else EAGER_ELEMENTWISE_BYTES
    norm = b["layernorm"] if m.layernorm else b["rmsnorm"]
    whole = m.norms_per_layer * norm * m.h + 2 * b["residual"] * m.h
    split = (b["gated"] if m.gated else b["act"]) * m.inter_per_token
    if m.rope:
        split += b["rope"] * (m.q_dim + m.kv_dim)
    if m.qk_norm:
        split += norm * (m.q_dim + m.kv_dim)
    return whole / (tp if sequence_parallel else 1) + split / tp


def fsdp_copy_out_bytes(blocks: float, root: float, layers: int, reshard: bool) -> float:
    """Bytes FSDP2's all-gather copy-out streams per micro-batch on the compute stream, for the gathered bytes of
    a stage's `layers` blocks (`blocks`, all of them) and of its root unit (`root`: embedding, final norm, head).

    FSDP2 waits for each all-gather and then splits the gathered buffer into the unit's parameters
    (foreach_all_gather_copy_out, split_with_sizes_copy) on the default stream: a read and a write of every
    gathered byte, per gather, per micro-batch, however many tokens the micro-batch has. Its copy-in and the
    reduce-scatter's chunk_cat run on the collectives' own streams and hide with them. `reshard`: each block
    but the last is gathered again for backward; the engine keeps the last block gathered (its backward comes
    right after) and FSDP2 never reshards the root after forward (FSDPState._lazy_init), so those gather once.
    """
    if reshard and layers > 0:
        return 2.0 * (blocks * (2 * layers - 1) / layers + root)
    return 2.0 * (blocks + root)


REF_TOKENS = 4096  # the micro-batch size (tokens) and width at which the efficiency priors hold
REF_WIDTH = 4096


def shape_factor(tokens: float, width: float) -> float:
    """How matmul efficiency scales with micro-batch tokens and layer width, relative to 4096 × 4096.

    Small matmuls leave SMs idle and are dominated by launch and memory traffic.
    """
    t = (tokens / (tokens + 512)) / (REF_TOKENS / (REF_TOKENS + 512))
    w = (width / (width + 512)) / (REF_WIDTH / (REF_WIDTH + 512))
    return min(t * w, 1.1)


def experts_touched(k: int, experts: int, tokens: int) -> float:
    """Expected distinct experts of one layer that `tokens` tokens routed top-`k` of `experts` reach, taking each
    token's experts as uniform and independent: E · (1 − (1 − k/E)^tokens). One token reads k, a large batch all."""
    if experts <= 0 or k >= experts:
        return float(max(experts, 0))
    return experts * (1.0 - (1.0 - k / experts) ** max(tokens, 0))


def bubble_fraction(stages: int, micro_batches: int) -> float:
    """Share of a pipeline's time its stages idle: (p-1)/(m+p-1), for GPipe and 1F1B alike."""
    return (stages - 1) / (micro_batches + stages - 1)


def allreduce_s(nbytes: float, n: int, link: Link) -> float:
    if n <= 1 or nbytes <= 0:
        return 0.0
    return 2 * (n - 1) / n * nbytes / (link.gbs * 1e9) + 2 * (n - 1) * link.latency_s


def gather_s(nbytes: float, n: int, link: Link) -> float:
    """All-gather or reduce-scatter of a buffer that is `nbytes` when whole."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    return (n - 1) / n * nbytes / (link.gbs * 1e9) + (n - 1) * link.latency_s


@dataclass(frozen=True)
class Groups:
    """The GPU groups of a plan's mesh (ranks ordered pp, dp, tp with tp fastest)."""

    tp: list[list[int]]
    dp: list[list[int]]
    shard: list[list[int]]  # FSDP sharding groups (== dp unless HSDP)
    replicate: list[list[int]]  # HSDP replica groups
    stages: list[list[int]]
    pp_pairs: list[list[int]]  # neighbouring stages' peers

    @classmethod
    def of(cls, par: Parallelism) -> Groups:
        g = par.gpu_indices
        dp, tp, pp = par.dp, par.tp, par.pp

        def gpu(s: int, d: int, j: int) -> int:
            return g[(s * dp + d) * tp + j]

        z = par.shard_degree if par.zero_stage >= 1 else dp
        z = max(min(z, dp), 1)
        return cls(
            tp=[[gpu(s, d, j) for j in range(tp)] for s in range(pp) for d in range(dp)],
            dp=[[gpu(s, d, j) for d in range(dp)] for s in range(pp) for j in range(tp)],
            shard=[[gpu(s, k * z + d, j) for d in range(z)] for s in range(pp) for j in range(tp) for k in range(dp // z)],
            replicate=[[gpu(s, k * z + d, j) for k in range(dp // z)] for s in range(pp) for j in range(tp) for d in range(z)],
            stages=[g[s * dp * tp : (s + 1) * dp * tp] for s in range(pp)],
            pp_pairs=[[gpu(s, d, j), gpu(s + 1, d, j)] for s in range(pp - 1) for d in range(dp) for j in range(tp)],
        )


class SpeedModel:
    """Step times for one model, workload and machine."""

    def __init__(self, m: ModelFacts, w: Workload, topo: Topology, mm: MemoryModel) -> None:
        self.m, self.w, self.topo, self.mm = m, w, topo, mm
        self.peak_dtype = "fp32" if mm.dtype == "fp32" else mm.dtype
        self.layer_mm = sum(u.lin.in_features * u.lin.out_features * u.per_token for u in m.linears())
        # Of which the mixture-of-experts MLP (experts, router, shared experts): tensor parallel keeps it whole on
        # every rank (engine.capability), so each rank multiplies by all of it.
        self.moe_mm = (
            sum(u.lin.in_features * u.lin.out_features * u.per_token for u in (*m.mlp_in, *m.mlp_out)) if m.spec.is_moe else 0
        )
        self.head_mm = m.vocab * m.h if m.is_decoder else 0
        self.frozen = w.training and w.method != "full"
        # The search times thousands of plans that share GPU groups; these lookups repeat.
        self._groups: dict[tuple, Groups] = {}
        self._rates: dict[tuple[tuple[int, ...], bool], float] = {}
        self._collectives: dict[tuple[tuple[int, ...], ...], Link] = {}

    # -- shared -----------------------------------------------------------------------------------------
    def _base_rate(self, gpus: list[int], compile: bool = False) -> float:
        key = (tuple(gpus), compile)
        found = self._rates.get(key)
        if found is None:
            rate = min(self.topo.gpus[i].step_tflops(self.peak_dtype, compile=compile) for i in gpus)
            found = self._rates[key] = rate * 1e12
        return found

    def _rate(self, gpus: list[int], tokens: float, width: float, compile: bool = False) -> float:
        """FLOP/s of the slowest GPU among `gpus` for matmuls of this shape (eager, or under torch.compile)."""
        return self._base_rate(gpus, compile) * shape_factor(tokens, width)

    def _collective(self, groups: list[list[int]]) -> Link:
        key = tuple(tuple(g) for g in groups)
        found = self._collectives.get(key)
        if found is None:
            found = self._collectives[key] = self.topo.collective(groups)
        return found

    def groups(self, par: Parallelism) -> Groups:
        key = (tuple(par.gpu_indices), par.dp, par.tp, par.pp, par.zero_stage, par.shard_degree)
        found = self._groups.get(key)
        if found is None:
            found = self._groups[key] = Groups.of(par)
        return found

    def _figures(self, par: Parallelism, comm: list[CommItem], links: dict[str, Link], compile: bool = False) -> list[Figure]:
        figs = self.topo.compute_figures(par.gpu_indices, self.peak_dtype, compile=compile)
        if not self.w.training:
            for name in dict.fromkeys(self.topo.gpus[i].short_name for i in par.gpu_indices):
                g = next(self.topo.gpus[i] for i in par.gpu_indices if self.topo.gpus[i].short_name == name)
                src = "spec" if g.spec_key else "assumed"
                figs.append(Figure(f"memory bandwidth, {name}", g.memory_bandwidth_gbs, "GB/s", src))
        for what, link in links.items():
            src = "measured" if link.measured else "assumed"
            figs.append(Figure(f"bus bandwidth, {what} ({link.label})", round(link.gbs, 3), "GB/s", src))
        nl = self.topo.internode
        if nl is not None and par.nodes > 1:
            if nl.source == "given":
                figs.append(Figure(f"link between nodes, {nl.label}", nl.gbs, "GB/s", "measured"))
            else:
                per_node = f", {nl.nics} per node" if nl.nics > 1 else ""
                figs.append(Figure(f"line rate per NIC, {nl.label}{per_node}", nl.gbits, "Gb/s", "spec"))
                figs.append(Figure(f"share of the line rate NCCL reaches, {nl.label}", nl.efficiency, "", "assumed"))
        return figs

    # -- training ---------------------------------------------------------------------------------------
    def train(self, par: Parallelism, detail: bool = True, *, compile: bool = False) -> Timing:
        """Step time of a training plan; `detail` adds the communication items and figures it rests on.

        `compile`: each block runs under torch.compile, at the share of peak fitted to published compiled runs
        (resources/speed_priors.json) instead of the eager one; communication is the same either way.
        """
        m, w, topo, mm = self.m, self.w, self.topo, self.mm
        groups = self.groups(par)
        s = w.seq_len
        k = 4.0 if self.frozen else 6.0
        layer_flops = k * self.layer_mm + 12.0 * m.q_dim * s + 6.0 * mm.lora_per_layer
        if par.checkpointing == "full":
            layer_flops += 2.0 * self.layer_mm + 4.0 * m.q_dim * s
        head_flops = k * self.head_mm
        recipe = mm.recipe
        if recipe.loss_chunks > 1:
            head_flops += 2.0 * self.head_mm  # each chunk's logits recomputed in backward
        mb_tokens = par.micro_batch * s
        rate_scale = QLORA_RATE if w.method == "qlora" else 1.0
        c = mm.c
        links: dict[str, Link] = {}
        comm: list[CommItem] = []

        # Per-stage time of one micro-batch: compute, plus tensor-parallel all-reduces on the critical path.
        tp_link = self._collective(groups.tp) if par.tp > 1 else None
        stage_compute: list[float] = []
        stage_tp: list[float] = []
        for st in range(par.pp):
            a, b = stage_range(par, st, m.layers)
            n = b - a
            flops = mb_tokens * (n * layer_flops + (head_flops if st == par.pp - 1 else 0.0)) / par.tp
            rate = self._rate(groups.stages[st], mb_tokens, m.h / par.tp, compile) * rate_scale
            stage_compute.append(flops / rate + self._memory_bound_s(par, groups, st, n, mb_tokens, compile))
            tp_s = 0.0
            if tp_link is not None:
                n_ar = n * (6 if par.checkpointing == "full" else 4)
                tp_s = n_ar * allreduce_s(mb_tokens * m.h * c, par.tp, tp_link)
            stage_tp.append(tp_s)
        mbs = par.grad_accum
        slowest = max(range(par.pp), key=lambda i: stage_compute[i] + stage_tp[i])
        mb_time = stage_compute[slowest] + stage_tp[slowest]
        compute = mbs * stage_compute[slowest]
        exposed = mbs * stage_tp[slowest]
        bubble = (par.pp - 1) * mb_time  # = bubble_fraction(pp, m) of the (m + p - 1) slots the pipeline takes
        if tp_link is not None:
            links["tensor parallel"] = tp_link
            a, b = stage_range(par, slowest, m.layers)
            n_ar = (b - a) * (6 if par.checkpointing == "full" else 4)
            nbytes = int(mbs * n_ar * mb_tokens * m.h * c)
            comm.append(CommItem("tensor-parallel all-reduces", groups.tp[0], tp_link.label, nbytes, exposed, exposed))

        # Optimizer step on the GPU (memory-bound), unless the optimizer lives on the CPU.
        opt_s = 0.0
        if not par.offload_optimizer and not par.offload_params:
            for st in range(par.pp):
                trainable = self._trainable(par, st)
                z = par.shard_degree if par.zero_stage >= 1 else 1
                bw = min(topo.gpus[i].memory_bandwidth_gbs for i in groups.stages[st]) * 1e9 * MEMORY_BW_EFFICIENCY
                step_bytes = optimizer_step_bytes(recipe.optimizer, mm.master, mm.state_bytes)
                opt_s = max(opt_s, trainable / z * step_bytes / bw)
        compute += opt_s

        # Data-parallel gradient synchronisation and FSDP gathers.
        dp_exposed = 0.0
        if par.dp > 1:
            dp_exposed = self._data_parallel(par, groups, stage_compute, comm, links)
        exposed += dp_exposed

        # Pipeline point-to-point sends.
        if par.pp > 1:
            link = self._collective(groups.pp_pairs)
            links["pipeline sends"] = link
            sent = mb_tokens * m.h * c / (par.tp if par.sequence_parallel else 1)
            one = sent / (link.gbs * 1e9) + link.latency_s
            pp_exposed = (mbs + par.pp - 1) * 2 * one * 0.5
            exposed += pp_exposed
            comm.append(CommItem("pipeline activations and gradients", groups.pp_pairs[0], link.label, int(2 * mbs * sent), 2 * mbs * one, pp_exposed))

        offload = self._offload(par, groups, stage_compute) + self._activation_offload(par, groups, stage_compute)
        offload += self._optimizer_offload(par, groups, stage_compute)
        step = compute + exposed + bubble + offload
        tokens_per_s = w.global_batch * s / step
        model_flops = train_flops_per_token(m, s, frozen_base=self.frozen)
        peak = sum(topo.gpus[i].peak_tflops(self.peak_dtype) for i in par.gpu_indices) * 1e12
        budget = w.token_budget / tokens_per_s if w.token_budget else None
        return Timing(
            step_s=step,
            compute_s=compute,
            exposed_comm_s=exposed,
            bubble_s=bubble,
            offload_s=offload,
            tokens_per_s=tokens_per_s,
            mfu=model_flops * tokens_per_s / peak,
            time_to_budget_s=budget,
            comm=comm,
            figures=self._figures(par, comm, links, compile) if detail else [],
        )

    def _memory_bound_s(self, par: Parallelism, groups: Groups, st: int, n: int, mb_tokens: int, compile: bool) -> float:
        """Seconds a micro-batch of stage `st` spends on memory-bound work the matmul rate does not cover: the
        blocks' elementwise ops (forward, backward, and the forward again under any checkpointing), and FSDP2's
        all-gather copy-out."""
        passes = ELEMENTWISE_TRAIN_PASSES + (1.0 if par.checkpointing in ("selective", "full") else 0.0)
        nbytes = passes * n * mb_tokens * recompute_bytes_per_token(self.m, compile, par.tp, par.sequence_parallel)
        if par.backend == "fsdp" and par.dp > 1 and min(par.shard_degree, par.dp) > 1:
            p_local, lin = self.mm.stage_params(par, st)
            blocks = lin + n * self.m.layer_other_params
            c = self.mm.c
            block_bytes = lin * 0.5 + (blocks - lin) * c if self.w.method == "qlora" else blocks * c
            # Under pipeline parallel the engine keeps every block gathered (engine.workers.parallelize).
            reshard = par.reshard_after_forward and par.pp == 1
            nbytes += fsdp_copy_out_bytes(block_bytes, (p_local - blocks) * c, n, reshard)
        if not nbytes:
            return 0.0
        bw = min(self.topo.gpus[i].memory_bandwidth_gbs for i in groups.stages[st]) * 1e9 * MEMORY_BW_EFFICIENCY
        return nbytes / bw

    def _trainable(self, par: Parallelism, stage: int) -> float:
        p, _ = self.mm.stage_params(par, stage)
        if not self.frozen:
            return p
        a, b = stage_range(par, stage, self.m.layers)
        return (b - a) * self.mm.lora_per_layer / par.tp

    def _data_parallel(
        self, par: Parallelism, groups: Groups, stage_compute: list[float],
        comm: list[CommItem], links: dict[str, Link],
    ) -> float:
        m, mm = self.m, self.mm
        c = mm.c
        bwd_share = 0.5 if self.frozen else 2.0 / 3.0
        worst = 0.0
        for st in range(par.pp):
            trainable = self._trainable(par, st)
            p_local, lin = mm.stage_params(par, st)
            t_mb = stage_compute[st]
            if par.zero_stage == 3 or par.backend == "fsdp":
                shard = [g for g in groups.shard if g[0] in groups.stages[st]]
                link = self._collective(shard)
                z = len(shard[0])
                if self.frozen and self.w.method == "qlora":
                    gathered = lin * 0.5 + (p_local - lin) * c
                else:
                    gathered = p_local * c
                reduce_bytes = trainable * c
                # Gathered for forward and again for backward, unless kept gathered through backward (ZeRO-2 form).
                gathers = 2 if par.reshard_after_forward else 1
                per_mb = gathers * gather_s(gathered, z, link) + gather_s(reduce_bytes, z, link)
                unit = gather_s((m.layer_linear_params / par.tp + m.layer_other_params) * c, z, link)
                exposed = par.grad_accum * max(per_mb - OVERLAP * t_mb, min(unit, per_mb))
                total = par.grad_accum * per_mb
                nbytes = int(par.grad_accum * (gathers * gathered + reduce_bytes))
                what = "FSDP2 all-gathers and reduce-scatters" if par.backend == "fsdp" else "ZeRO-3 gathers and reduce-scatters"
                links["sharding group"] = link
                if par.hsdp:
                    rep = [g for g in groups.replicate if g[0] in groups.stages[st]]
                    rlink = self._collective(rep)
                    ar = allreduce_s(trainable / z * c, len(rep[0]), rlink)
                    exposed += max(ar - OVERLAP * bwd_share * t_mb, 0.0)
                    total += ar
                    links["replica groups"] = rlink
                    comm.append(CommItem("HSDP gradient all-reduce across replicas", rep[0], rlink.label, int(2 * trainable / z * c), ar, max(ar - OVERLAP * bwd_share * t_mb, 0.0)))
                comm.append(CommItem(what, shard[0], link.label, nbytes, total, exposed))
            else:
                dpg = [g for g in groups.dp if g[0] in groups.stages[st]]
                link = self._collective(dpg)
                n = len(dpg[0])
                grad_bytes = 4 if par.backend in ("ddp", "single") else (2 if mm.mixed else 4)
                ar = allreduce_s(trainable * grad_bytes, n, link)
                tail = min(ar, allreduce_s(DDP_BUCKET_BYTES, n, link))
                exposed = max(ar - OVERLAP * bwd_share * t_mb, tail)
                total = ar
                what = "DDP gradient all-reduce"
                if par.zero_stage in (1, 2):
                    # ZeRO-1/2: the reduce-scatter overlaps backward like DDP's; the parameter all-gather
                    # after the optimizer step does not.
                    ag = gather_s(trainable * (2 if mm.mixed else 4), n, link)
                    ar = gather_s(trainable * grad_bytes, n, link)
                    tail = min(ar, gather_s(DDP_BUCKET_BYTES, n, link))
                    exposed = max(ar - OVERLAP * bwd_share * t_mb, tail) + ag
                    total = ar + ag
                    what = f"ZeRO-{par.zero_stage} reduce-scatter and all-gather"
                links["data-parallel group"] = link
                comm.append(CommItem(what, dpg[0], link.label, int(2 * trainable * grad_bytes), total, exposed))
            worst = max(worst, exposed)
        return worst

    def _activation_offload(self, par: Parallelism, groups: Groups, stage_compute: list[float]) -> float:
        """Seconds a step waits on activation offloading: each micro-batch's saved activations go out to the host
        in forward and come back in backward over the GPU's PCIe link, hidden behind that micro-batch's compute
        (less what the collectives take of the link without NVLink) as far as the link is fast enough."""
        if not self.mm.recipe.activation_offload:
            return 0.0
        worst = 0.0
        for st in range(par.pp):
            moved = self.mm.offloaded_activations(par, st)
            if not moved:
                continue
            window = self._window(par, groups, st, stage_compute[st])
            for g in groups.stages[st]:
                pcie = self.topo.gpus[g].pcie_gbs * 1e9
                xfer = max(2 * moved / pcie, 2 * moved / self.host_rate(par, g))
                worst = max(worst, max(par.grad_accum, 1) * max(xfer - window, 0.0))
        return worst

    def _optimizer_offload(self, par: Parallelism, groups: Groups, stage_compute: list[float]) -> float:
        """Seconds a step spends on the optimizer state in host memory (engine.workers.optimizer_offload) beyond
        what hides behind the GPU's compute.

        Each micro-batch's gradients go to the host over the GPU's PCIe link as backward makes them, on a side
        stream: hidden behind the micro-batch's backward as far as the link keeps up, except the last one's copy,
        which starts when backward ends. Adding the later micro-batches' gradients on the host, the CPU AdamW step
        and the copy of the updated weights back to the GPU come after backward and hide behind nothing.
        """
        if not self.mm.host_optimizer(par):
            return 0.0
        topo, mm = self.topo, self.mm
        mbs = max(par.grad_accum, 1)
        bwd_share = 0.5 if self.frozen else 2.0 / 3.0
        host = topo.machine.host
        cores = (host.cores or 8) / max(par.world_size, 1)
        worst = 0.0
        for st in range(par.pp):
            moved = mm.host_optimizer_params(par, st) * mm.master  # bytes of the offloaded tensors, each way
            last = mm.largest_trainable(par, st) * mm.master
            # a += b on the host in the master dtype: two reads and a write per element.
            accumulate = (mbs - 1) * moved * HOST_ACCUMULATE_BYTES / 4
            # Fused AdamW reads the weight, the gradient and both moments and writes three back, in the master dtype.
            adam_bytes = mm.host_optimizer_params(par, st) * (4 * mm.master + 3 * mm.master)
            for g in groups.stages[st]:
                rate = self.host_rate(par, g)
                link = min(topo.gpus[g].pcie_gbs * 1e9, rate)
                out = mbs * (max(moved / link - bwd_share * stage_compute[st], 0.0) + last / link)
                adam = max(mm.host_optimizer_params(par, st) / (max(cores, 1.0) * CPU_ADAM_PARAMS_PER_CORE_S),
                           adam_bytes / rate)  # fmt: skip
                worst = max(worst, out + accumulate / rate + adam + moved / link)
        return worst

    def _offload(self, par: Parallelism, groups: Groups, stage_compute: list[float]) -> float:
        if not par.offload:
            return 0.0
        if par.backend == "fsdp":
            return self._fsdp_offload(par, groups, stage_compute)
        return self._deepspeed_offload(par, groups, stage_compute)

    def offload_traffic(self, par: Parallelism, stage: int = 0) -> tuple[float, float, float]:
        """FSDP2 CPU offload, bytes one rank moves per step: (host→GPU, GPU→host, touched by the CPU optimizer).

        Every all-gather first copies the unit's sharded parameters (fp32, or the frozen base in its own
        dtype) to the GPU: once in forward and again in backward, since the units are resharded. Each
        micro-batch's reduce-scatter leaves an fp32 gradient shard that is copied back and accumulated on
        the host. The optimizer then reads and writes the rank's shard of parameters, gradients and state.
        """
        mm = self.mm
        z = max(par.shard_degree, 1)
        trainable = self._trainable(par, stage)
        p_local, _ = mm.stage_params(par, stage)
        frozen = p_local * mm.c if self.frozen else 0.0  # LoRA's base in the compute dtype (QLoRA is not offloaded)
        shard = (trainable * 4 + frozen) / z
        gathers = 2 if par.reshard_after_forward else 1
        h2d = par.grad_accum * gathers * shard
        d2h = par.grad_accum * trainable * 4 / z
        cpu = trainable / z * CPU_OPTIMIZER_BYTES.get(self.w.optimizer or "adamw", CPU_OPTIMIZER_BYTES["adamw"])
        return h2d, d2h, cpu

    def host_accumulate_bytes(self, par: Parallelism, stage: int = 0) -> float:
        """Bytes one rank's host-side gradient accumulation streams per step: every micro-batch after the first."""
        z = max(par.shard_degree if par.zero_stage >= 1 else 1, 1)
        return max(par.grad_accum - 1, 0) * self._trainable(par, stage) / z * HOST_ACCUMULATE_BYTES

    def host_memory_class(self) -> tuple[float, str]:
        """(GB/s one NUMA node's CPUs stream from their memory, the CPU class it was assumed from)."""
        model = (self.topo.machine.host.cpu_model or "").lower()
        for pattern, gbs, words in HOST_MEMORY_CLASSES:
            if pattern.search(model):
                return gbs, words
        return HOST_MEMORY_DESKTOP

    def host_memory_bandwidth(self) -> float:
        """Bytes/s one NUMA node's CPUs stream from their memory: assumed from the CPU's class (plans say so)."""
        host = self.topo.machine.host
        per_socket, _ = self.host_memory_class()
        nodes = max(len(host.numa_nodes), host.sockets or 1, 1)
        return per_socket * max(host.sockets or 1, 1) / nodes * 1e9

    def ranks_per_node(self, par: Parallelism) -> dict[int, int]:
        """How many of the plan's ranks hang off each NUMA node (their host-side work shares its memory)."""
        out: dict[int, int] = {}
        for g in par.gpu_indices:
            node = self.topo.machine.gpu(g).numa_node or 0
            out[node] = out.get(node, 0) + 1
        return out

    def host_rate(self, par: Parallelism, gpu: int) -> float:
        """Bytes/s the host-side work of the rank on `gpu` streams: its node's bandwidth shared by the ranks
        there, capped by the cores it gets (the engine gives each rank cores / ranks OpenMP threads)."""
        host = self.topo.machine.host
        ranks = self.ranks_per_node(par)
        share = self.host_memory_bandwidth() / ranks[self.topo.machine.gpu(gpu).numa_node or 0]
        cores = (host.cores or 8) / max(par.world_size, 1)
        return min(share, max(cores, 1.0) * HOST_STREAM_PER_CORE_GBS * 1e9)

    def _window(self, par: Parallelism, groups: Groups, st: int, compute_mb: float) -> float:
        """Compute time a micro-batch's host copies can hide behind: without NVLink the collectives ride the same
        PCIe link, so the window is what they leave."""
        shard = [g for g in groups.shard if g[0] in groups.stages[st]]
        link = self._collective(shard) if shard and len(shard[0]) > 1 else None
        if link is None or link.kind in ("nvlink", "nvswitch"):
            return compute_mb
        p_local, _ = self.mm.stage_params(par, st)
        gathers = 2 if par.reshard_after_forward else 1
        return max(compute_mb - (gathers + 1) * gather_s(p_local * self.mm.c, len(shard[0]), link), 0.0)

    def _fsdp_offload(self, par: Parallelism, groups: Groups, stage_compute: list[float]) -> float:
        """Seconds a step spends on FSDP2 CPU offload beyond what hides behind the GPU's compute.

        The copies ride each GPU's PCIe link and stream through host memory (DMA), prefetched one unit
        ahead like the all-gathers they feed: each pass shows its first unit and whatever the micro-batch's
        compute cannot cover. Accumulating gradient shards on the host and the CPU optimizer step hide
        behind nothing; both stream host memory, shared by the ranks on one NUMA node.
        """
        topo, m = self.topo, self.m
        mbs = max(par.grad_accum, 1)
        worst = 0.0
        for st in range(par.pp):
            h2d, d2h, cpu = self.offload_traffic(par, st)
            accumulate = self.host_accumulate_bytes(par, st)
            a, b = stage_range(par, st, m.layers)
            n_units = max(b - a, 1)
            window = self._window(par, groups, st, stage_compute[st])
            for g in groups.stages[st]:
                rate = self.host_rate(par, g)
                pcie = topo.gpus[g].pcie_gbs * 1e9
                # The two directions of a PCIe link run at once; host memory serves both.
                per_mb = max(max(h2d, d2h) / pcie, (h2d + d2h) / rate) / mbs
                xfer = mbs * (per_mb / n_units + max(per_mb - window, 0.0))
                worst = max(worst, xfer + (accumulate + cpu) / rate)
        return worst

    def _deepspeed_offload(self, par: Parallelism, groups: Groups, stage_compute: list[float]) -> float:
        """DeepSpeed ZeRO-Offload (and ZeRO-3 parameter offload): gradients out and updated parameters back once
        per step, gradient accumulation and Adam on the CPU, parameters fetched per micro-batch when offloaded."""
        mm, topo, m = self.mm, self.topo, self.m
        pb = 2 if mm.mixed else 4
        z = par.shard_degree if par.zero_stage >= 1 else 1
        mbs = max(par.grad_accum, 1)
        host = topo.machine.host
        cores = (host.cores or 8) / max(par.world_size, 1)
        adam_bytes = DEEPSPEED_CPU_ADAM_BYTES if self.w.optimizer == "adamw" else CPU_OPTIMIZER_BYTES.get(self.w.optimizer or "adamw", 16.0)
        worst = 0.0
        for st in range(par.pp):
            trainable = self._trainable(par, st)
            accumulate = self.host_accumulate_bytes(par, st)
            a, b = stage_range(par, st, m.layers)
            n_units = max(b - a, 1)
            for g in groups.stages[st]:
                rate = self.host_rate(par, g)
                link = min(topo.gpus[g].pcie_gbs * 1e9, rate)
                xfer = 2 * trainable / z * pb / link  # gradients out, updated parameters back
                if par.offload_params:
                    p_local, _ = mm.stage_params(par, st)
                    per_mb = (2 * p_local + trainable) / z * pb / link
                    xfer += mbs * (per_mb / n_units + max(per_mb - stage_compute[st], 0.0))
                adam = max(trainable / z / (max(cores, 1.0) * CPU_ADAM_PARAMS_PER_CORE_S), trainable / z * adam_bytes / rate)
                worst = max(worst, xfer + accumulate / rate + adam)
        return worst

    # -- inference --------------------------------------------------------------------------------------
    def infer(self, par: Parallelism, detail: bool = True) -> Timing:
        m, w, topo, mm = self.m, self.w, self.topo, self.mm
        groups = self.groups(par)
        c = mm.c
        batch = ceil_div(w.global_batch, par.dp)
        prompt = w.prompt_tokens
        new = max(w.new_tokens, 1)
        quant_rate = {16: 1.0, 8: INT8_RATE, 4: QLORA_RATE}[w.weight_bits]
        tp_link = self._collective(groups.tp) if par.tp > 1 else None
        links: dict[str, Link] = {}
        comm: list[CommItem] = []
        prefill = 0.0
        decode = 0.0
        tp_total = 0.0
        kv_token_layer = 2 * m.kv_dim * c  # bytes of k and v per token per layer
        for st in range(par.pp):
            a, b = stage_range(par, st, m.layers)
            n = b - a
            gpus = groups.stages[st][: par.tp]
            last = st == par.pp - 1
            mm_params = n * ((self.layer_mm - self.moe_mm) / par.tp + self.moe_mm) + (self.head_mm if last else 0) / par.tp
            flops = batch * prompt * (2 * mm_params + 2 * n * m.q_dim * prompt / par.tp)
            prefill += flops / (self._rate(gpus, batch * prompt, m.h / par.tp) * quant_rate)
            sm = mm.infer_stage(par, st, topo.gpus[gpus[0]].architecture)
            bw = min(topo.gpus[i].memory_bandwidth_gbs for i in gpus) * 1e9 * MEMORY_BW_EFFICIENCY
            context = prompt + new / 2
            kv_read = batch * context * kv_token_layer * n / par.tp
            mem_s = (sm.weights - self._untouched_expert_bytes(n, batch) + kv_read) / bw
            # Decode matmuls are matrix-vector products: memory-bound unless the batch is large, so the
            # compute side uses the plain achievable rate rather than the small-matmul shape penalty.
            rate = min(topo.gpus[i].step_tflops(self.peak_dtype) for i in gpus) * 1e12 * quant_rate
            comp_s = 2 * batch * mm_params / rate
            decode += max(mem_s, comp_s) * DECODE_QUANT_FACTOR[w.weight_bits] + n * DECODE_OVERHEAD_PER_LAYER_S
            if tp_link is not None:
                pre = 2 * n * allreduce_s(batch * prompt * m.h * c, par.tp, tp_link)
                dec = 2 * n * allreduce_s(batch * m.h * c, par.tp, tp_link)
                prefill += pre
                decode += dec
                tp_total += pre + new * dec
        if tp_link is not None:
            links["tensor parallel"] = tp_link
            comm.append(CommItem("tensor-parallel all-reduces", groups.tp[0], tp_link.label, int(2 * m.layers * batch * (prompt + new) * m.h * c), tp_total, tp_total))
        if par.pp > 1:
            link = self._collective(groups.pp_pairs)
            links["pipeline sends"] = link
            hop = link.latency_s + batch * m.h * c / (link.gbs * 1e9)
            prefill += (par.pp - 1) * (link.latency_s + batch * prompt * m.h * c / (link.gbs * 1e9))
            decode += (par.pp - 1) * hop
        total = prefill + new * decode
        tokens_per_s = par.dp * batch * new / total
        peak = sum(topo.gpus[i].peak_tflops(self.peak_dtype) for i in par.gpu_indices) * 1e12
        return Timing(
            step_s=total,
            compute_s=total - tp_total,
            exposed_comm_s=tp_total,
            bubble_s=0.0,
            tokens_per_s=tokens_per_s,
            mfu=2 * m.matmul_params_per_token * tokens_per_s / peak,
            prefill_s=prefill,
            decode_token_s=decode,
            comm=comm,
            figures=self._figures(par, comm, links) if detail else [],
        )

    def _untouched_expert_bytes(self, layers: int, batch: int) -> float:
        """Bytes of expert weights a decode step of `batch` tokens does not read on `layers` layers.

        A token reads only its top-k experts (and the router and any shared expert, which are not expert
        linears here): per layer the batch reaches experts_touched(k, E, batch) of the E experts, so the rest
        of the experts' weights stay in memory unread. Experts are whole on every tensor-parallel rank.
        """
        spec = self.m.spec
        if not spec.is_moe or spec.num_experts <= 1:
            return 0.0
        bits = self.w.weight_bits
        per = self.mm.c if bits == 16 else (INT8_BYTES if bits == 8 else NF4_BYTES_DQ)  # as infer_stage counts them
        expert = sum(u.weight_params for u in (*self.m.mlp_in, *self.m.mlp_out) if u.lin.expert)
        untouched = 1.0 - experts_touched(spec.experts_per_token, spec.num_experts, batch) / spec.num_experts
        return layers * expert * per * untouched

    def timing(self, par: Parallelism, detail: bool = True, *, compile: bool = False) -> Timing:
        """`compile` applies to training; inference is planned eager (the engine does not compile decode)."""
        return self.train(par, detail, compile=compile) if self.w.training else self.infer(par, detail)
