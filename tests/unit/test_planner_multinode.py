"""Multi-node plans: TP inside a node, data or pipeline parallel across nodes, the link between them as a parameter."""

from __future__ import annotations

import dataclasses
import json

import pytest

from rigpilot.engine.api.protocol import ProtocolError
from rigpilot.engine.cli.entry import main as cli_main
from rigpilot.engine.errors import UserError
from rigpilot.engine.hardware.simulated import load_profile
from rigpilot.engine.models import describe_model
from rigpilot.engine.planner.cluster import build_cluster, node_link
from rigpilot.engine.planner.export import slurm_script
from rigpilot.engine.planner.links import Topology
from rigpilot.engine.planner.memory import MemoryModel
from rigpilot.engine.planner.model import model_facts
from rigpilot.engine.planner.plan import Parallelism, Plan, Workload, refusal
from rigpilot.engine.planner.search import SearchOptions, _train_layouts, search
from rigpilot.engine.planner.speed import Groups, SpeedModel
from rigpilot.engine.service import planworker

H100 = "8x-h100-sxm"
MODEL = "llama-3.1-8b"
WORK = Workload(model=MODEL, global_batch=64)


@pytest.fixture(scope="module")
def h100():
    return load_profile(H100)


@pytest.fixture(scope="module")
def llama():
    return describe_model(MODEL)


def plan_on(spec, machine, link: str, nodes: int = 2, **kw):
    return search(spec, machine, kw.pop("work", WORK), options=SearchOptions(nodes=nodes, internode=link, **kw))


def all_plans(r):
    return [r.best, *r.runners_up] if r.best else list(r.runners_up)


