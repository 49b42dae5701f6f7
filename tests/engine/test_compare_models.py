"""`rigpilot compare-models`: a tiny LoRA job trained through a real engine, then its base and tuned completions
from one real server, each equal to transformers' generate() (the tuned one of peft's merged model, the reference
we did not write); and the command's refusals, each one line."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from rigpilot.engine.cli.compare import comparison_lines
from rigpilot.engine.cli.comparison import comparison_plan, held_out_line
from rigpilot.engine.cli.entry import main as cli_main
from rigpilot.engine.errors import UserError
from rigpilot.engine.jobs.metrics import held_out

from support.engine import Engine, engine_home, leftover_job_processes, wait_job_state
from support.paths import REPO, SHAKESPEARE
from support.worker_jobs import save_random_llama, warm_socket

PROMPTS = ["To be, or not", "My lord"]
NEW_TOKENS = 6


def reference(model, tokenizer, prompts: list[str]) -> list[str]:
    import torch

    out = []
    for prompt in prompts:
        ids = tokenizer(prompt, return_tensors="pt")
        with torch.no_grad():
            new = model.generate(**ids, max_new_tokens=NEW_TOKENS, do_sample=False)[0, ids["input_ids"].shape[1] :]
        out.append(tokenizer.decode(new, skip_special_tokens=True))
    return out


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """{"engine", "tiny", "base", "tuned"}: an engine that trained the tiny LoRA job "tiny-lora" on a random tiny
    Llama, and generate()'s completions of PROMPTS by the base and by peft's merged model of the job's adapter."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    mp = pytest.MonkeyPatch()
    root = tmp_path_factory.mktemp("engine")
    engine_home(root, mp)
    mp.setenv("PYTHONPATH", str(REPO))  # the ranks run this checkout
    engine = Engine(root)
    engine.start()
    try:
        tiny = save_random_llama(root / "tiny", initializer_range=0.2)
        warm_socket()  # the training's rank forks from the warm worker too, rather than import torch afresh
        train = ["run", "train", "--model", str(tiny), "--method", "lora", "--data", str(SHAKESPEARE), "--gpus", "0",
                 "--steps", "2", "--precision", "fp32", "--seq", "32", "--micro-batch", "2", "--lr", "0.05",
                 "--name", "tiny-lora", "--detach"]  # fmt: skip
        assert cli_main(train) == 0
        with engine.client() as c:
            job = wait_job_state(c, "tiny-lora", "completed", "failed", timeout=120)
        assert job["state"] == "completed", job.get("exit_reason")
        tok = AutoTokenizer.from_pretrained(tiny)
        base = AutoModelForCausalLM.from_pretrained(tiny, torch_dtype="float32")
        base_texts = reference(base, tok, PROMPTS)
        merged = PeftModel.from_pretrained(base, str(Path(job["job_dir"]) / "output")).merge_and_unload()
        yield {"engine": engine, "tiny": tiny, "base": base_texts, "tuned": reference(merged, tok, PROMPTS)}
    finally:
        engine.stop()
        for p in leftover_job_processes(root):
            p.kill()
        mp.undo()


def only_server_ends(engine) -> dict:
    """The one serve job a comparison ran, once it ended."""
    with engine.client() as c:
        (served,) = [j for j in c.request("jobs")["jobs"] if j["kind"] == "serve"]  # base and adapter: one server
        return wait_job_state(c, served["id"], "cancelled", "completed", "failed", timeout=90)


