"""`rigpilot compare-models`: a tiny LoRA job trained through a real engine, then its base and tuned completions
from one real server, each equal to transformers' generate() (the tuned one of peft's merged model, the reference
we did not write); and the command's refusals, each one line."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from rigpilot.engine.cli.compare import comparison_lines, comparison_plan, held_out_line
from rigpilot.engine.cli.entry import main as cli_main
from rigpilot.engine.errors import UserError
from rigpilot.engine.jobs.metrics import held_out

from support.engine import wait_job_state
from support.paths import SHAKESPEARE
from support.worker_jobs import save_random_llama

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


@pytest.mark.slow
def test_a_lora_job_compared_with_its_base_equals_generate_of_both(engine, tmp_path, capsys):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    engine.start()
    tiny = save_random_llama(tmp_path / "tiny", initializer_range=0.2)
    train = ["run", "train", "--model", str(tiny), "--method", "lora", "--data", str(SHAKESPEARE), "--gpus", "0",
             "--steps", "2", "--precision", "fp32", "--seq", "32", "--micro-batch", "2", "--lr", "0.05",
             "--name", "tiny-lora"]  # fmt: skip
    assert cli_main(train) == 0
    capsys.readouterr()
    argv = ["compare-models", "tiny-lora", "--prompt", PROMPTS[0], "--prompt", PROMPTS[1],
            "--max-tokens", str(NEW_TOKENS)]  # fmt: skip
    assert cli_main([*argv, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["schema"] == "rigpilot.compare/1" and doc["method"] == "lora" and doc["base_model"] == str(tiny)
    assert [r["prompt"] for r in doc["results"]] == PROMPTS
    figures = doc["held_out"]
    assert figures["eval_loss"] > 0 and math.isclose(figures["perplexity"], math.exp(figures["eval_loss"]))

    tok = AutoTokenizer.from_pretrained(tiny)
    base = AutoModelForCausalLM.from_pretrained(tiny, torch_dtype="float32")
    assert [r["base"] for r in doc["results"]] == reference(base, tok, PROMPTS)
    merged = PeftModel.from_pretrained(base, doc["tuned_model"]).merge_and_unload()
    tuned = reference(merged, tok, PROMPTS)
    assert [r["tuned"] for r in doc["results"]] == tuned
    assert tuned != [r["base"] for r in doc["results"]]  # the adapter was trained and served

    with engine.client() as c:
        jobs = c.request("jobs")["jobs"]
        served = [j for j in jobs if j["kind"] == "serve"]
        assert len(served) == 1  # base and adapter from one server
        wait_job_state(c, served[0]["id"], "cancelled", "completed", "failed", timeout=90)
        assert cli_main(["metrics", "tiny-lora"]) == 0
        assert f"  {held_out_line(figures)}" in capsys.readouterr().out.splitlines()
        # The server is no training job: refused in one line, as `rigpilot serve` refuses it.
        assert cli_main(["compare-models", served[0]["id"], "--prompt", "x"]) == 2
        err = capsys.readouterr().err.strip()
        assert "only a training job" in err and "\n" not in err
        assert cli_main(["compare-models", "no-such-job", "--prompt", "x"]) == 2
        assert "no job no-such-job" in capsys.readouterr().err


def test_no_prompts_or_a_bad_prompts_file_is_refused_before_the_engine_is_asked(tmp_path, capsys):
    assert cli_main(["compare-models", "job1"]) == 2
    assert "compare on what? give --prompt" in capsys.readouterr().err
    bad = tmp_path / "p.jsonl"
    bad.write_text('{"text": "no prompt"}\n')
    assert cli_main(["compare-models", "job1", "--prompts", str(bad)]) == 2
    assert 'line 1: needs a "prompt" string' in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli_main(["compare-models", "job1", "--prompt", "x", "--max-tokens", "0"])


def _job(tmp_path: Path, method: str, model: str | None, files: dict[str, str]) -> dict:
    out = tmp_path / "output"
    out.mkdir(parents=True)
    for name, text in files.items():
        (out / name).write_text(text)
    (tmp_path / "job.json").write_text(json.dumps({"kind": "train"} | ({"model": model} if model else {})))
    return {"id": "j1", "kind": "train", "job_dir": str(tmp_path), "settings": {"train": {"method": method}}}


def test_a_full_fine_tune_is_served_as_two_models_and_a_base_is_needed(tmp_path):
    job = _job(tmp_path / "full", "full", "org/base", {"config.json": "{}"})
    plan = comparison_plan(job, None)
    assert [s["model"] for s in plan["servings"]] == ["org/base", str(tmp_path / "full" / "output")]
    assert comparison_plan(job, "other/base")["base_model"] == "other/base"
    with pytest.raises(UserError, match="trained from scratch") as e:
        comparison_plan(_job(tmp_path / "scratch", "scratch", "cfg.json", {"config.json": "{}"}), None)
    assert e.value.reason == "compare_base_missing"
    with pytest.raises(UserError, match="names no base model") as e:
        comparison_plan(_job(tmp_path / "nameless", "full", None, {"config.json": "{}"}), None)
    assert e.value.reason == "compare_base_missing"
    with pytest.raises(UserError, match="saved no model") as e:
        comparison_plan(_job(tmp_path / "empty", "full", "org/base", {}), None)


def test_held_out_figures_come_from_the_last_eval_record():
    assert held_out(None) is None and held_out({"eval": None}) is None
    assert held_out({"eval": {"eval_loss": float("nan"), "step": 3}}) is None
    figures = held_out({"eval": {"eval_loss": 2.0, "step": 8, "rank": 0}})
    assert figures == {"eval_loss": 2.0, "perplexity": math.exp(2.0), "step": 8}
    assert held_out_line(figures) == f"held-out loss: 2.0000, perplexity {math.exp(2.0):.4g} after step 8"
    assert held_out({"eval": {"eval_loss": 1e4}})["perplexity"] == math.inf
    assert "not measured" in held_out_line(None)


def test_the_side_by_side_prints_each_prompt_with_both_completions_safely():
    job, plan = {"id": "j1", "name": "chat"}, {"method": "lora", "base_model": "org/base"}
    rows = [{"prompt": "Hi", "base": "there\x1b[2J", "tuned": " friend\nof mine"}]
    lines = comparison_lines(job, plan, None, rows)
    assert lines[:2] == ["job j1 (chat): lora of org/base", "  held-out loss: not measured (the job evaluated no "
                         "held-out data)"]  # fmt: skip
    assert lines[3] == "prompt: Hi" and lines[4].startswith("  base:  there") and lines[5].startswith("  tuned: ")
    assert len(lines) == 6 and all("\x1b" not in line and "\n" not in line for line in lines)