def test_tensor_parallel_never_crosses_nodes(llama):
    # Four GPUs a node: TP of 8 would be possible on 8 GPUs of one box, never on two boxes of four.
    machine = load_profile("4x-rtx4090")
    cluster = build_cluster([machine] * 2, [0, 1, 2, 3], node_link("25gbe"))
    topo = Topology(cluster.machine, list(range(8)), per_node=4, internode=cluster.link)
    m = model_facts(llama)
    skipped: dict[str, str] = {}
    layouts = [par for par, _, _ in _train_layouts(m, WORK, topo, SearchOptions(force_tp=True), skipped)]
    two_node = [p for p in layouts if p.nodes == 2]
    assert two_node and any(p.tp > 1 for p in two_node) and any(p.dp > 1 for p in two_node)
    for par in two_node:
        assert par.tp <= 4
        for group in Groups.of(par).tp:
            assert len({g // 4 for g in group}) == 1, (par, group)
    assert "stays inside a node of 4 GPUs" in skipped["tensor parallel"]
    r = plan_on(llama, machine, "25gbe", force_tp=True, work=dataclasses.replace(WORK, method="lora"))
    for p in all_plans(r):
        assert p.parallelism.tp <= len(p.parallelism.gpu_indices)


def test_why_not_refuses_tp_across_nodes(h100, llama):
    plan = plan_on(llama, h100, "ndr").best.to_dict()
    plan["parallelism"].update(nodes=2, gpu_indices=[0, 1, 2, 3], tp=8, dp=1, pp=1, zero_stage=0, shard_degree=1)
    loaded = Plan.from_dict({k: v for k, v in plan.items() if k not in ("runs_here", "runs_here_reason")})
    reason = refusal(loaded)
    assert reason and "cross nodes" in reason and "\n" not in reason
    assert not loaded.runs_here and loaded.runs_here_reason == reason
    plan["parallelism"].update(tp=4, dp=2)
    assert refusal(Plan.from_dict(plan)) == ""


def test_slow_link_uses_fewer_nodes_or_splits_the_pipeline_and_says_why(h100, llama):
    slow = plan_on(llama, h100, "10gbe")
    assert slow.best.parallelism.nodes == 1 and slow.best.scaling is None
    text = "\n".join(slow.explanation)
    assert "Planned on one of your 2 nodes" in text and "10 GbE" in text and "of linear" in text

    mid = plan_on(llama, h100, "25gbe").best
    if mid.parallelism.nodes > 1:  # then only what a slow link carries well may cross it
        assert mid.parallelism.family in ("pipeline", "HSDP")
        assert mid.scaling["efficiency"] < 0.8

    fast = plan_on(llama, h100, "ndr")
    best = fast.best
    assert best.parallelism.nodes == 2 and best.parallelism.tp <= 8
    # At most a hair over linear: one node runs twice the micro-batches per GPU, each paying FSDP2's copy-out.
    assert 1.5 < best.scaling["speedup"] <= 2.02 and best.scaling["efficiency"] == pytest.approx(best.scaling["speedup"] / 2)
    text = "\n".join(fast.explanation)
    assert "Across two nodes joined by InfiniBand NDR" in text and "tensor parallelism stays inside each node" in text
    assert f"{best.scaling['efficiency']:.0%} of linear scaling" in text
    assert any(f.name.startswith("line rate per NIC, InfiniBand NDR") and f.value == 400 for f in best.timing.figures)


def _fixed_step(spec, machine, link: str) -> float:
    """Step time of one fixed plan (FSDP over 16 GPUs of two nodes) on `link`."""
    cluster = build_cluster([machine] * 2, list(range(8)), node_link(link))
    topo = Topology(cluster.machine, list(range(16)), per_node=8, internode=cluster.link)
    m = model_facts(spec)
    mm = MemoryModel(m, WORK)
    par = Parallelism(
        gpu_indices=list(range(16)), dp=16, zero_stage=3, shard_degree=16, backend="fsdp",
        micro_batch=2, grad_accum=2, checkpointing="selective", nodes=2,
    )  # fmt: skip
    return SpeedModel(m, WORK, topo, mm).timing(par).step_s


def test_predicted_step_time_grows_as_the_link_slows(h100, llama):
    links = ["ndr-8", "ndr", "100gbe", "25gbe", "10gbe", "0.5"]
    steps = [_fixed_step(llama, h100, link) for link in links]
    assert steps == sorted(steps) and steps[-1] > 3 * steps[0]
    assert steps[3] < steps[4] < steps[5]  # once communication shows, every slower link costs more


def test_internode_all_reduce_matches_the_ring_formula():
    spec = describe_model("qwen2.5-0.5b")
    work = Workload(model="qwen2.5-0.5b", global_batch=8, seq_len=512)
    # Enough runners-up to reach the DDP family's best plan whatever ranks above it.
    r = search(spec, load_profile("1x-rtx4090"), work, options=SearchOptions(nodes=2, internode="25gbe", runners_up=8))
    ddp = next(p for p in all_plans(r) if p.parallelism.nodes == 2 and p.parallelism.family == "DDP")
    item = next(c for c in ddp.timing.comm if c.what == "DDP gradient all-reduce")
    nbytes = item.bytes_per_step / 2  # the plan counts both directions' traffic; the buffer is half of it
    assert nbytes == pytest.approx(ddp.model_params * 4, rel=0.01)  # fp32 gradients of every parameter
    n, nic = 2, 25e9 / 8 * 0.8  # IEEE 802.3by 25 Gb/s, of which NCCL reaches 80% (cluster.ETHERNET_EFFICIENCY)
    ring = 2 * (n - 1) / n * nbytes / nic
    assert item.seconds == pytest.approx(ring, abs=1e-4)

    # Two nodes of eight: inside each node on NVSwitch, across them the whole buffer once over the NIC.
    h100 = load_profile(H100)
    cluster = build_cluster([h100] * 2, list(range(8)), node_link("ndr"))
    topo = Topology(cluster.machine, list(range(16)), per_node=8, internode=cluster.link)
    from rigpilot.engine.planner.speed import allreduce_s

    buf = 2e9
    inside = topo.ring(list(range(8)))
    # Each hop of a ring step waits its latency too: 2(k-1) hops inside a node, 2(N-1) across (InfiniBand, 5 µs).
    latency = 2 * 7 * inside.latency_s + 2 * 1 * 5e-6
    expected = 2 * 7 / 8 * buf / (inside.gbs * 1e9) + 2 * 1 / 2 * buf / (400e9 / 8 * 0.92) + latency
    assert allreduce_s(buf, 16, topo.collective([list(range(16))])) == pytest.approx(expected, rel=1e-3)
    # Eight one-GPU-per-node groups at once (TP 8 inside, DP across) share the node's NIC eight ways.
    groups = [[k, k + 8] for k in range(8)]
    shared = allreduce_s(buf / 8, 2, topo.collective(groups))
    assert shared == pytest.approx(2 * 1 / 2 * buf / (400e9 / 8 * 0.92) + 2 * 5e-6, rel=1e-3)


def test_multi_node_plans_round_trip_and_old_plans_load(h100, llama):
    best = plan_on(llama, h100, "ndr").best
    d = json.loads(best.to_json())
    assert d["parallelism"]["nodes"] == 2 and d["parallelism"]["gpu_indices"] == list(range(8))
    assert d["parallelism"]["world_size"] == 16
    link = d["parallelism"]["internode"]
    assert link["name"] == "ndr" and link["gbs"] == pytest.approx(46.0) and link["latency_s"] > 0
    assert {m["node"] for m in d["memory"]} == {0, 1}
    assert Plan.from_json(best.to_json()) == best
    assert Plan.from_json(best.to_json()).to_json() == best.to_json()

    one = plan_on(llama, h100, "ndr", nodes=1).best
    old = json.loads(one.to_json())
    for key in ("nodes", "internode"):
        del old["parallelism"][key]
    del old["scaling"]
    for m in old["memory"]:
        del m["node"]
    loaded = Plan.from_dict(old)
    assert loaded.parallelism.nodes == 1 and loaded.parallelism.internode is None and loaded.scaling is None
    assert loaded == one
    old["parallelism"]["nodes"] = 0
    with pytest.raises(UserError, match=r"parallelism\.nodes"):
        Plan.from_dict(old)


def test_slurm_export_runs_the_plans_own_nodes(h100, llama):
    best = plan_on(llama, h100, "ndr").best
    script = slurm_script(best)
    # One SLURM task per rank: eight on each of the plan's two nodes.
    assert "#SBATCH --nodes=2" in script and "#SBATCH --gpus-per-node=8" in script
    assert "#SBATCH --ntasks-per-node=8" in script
    with pytest.raises(UserError, match="spans 2 nodes"):
        slurm_script(best, nodes=3)


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--nodes", "0"], "--nodes must be a whole number from 1 to 64"),
        (["--nodes", "two"], "--nodes must be a whole number"),
        (["--nodes", "2", "--internode", "fast"], "--internode takes one of 10gbe"),
        (["--nodes", "2", "--internode", "-4"], "--internode takes one of"),
        (["--node-machine", H100, "--node-machine", "8x-a100-pcie"], "needs identical nodes"),
        (["--node-machine", H100, "--node-machine", "/nonexistent.json"], "/nonexistent.json does not exist, nor is '/nonexistent.json' a simulated profile"),
    ],
)
def test_bad_nodes_arguments_get_one_line(capsys, args, words):
    rc = cli_main(["plan", "--simulate", H100, "--model", MODEL, "--no-verify", *args])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and words in err and len(err.splitlines()) == 1