@pytest.mark.slow  # a LoRA job trained and a model served by a real engine
def test_a_lora_job_compared_with_its_base_equals_generate_of_both(trained, capsys):
    argv = ["compare-models", "tiny-lora", "--prompt", PROMPTS[0], "--prompt", PROMPTS[1],
            "--max-tokens", str(NEW_TOKENS)]  # fmt: skip
    capsys.readouterr()
    assert cli_main([*argv, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["schema"] == "rigpilot.compare/1" and doc["method"] == "lora"
    assert doc["base_model"] == str(trained["tiny"]) and doc["name"] == "tiny-lora"
    assert [r["prompt"] for r in doc["results"]] == PROMPTS
    figures = doc["held_out"]
    assert figures["eval_loss"] > 0 and math.isclose(figures["perplexity"], math.exp(figures["eval_loss"]))
    assert [r["base"] for r in doc["results"]] == trained["base"]
    assert [r["tuned"] for r in doc["results"]] == trained["tuned"]
    assert trained["tuned"] != trained["base"]  # the adapter was trained and served

    server = only_server_ends(trained["engine"])
    assert server["state"] == "cancelled", server.get("exit_reason")
    assert cli_main(["metrics", "tiny-lora"]) == 0
    assert f"  {held_out_line(figures)}" in capsys.readouterr().out.splitlines()
    # The server is no training job: refused in one line, as `rigpilot serve` refuses it.
    assert cli_main(["compare-models", server["id"], "--prompt", "x"]) == 2
    err = capsys.readouterr().err.strip()
    assert "only a training job" in err and "\n" not in err
    assert cli_main(["compare-models", "no-such-job", "--prompt", "x"]) == 2
    assert "no job no-such-job" in capsys.readouterr().err


@pytest.mark.slow
def test_the_summarys_compare_with_base_model_shows_the_same_completions(qtbot, trained):
    from rigpilot.app.engine_link import EngineLink
    from rigpilot.app.jobs.compare_base import CompareWithBase

    with trained["engine"].client() as c:
        job = c.request("job", job="tiny-lora")["job"]
        before = {j["id"] for j in c.request("jobs")["jobs"]}
    link = EngineLink()
    panel = CompareWithBase()
    qtbot.addWidget(panel)
    panel.show_job(link, job)
    assert not panel.isHidden()  # offered: a completed training job
    panel.max_tokens = NEW_TOKENS
    panel.compare()
    assert panel.status.text() == "Type at least one prompt, one a line."
    panel.prompts.setPlainText("\n".join(PROMPTS) + "\n\n")
    panel.compare()
    assert not panel.button.isEnabled()
    try:
        qtbot.waitUntil(lambda: not panel.running, timeout=120_000)
    finally:
        link.stop()
    assert panel.status.text().startswith("Held-out loss: "), panel.status.text()
    assert panel.rows() == [[p, b, t] for p, b, t in zip(PROMPTS, trained["base"], trained["tuned"], strict=True)]
    with trained["engine"].client() as c:
        (server,) = [j for j in c.request("jobs")["jobs"] if j["id"] not in before]
        assert wait_job_state(c, server["id"], "cancelled", "completed", "failed", timeout=90)["state"] == "cancelled"


def test_no_prompts_or_a_bad_prompts_file_is_refused_before_the_engine_is_asked(tmp_path, capsys):
    assert cli_main(["compare-models", "job1"]) == 2
    assert "compare on what? give --prompt" in capsys.readouterr().err
    bad = tmp_path / "p.jsonl"
    bad.write_text('{"text": "no prompt"}\n')
    assert cli_main(["compare-models", "job1", "--prompts", str(bad)]) == 2
    assert 'line 1: needs a "prompt" string' in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli_main(["compare-models", "job1", "--prompt", "x", "--max-tokens", "0"])


def _job(method: str, model: str | None, output: str | None) -> dict:
    """A finished training job as the engine's `job` request shows it: its settings, and what its output holds."""
    settings = {"kind": "train", "train": {"method": method}} | ({"model": model} if model else {})
    return {"id": "j1", "kind": "train", "state": "completed", "settings": settings,
            "output": {"folder": "/jobs/j1/output", "model": output}}  # fmt: skip


def test_a_full_fine_tune_is_served_as_two_models_and_a_base_is_needed():
    plan = comparison_plan(_job("full", "org/base", "full"), None)
    # The tuned model by the job's id: the engine puts in its folder (engine.jobs.serve_source).
    assert [s["model"] for s in plan["servings"]] == ["org/base", "j1"]
    assert comparison_plan(_job("full", "org/base", "full"), "other/base")["base_model"] == "other/base"
    lora = comparison_plan(_job("lora", "org/base", "lora"), None)["servings"]
    assert lora == [{"model": "org/base", "names": {"base": "base", "tuned": "tuned"}, "adapters": {"tuned": "j1"}}]
    with pytest.raises(UserError, match="trained from scratch") as e:
        comparison_plan(_job("scratch", "cfg.json", "full"), None)
    assert e.value.reason == "compare_base_missing"
    with pytest.raises(UserError, match="name no base model") as e:
        comparison_plan(_job("full", None, "full"), None)
    assert e.value.reason == "compare_base_missing"
    with pytest.raises(UserError, match="saved no model"):
        comparison_plan(_job("full", "org/base", None), None)


def test_held_out_figures_come_from_the_last_eval_record():
    assert held_out(None) is None and held_out({"eval": None}) is None
    assert held_out({"eval": {"eval_loss": float("nan"), "step": 3}}) is None
    figures = held_out({"eval": {"eval_loss": 2.0, "step": 8, "rank": 0}})
    assert figures == {"eval_loss": 2.0, "perplexity": math.exp(2.0), "step": 8}
    assert held_out_line(figures) == f"held-out loss: 2.0000, perplexity {math.exp(2.0):.4g} after step 8"
    assert held_out({"eval": {"eval_loss": 1e4}})["perplexity"] == math.inf
    assert "not measured" in held_out_line(None)


def test_the_side_by_side_prints_each_prompt_with_both_completions_safely():
    rows = [{"prompt": "Hi", "base": "there\x1b[2J", "tuned": " friend\nof mine"}]
    doc = {"job": "j1", "name": "chat", "method": "lora", "base_model": "org/base", "held_out": None, "results": rows}
    lines = comparison_lines(doc)
    assert lines[:2] == ["job j1 (chat): lora of org/base", "  held-out loss: not measured (the job evaluated no "
                         "held-out data)"]  # fmt: skip
    assert lines[3] == "prompt: Hi" and lines[4].startswith("  base:  there") and lines[5].startswith("  tuned: ")
    assert len(lines) == 6 and all("\x1b" not in line and "\n" not in line for line in lines)
