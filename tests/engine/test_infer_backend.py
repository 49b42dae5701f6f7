"""The inference backend: one decision (engine.capability.choose_infer_backend) for submit, --check and the
job views; vLLM only on real GPUs where it is installed and the layout fits it, else Rigpilot's own generator.

No test here runs vLLM (there is none on this machine, and no GPU): the vLLM path (engine.workers.infer_vllm)
is covered only by its pure helpers. The decision is tested with the worker environment's answer given, and
end to end on a simulated machine through the real engine and CLI.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from rigpilot.engine.capability import (
    INFER_BACKENDS,
    WorkerVllm,
    backend_words,
    choose_infer_backend,
    vllm_why_not,
)
from rigpilot.engine.cli.entry import main as cli_main
from rigpilot.engine.errors import UserError
from rigpilot.engine.hardware.machine import Source
from rigpilot.engine.hardware.simulated import load_profile
from rigpilot.engine.jobs.limits import check_job_settings
from rigpilot.engine.jobs.submission import describe, prepare
from rigpilot.engine.jobspec.spec import InferSettings, JobSpec, Parallelism
from rigpilot.engine.layout import Layout

from support.paths import REPO

TINY_LLAMA = REPO / "examples" / "models" / "tiny-llama"
INSTALLED = WorkerVllm("/env/bin/python", "0.11.0")
MISSING = WorkerVllm("/env/bin/python", None)
TP2 = Layout(tp=2)


def never_asked() -> WorkerVllm:
    raise AssertionError("the worker environment was asked although vLLM was already ruled out")


def choose(asked: str, layout: Layout = TP2, *, simulated: bool = False, found=INSTALLED, **kw):
    return choose_infer_backend(asked, layout, simulated=simulated, worker_vllm=lambda: found, **kw)


# -- the decision ---------------------------------------------------------------------------------------------


def test_auto_takes_vllm_only_where_everything_allows_it() -> None:
    b = choose("auto")
    assert (b.name, b.refusal) == ("vllm", None)
    assert "vLLM 0.11.0" in b.reason and "tensor parallel 2 × pipeline parallel 1" in b.reason

    cases = {
        "simulated": (dict(simulated=True), "simulated"),
        "not installed": (dict(found=MISSING), "vLLM is not installed in the worker environment (/env/bin/python)"),
        "cannot ask": (dict(found=WorkerVllm("/env/bin/python", None, "it crashed")), "could not be asked"),
        "data parallel": (dict(layout=Layout(dp_replicate=2)), "data parallel 2"),
        "two nodes": (dict(nodes=2), "2 nodes"),
        "slurm": (dict(slurm=True), "SLURM"),
        "tiny temperature": (dict(temperature=0.005), "below the 0.01"),
        "hot temperature": (dict(temperature=3.0), "above the 2"),
    }
    for what, (kw, words) in cases.items():
        b = choose("auto", **kw)
        assert b.name == "transformers" and b.refusal is None, what
        assert b.reason.startswith("chosen automatically: ") and words in b.reason and "\n" not in b.reason, what


def test_the_worker_environment_is_asked_only_when_nothing_else_rules_vllm_out() -> None:
    for kw in (dict(simulated=True), dict(nodes=2), dict(layout=Layout(dp_shard=2))):
        layout = kw.pop("layout", Layout())
        b = choose_infer_backend("auto", layout, worker_vllm=never_asked, **{"simulated": False, **kw})
        assert b.name == "transformers"
    assert choose_infer_backend("transformers", Layout(), simulated=False, worker_vllm=never_asked).reason == (
        "asked for"
    )


def test_vllm_asked_for_but_not_possible_is_one_line_naming_the_reason_and_the_way_out() -> None:
    missing = choose("vllm", found=MISSING).refusal
    assert missing == (
        "backend vllm: vLLM is not installed in the worker environment (/env/bin/python); install it there or "
        "use --backend transformers"
    )
    simulated = choose("vllm", simulated=True).refusal
    assert simulated is not None and simulated.startswith("backend vllm: the machine's GPUs are simulated")
    assert simulated.endswith("; use --backend transformers") and "\n" not in simulated
    assert choose("vllm").name == "vllm" and choose("vllm").reason.startswith("asked for: vLLM 0.11.0")


def test_vllm_runs_the_plans_tensor_and_pipeline_degrees_on_one_node() -> None:
    assert vllm_why_not(Layout(tp=4, pp=2), simulated=False) is None
    assert "data parallel 4" in (vllm_why_not(Layout(dp_replicate=2, dp_shard=2), simulated=False) or "")
    assert "16-bit" in (vllm_why_not(Layout(), simulated=False, weight_bits=4) or "")
    assert backend_words("vllm") == "vLLM"
    assert backend_words("transformers", "asked for") == "transformers (Rigpilot's own generator) — asked for"


# -- the schema -----------------------------------------------------------------------------------------------


def test_an_old_spec_without_a_backend_loads_as_auto_and_unknown_values_are_refused_in_one_line() -> None:
    old = {"id": "j", "kind": "infer", "model": "m", "infer": {"prompts": ["hi"], "max_new_tokens": 4}}
    spec = JobSpec.from_dict(old)
    assert spec.infer is not None and spec.infer.backend == "auto" and INFER_BACKENDS[0] == "auto"
    spec.infer.backend = "tensorrt"
    with pytest.raises(UserError) as e:
        check_job_settings(spec)
    assert str(e.value) == "infer setting backend='tensorrt': must be one of auto, transformers, vllm"


def test_the_cli_flag_reaches_the_spec_and_refuses_unknown_values(capsys) -> None:
    from rigpilot.engine.cli.commands import build_spec
    from rigpilot.engine.cli.entry import build_parser

    args = build_parser().parse_args(["run", "infer", "--model", "m", "--prompt", "hi", "--backend", "vllm"])
    assert build_spec(args)["infer"]["backend"] == "vllm"
    assert "backend" not in build_spec(build_parser().parse_args(["run", "infer", "--model", "m", "--prompt", "hi"]))[
        "infer"
    ]  # left out: the engine's default, auto
    with pytest.raises(SystemExit) as e:
        cli_main(["run", "infer", "--model", "m", "--prompt", "hi", "--backend", "tensorrt"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "infer setting backend='tensorrt': must be one of auto, transformers, vllm" in err[0]


# -- the submission -------------------------------------------------------------------------------------------


def _infer(**infer) -> dict:
    return {"kind": "infer", "model": str(TINY_LLAMA), "gpus": [0, 1], "infer": {"prompts": ["hi"], **infer}}


def test_a_simulated_machine_runs_transformers_and_says_why(tmp_path: Path) -> None:
    machine = load_profile("4x-rtx4090")
    sub = prepare(_infer(), None, str(tmp_path), job_id="c", machine=machine, max_cpu_ranks=2, worker_vllm=never_asked)
    assert sub.spec.infer is not None and sub.spec.infer.backend == "transformers"
    assert sub.spec.infer.backend_reason.startswith("chosen automatically: the machine's GPUs are simulated")
    assert sub.ranks == 2
    assert "note: inference backend: transformers (Rigpilot's own generator) — chosen automatically" in "\n".join(
        describe(sub)
    )
    with pytest.raises(UserError) as e:
        prepare(_infer(backend="vllm"), None, str(tmp_path), job_id="c", machine=machine, max_cpu_ranks=2)
    assert str(e.value).startswith("backend vllm: the machine's GPUs are simulated") and "\n" not in str(e.value)


def test_on_real_gpus_with_vllm_installed_the_job_is_one_process_under_the_plans_degrees(tmp_path: Path) -> None:
    real = dataclasses.replace(load_profile("4x-rtx4090"), source=Source.NVML)
    spec = {**_infer(), "parallelism": {"tp": 2}}
    sub = prepare(spec, None, str(tmp_path), job_id="c", machine=real, max_cpu_ranks=2, worker_vllm=lambda: INSTALLED)
    assert sub.spec.infer is not None and (sub.spec.infer.backend, sub.ranks) == ("vllm", 1)
    lines = describe(sub)
    assert lines[0].endswith("as one vLLM process, which starts a worker per GPU itself")
    assert "vLLM batches the prompts itself" in lines[2]
    # No degrees on two GPUs is data parallel 2: one replica per GPU, which vLLM here does not run.
    sub = prepare(_infer(), None, str(tmp_path), job_id="c", machine=real, max_cpu_ranks=2, worker_vllm=lambda: INSTALLED)
    assert sub.spec.infer is not None and (sub.spec.infer.backend, sub.ranks) == ("transformers", 2)
    assert "data parallel 2" in sub.spec.infer.backend_reason
    with pytest.raises(UserError) as e:
        prepare({**spec, "infer": {"prompts": ["hi"], "backend": "vllm"}}, None, str(tmp_path), job_id="c",
                machine=real, max_cpu_ranks=2, worker_vllm=lambda: MISSING)  # fmt: skip
    assert "vLLM is not installed in the worker environment (/env/bin/python)" in str(e.value)


def test_the_launcher_starts_one_process_for_a_vllm_job() -> None:
    from rigpilot.engine.jobs.launching import on_vllm

    spec = JobSpec(id="j", kind="infer", parallelism=Parallelism(tp=2), infer=InferSettings(backend="vllm"))
    assert on_vllm(spec)
    assert not on_vllm(dataclasses.replace(spec, infer=InferSettings(backend="auto")))  # a job.json from before
    assert not on_vllm(dataclasses.replace(spec, kind="train", infer=None))


# -- the worker environment ---------------------------------------------------------------------------------


def test_the_probe_finds_vllm_by_its_package_without_importing_it(tmp_path: Path, monkeypatch) -> None:
    """Only the probe's "is it installed" answer: a package named vllm that fails when imported."""
    from rigpilot.engine import runtime

    site = tmp_path / "site"
    (site / "vllm").mkdir(parents=True)
    (site / "vllm" / "__init__.py").write_text("raise SystemExit('imported')\n")
    (site / "vllm-9.9.9.dist-info").mkdir()
    (site / "vllm-9.9.9.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm\nVersion: 9.9.9\n")
    monkeypatch.setenv(runtime.ENV_OVERRIDE, sys.executable)
    assert runtime.worker_vllm() == WorkerVllm(sys.executable, None)
    monkeypatch.setenv("PYTHONPATH", str(site))
    assert runtime.worker_vllm() == WorkerVllm(sys.executable, "9.9.9")


