"""The torchrun command line and the rank environment, as the supervisor and the SLURM backend build them."""

from pathlib import Path

from rigpilot.engine.launch.torchrun import rank_environment, rank_target, rankexec_command, torchrun_command


def test_one_node_meets_at_its_own_port_and_wraps_each_rank_in_rankexec(tmp_path: Path) -> None:
    target = rank_target("py", tmp_path, None)
    cmd = torchrun_command(python="py", job_id="j1", run=2, ranks_per_node=4, nodes={}, port=29500,
                           monitor_interval_s=0.5, job_dir=tmp_path, target=target)
    assert cmd[:3] == ["py", "-m", "torch.distributed.run"]
    assert cmd[cmd.index("--nnodes") + 1] == "1" and cmd[cmd.index("--nproc-per-node") + 1] == "4"
    assert cmd[cmd.index("--rdzv-endpoint") + 1] == "127.0.0.1:29500" and "--local-addr" not in cmd
    assert cmd[cmd.index("--rdzv-id") + 1] == "j1-2"
    tail = cmd[cmd.index("--monitor-interval") + 2:]
    assert tail == rankexec_command("py", tmp_path, target)[2:]  # torchrun starts the same rank SLURM would
    assert target == ["py", "-u", "-m", "rigpilot.engine.workers", str(tmp_path)]


def test_a_node_of_several_meets_at_the_heads_endpoint(tmp_path: Path) -> None:
    nodes = {"count": 2, "role": "worker", "endpoint": "10.0.0.1:29400", "local_addr": "10.0.0.2"}
    cmd = torchrun_command(python="py", job_id="j", run=1, ranks_per_node=2, nodes=nodes, port=1,
                           monitor_interval_s=1, job_dir=tmp_path, target=rank_target("py", tmp_path, ["t.py"]))
    assert cmd[cmd.index("--nnodes") + 1] == "2" and cmd[cmd.index("--rdzv-endpoint") + 1] == "10.0.0.1:29400"
    assert cmd[cmd.index("--rdzv-conf") + 1] == "is_host=0" and cmd[cmd.index("--local-addr") + 1] == "10.0.0.2"
    assert cmd[-3:] == ["py", "-u", "t.py"]


def test_simulated_ranks_see_no_gpu_and_keep_the_users_thread_count(tmp_path: Path) -> None:
    env = rank_environment({"OMP_NUM_THREADS": "3", "TOKENIZERS_PARALLELISM": "true"}, job_id="j", job_dir=tmp_path,
                           run=1, gpus=[0, 1], ranks=2, simulated=True)
    assert env["CUDA_VISIBLE_DEVICES"] == "" and env["OMP_NUM_THREADS"] == "3"
    assert env["TOKENIZERS_PARALLELISM"] == "true" and env["RIGPILOT_GPUS"] == "0,1"
    assert env["RIGPILOT_METRICS_DIR"] == str(tmp_path / "metrics") and env["PYTHONUNBUFFERED"] == "1"


def test_real_ranks_see_their_gpus_in_nvidia_smi_order(tmp_path: Path) -> None:
    env = rank_environment({}, job_id="j", job_dir=tmp_path, run=3, gpus=[2, 5], ranks=2, simulated=False)
    assert env["CUDA_VISIBLE_DEVICES"] == "2,5" and env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    assert env["RIGPILOT_RUN"] == "3" and "OMP_NUM_THREADS" not in env


def test_a_slurm_script_of_an_older_rigpilot_still_finds_rankexec():
    """sbatch scripts queued before the cut name the module's old path; it runs the same main."""
    import importlib

    old = importlib.import_module("rigpilot.engine.service.rankexec")
    new = importlib.import_module("rigpilot.engine.launch.rankexec")
    assert old.main is new.main