def test_cli_plans_several_nodes_in_json(capsys, tmp_path, h100):
    box = tmp_path / "box2.json"
    box.write_text(json.dumps({"machine": h100.to_dict()}))
    rc = cli_main([
        "plan", "--simulate", H100, "--model", MODEL, "--batch", "64", "--no-verify", "--json",
        "--node-machine", H100, "--node-machine", str(box), "--internode", "12.5",
    ])  # fmt: skip
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["nodes"] == 2 and out["internode"]["source"] == "given"
    assert out["internode"]["gbs"] == pytest.approx(12.5)
    assert out["best"]["parallelism"]["nodes"] in (1, 2)


def test_socket_plan_request_takes_nodes_and_node_machines(h100):
    answer = planworker.plan(
        h100, MODEL, {"global_batch": 64}, options={"nodes": 2, "internode": "ndr"}, verify=False,
    )["result"]  # fmt: skip
    assert answer["best"]["parallelism"]["nodes"] == 2 and answer["internode"]["name"] == "ndr"
    with pytest.raises(ProtocolError, match=r"plan\.options\.nodes"):
        planworker.plan(h100, MODEL, options={"nodes": "2"}, verify=False)
    with pytest.raises(UserError, match="--internode"):
        planworker.plan(h100, MODEL, options={"nodes": 2, "internode": "wifi"}, verify=False)
    with pytest.raises(ProtocolError, match=r"plan\.node_machines\[1\]"):
        planworker.plan(h100, MODEL, node_machines=[H100, {"source": "simulated"}], verify=False)
    mixed = planworker._answer(h100, json.dumps({"model": MODEL, "node_machines": [H100, "8x-a100-pcie"], "verify": False}))
    assert "identical nodes" in mixed["error"]["message"]


def test_the_engines_plan_request_plans_several_nodes(tmp_path, monkeypatch):
    """Through a real engine service and its planner process, as the GUI and other clients ask."""
    from rigpilot.engine.api.client import EngineClient, EngineError

    from support.engine import Engine, engine_home

    engine_home(tmp_path, monkeypatch)
    monkeypatch.setenv("RIGPILOT_PLAN_VERIFY", "0")
    e = Engine(tmp_path)
    e.start()
    try:
        with EngineClient(autostart=False, timeout=60) as c:
            r = c.request("plan", model=MODEL, workload={"global_batch": 64}, options={"nodes": 2, "internode": "ndr"},
                          node_machines=[H100, H100])  # fmt: skip
            best = r["result"]["best"]
            assert best["parallelism"]["nodes"] == 2 and best["parallelism"]["internode"]["name"] == "ndr"
            assert r["result"]["machine"] == f"2 × {load_profile(H100).label}"
            with pytest.raises(EngineError, match="identical nodes"):
                c.request("plan", model=MODEL, node_machines=[H100, "4x-rtx4090"])
            with pytest.raises(EngineError, match="node_machines"):
                c.request("plan", model=MODEL, node_machines=[H100] * 65)
    finally:
        e.stop()