# -- the vLLM path's pure helpers (vLLM itself has never run here) ------------------------------------------


def test_the_job_settings_become_vllm_arguments() -> None:
    from rigpilot.engine.workers.infer_vllm import llm_kwargs, max_model_len, sampling_kwargs

    greedy = InferSettings(max_new_tokens=16)
    assert sampling_kwargs(greedy) == {"max_tokens": 16, "temperature": 0.0, "top_p": 1.0}
    hot = InferSettings(max_new_tokens=8, temperature=0.7, top_p=0.9, seed=3)
    assert sampling_kwargs(hot) == {"max_tokens": 8, "temperature": 0.7, "top_p": 0.9, "seed": 3}
    spec = JobSpec(id="j", kind="infer", trust_remote_code=True, parallelism=Parallelism(tp=2, pp=2),
                   infer=InferSettings(precision="fp16", seed=5))  # fmt: skip
    assert llm_kwargs(spec, "/models/x", 40) == {
        "model": "/models/x", "tensor_parallel_size": 2, "pipeline_parallel_size": 2, "dtype": "float16",
        "trust_remote_code": True, "seed": 5, "max_model_len": 40,
    }  # fmt: skip
    assert "max_model_len" not in llm_kwargs(spec, "/models/x", None)
    assert max_model_len([5, 30, 7], 10, context=2048) == 40
    assert max_model_len([5, 30, 7], 10, context=32) is None  # past the model's context: vLLM's own check says so


def test_vllm_results_are_written_as_the_transformers_backend_writes_them(tmp_path: Path) -> None:
    from rigpilot.engine.workers.infer_vllm import write_results

    path = write_results(tmp_path, ["a", "b"], [([1, 2], " x"), ([3], " y")])
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert rows == [{"prompt": "a", "completion": " x", "tokens": [1, 2]}, {"prompt": "b", "completion": " y", "tokens": [3]}]


# -- end to end, on a simulated machine -------------------------------------------------------------------------


def test_check_refuses_vllm_on_a_simulated_machine_in_one_line(engine, capsys) -> None:
    engine.start()
    base = ["run", "infer", "--model", str(TINY_LLAMA), "--prompt", "hi", "--gpus", "0"]
    assert cli_main([*base, "--backend", "vllm", "--check"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("rigpilot: error: backend vllm: the machine's GPUs are simulated")
    assert cli_main([*base, "--check"]) == 0
    out = capsys.readouterr().out
    assert "note: inference backend: transformers (Rigpilot's own generator) — chosen automatically: " in out


@pytest.mark.slow
def test_a_cpu_infer_job_reports_the_transformers_backend_in_its_summary_and_in_rigpilot_job(
    engine, tmp_path: Path, capsys
) -> None:
    from support.worker_jobs import save_random_llama

    model = save_random_llama(tmp_path / "llama", initializer_range=0.3)
    engine.start()
    run = ["run", "infer", "--model", str(model), "--prompt", "Shall I compare thee", "--gpus", "0",
           "--max-new-tokens", "4", "--precision", "fp32", "--env", "HF_HUB_OFFLINE=1", "--detach"]  # fmt: skip
    assert cli_main(run) == 0
    job_id = capsys.readouterr().out.split()[1]
    with engine.client() as c:
        done = engine.wait_state(c, job_id, "completed", "failed", "cancelled", timeout=300)
        assert done["state"] == "completed", (done["exit_reason"], done["last_log"])
        records, _ = c.all_metrics(job_id)
    summary = next(r for r in records if r.get("kind") == "infer_summary")
    assert summary["backend"] == "transformers"
    assert summary["backend_reason"].startswith("chosen automatically: the machine's GPUs are simulated")
    assert cli_main(["job", job_id]) == 0
    shown = capsys.readouterr().out
    assert "  backend: transformers (Rigpilot's own generator) — chosen automatically: the machine's GPUs" in shown


def test_the_job_views_name_the_backend_of_an_inference_job() -> None:
    from rigpilot.app.jobs.outcome import backend_of, settings_diff

    reason = "chosen automatically: vLLM is not installed in the worker environment (/env/bin/python)"
    job = {"kind": "infer", "settings": {"infer": {"backend": "transformers", "backend_reason": reason}}}
    assert backend_of(job) == f"transformers (Rigpilot's own generator) — {reason}"
    vllm = {"kind": "infer", "settings": {"infer": {"backend": "vllm", "backend_reason": "asked for"}}}
    assert backend_of(vllm) == "vLLM — asked for"
    before = {"kind": "infer", "settings": {"infer": {"backend": "auto"}}}  # job.json from before the choice
    assert backend_of(before) == "transformers (Rigpilot's own generator)"
    assert backend_of({"kind": "train", "settings": {}}) is None
    assert ("Backend", ["transformers", "vllm"]) in settings_diff([job, vllm])


def test_the_service_still_never_imports_vllm_or_torch() -> None:
    code = (
        "import sys, rigpilot.engine.service.server, rigpilot.engine.jobs.submission, rigpilot.engine.runtime; "
        "print('vllm' in sys.modules, 'torch' in sys.modules)"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["False", "False"]
