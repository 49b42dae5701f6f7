"""The prepared GPU check: what only a real GPU can show, in one call of the device tool (under 10 minutes).

    sh benchmarks/gpu_check.sh                       # on the lent machine: installs Rigpilot, runs this, into $OUT
    .venv/bin/python benchmarks/gpu_check.py --out DIR [--quick]   # anywhere; without a GPU it is a dry run
    .venv/bin/python benchmarks/gpu_check.py --out DIR --dry-run   # the CPU path even where a GPU is (CI runs it)

Everything goes through Rigpilot as a user drives it (the CLI, the engine service it starts, jobs run by
workers under torchrun), in a private scratch home so nothing of the user's is touched:

1. machine: `rigpilot gpus --json` beside `nvidia-smi --query-gpu` (name, memory, driver, power limit): the
   same fields must agree.
2. training: a ~1.1B Llama (TinyLlama-1.1B's shape, random weights from a config, no download) trained for a
   few dozen steps under each recipe the engine runs: bf16 mixed precision, pure bf16, 8-bit AdamW, the
   optimizer step in backward, chunked cross-entropy, activation offloading, compile, FSDP2 CPU offload, LoRA and
   QLoRA. For each: the plan's peak memory and tokens/s beside the job's own peak (`max_memory_allocated`, as the
   workers report it) and steady tokens/s, and MFU.
3. inference: the engine's greedy completion beside transformers' `generate()` on the same weights.
4. `rigpilot doctor` (run second, before the training): per GPU, matmul at each precision against the spec
   sheet's peak, memory bandwidth, NVML against `nvidia-smi -q`, health; per pair (none on one GPU) the peer
   copies and all-reduces. Its table is printed as the CLI prints it.

Without a GPU (`torch.cuda.is_available()` false) the same code runs on the simulated machine with the tiny
example model and CPU ranks, a few steps each: a dry run of the whole path, labelled as such, whose figures
say nothing about GPUs. Writes DIR/gpu_check.json and DIR/gpu_check.txt (the table), and prints the table.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
TINY = REPO / "examples" / "models" / "tiny-llama"
DATA = REPO / "examples" / "data" / "shakespeare.txt"
# TinyLlama-1.1B's shape (github.com/jzhang38/TinyLlama): 22 layers of 2048, GQA 32/4; its 32000-token vocabulary.
ONE_B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 32000, "hidden_size": 2048,
    "intermediate_size": 5632, "num_hidden_layers": 22, "num_attention_heads": 32, "num_key_value_heads": 4,
    "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
    "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2, "torch_dtype": "bfloat16",
}  # fmt: skip
# (label, method, `rigpilot plan`/`run train` flags of the recipe): each recipe the engine runs, pinned.
RECIPES = [
    ("bf16 mixed precision", "scratch", ["--master-weights", "fp32", "--optimizer", "adamw"]),
    ("pure bf16", "scratch", ["--master-weights", "bf16"]),
    ("8-bit AdamW", "scratch", ["--master-weights", "bf16", "--optimizer", "adamw8bit"]),
    ("optimizer in backward", "scratch", ["--master-weights", "bf16", "--optimizer-in-backward"]),
    ("chunked cross-entropy", "scratch", ["--master-weights", "bf16", "--loss-chunks", "8"]),
    ("activation offloading", "scratch", ["--master-weights", "bf16", "--activation-offload"]),
    ("compile", "scratch", ["--master-weights", "bf16", "--compile"]),
    ("FSDP2 CPU offload", "scratch", ["--master-weights", "fp32", "--offload", "on"]),
    ("LoRA", "lora", []),
    ("QLoRA (NF4)", "qlora", []),
]
PROMPT = "ROMEO:"
CALL_TIMEOUT_S = 240  # one CLI call or job: a step that hangs is recorded as such, the rest still run


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="folder for gpu_check.json and gpu_check.txt")
    p.add_argument("--quick", action="store_true", help="the first two recipes and inference only")
    p.add_argument("--dry-run", action="store_true",
                   help="run the same code on the simulated machine's CPU ranks with the tiny model, GPU or not")  # fmt: skip
    p.add_argument("--steps", type=int, default=None, help="training steps per recipe (default 15 on a GPU, 4 dry)")
    p.add_argument("--recipes", default=None, metavar="1,3,…",
                   help="only these recipes, by number (1-based, in the order of RECIPES): to split the check "
                        "across two device calls when one would run past 10 minutes")  # fmt: skip
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    chosen = [RECIPES[int(i) - 1] for i in args.recipes.split(",")] if args.recipes else None
    check = Check(args.out, quick=args.quick, steps=args.steps, recipes=chosen, dry_run=args.dry_run)
    try:
        check.run()
    finally:
        check.close()
    return 0


class Check:
    def __init__(
        self, out: Path, *, quick: bool, steps: int | None, recipes: list[Any] | None = None, dry_run: bool = False
    ):
        self.out = out
        self.gpu = not dry_run and _cuda_available()
        self.quick = quick
        self.recipes = recipes
        self.steps = steps or (15 if self.gpu else 4)
        self.home = Path(tempfile.mkdtemp(prefix="rigpilot-gpu-check-"))
        self.env = _scratch_env(self.home, simulate=None if self.gpu else "4x-rtx4090")
        self.report: dict[str, Any] = {
            "schema": "rigpilot.gpu-check/1", "started": time.time(), "dry_run": not self.gpu,
            "python": sys.version.split()[0], "torch": _torch_version(), "steps": self.steps,
            "machine": None, "doctor": None, "training": [], "inference": None,
        }  # fmt: skip

    # -- the steps ------------------------------------------------------------------------------------------
    def run(self) -> None:
        self.report["machine"] = self._step(self.machine)
        self.report["doctor"] = self._step(self.doctor)
        model = self._step(self.model_folder)
        if isinstance(model, dict) and model.get("path"):
            trained = None
            recipes = self.recipes or (RECIPES[:2] if self.quick else RECIPES)
            if not self.gpu and not self.recipes:  # a dry run checks the path, not the recipes: two, a few steps
                recipes = [RECIPES[1], RECIPES[8]]
            for label, method, flags in recipes:
                row = self._step(lambda: self.train(model["path"], label, method, flags))  # noqa: B023
                self.report["training"].append({"recipe": label, **(row if isinstance(row, dict) else {})})
                if isinstance(row, dict) and row.get("output") and method != "lora" and trained is None:
                    trained = row["output"]
                self._write()
            self.report["inference"] = self._step(lambda: self.inference(trained or model["path"]))
        self.report["ended"] = time.time()
        self._write()
        print(self.table())

    def machine(self) -> dict[str, Any]:
        """`rigpilot gpus --json` beside `nvidia-smi --query-gpu`, field by field."""
        ours = json.loads(self.cli("gpus", "--json"))["machine"]
        mine = [{"index": g["index"], "name": g["name"], "memory_mib": round((g.get("memory_total") or 0) / 2**20),
                 "power_limit_w": g.get("power_limit_w")} for g in ours["gpus"]]  # fmt: skip
        row: dict[str, Any] = {"label": ours["label"], "rigpilot": mine}
        if not shutil.which("nvidia-smi"):
            row["nvidia_smi"] = "not installed (no NVIDIA driver): nothing to compare"
            return row
        q = subprocess.run(
            ["nvidia-smi", "--query-gpu=index,name,memory.total,power.limit,driver_version",
             "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        theirs = []
        for line in q.stdout.strip().splitlines():
            i, name, mem, power, driver = (x.strip() for x in line.split(","))
            theirs.append({"index": int(i), "name": name, "memory_mib": int(float(mem)),
                           "power_limit_w": _number(power), "driver": driver})  # fmt: skip
        row["nvidia_smi"] = theirs
        row["agree"] = {
            f: all(a.get(f) == b.get(f) for a, b in zip(mine, theirs, strict=False)) and len(mine) == len(theirs)
            for f in ("index", "name", "memory_mib")
        }
        row["agree"]["power_limit_w"] = all(
            a.get("power_limit_w") is None or b.get("power_limit_w") is None
            or abs(a["power_limit_w"] - b["power_limit_w"]) < 1 for a, b in zip(mine, theirs, strict=False)
        )  # fmt: skip
        return row

    def doctor(self) -> dict[str, Any]:
        """`rigpilot doctor` as a user runs it: the job, then the stored report (exit 1 only says it found a fault)."""
        r = subprocess.run([sys.executable, "-m", "rigpilot.engine.cli", "doctor"], capture_output=True, text=True,
                           env=self.env, timeout=CALL_TIMEOUT_S, cwd=self.home)  # fmt: skip
        report = json.loads(self.cli("doctor", "--show", "--json")).get("report")
        table = r.stdout[r.stdout.find("Machine check of") :] if "Machine check of" in r.stdout else r.stdout[-2000:]
        return {"exit": r.returncode, "report": report, "table": table.strip(), "stderr": r.stderr.strip()[-500:]}

    def model_folder(self) -> dict[str, Any]:
        """The ~1.1B Llama (the tiny one on a dry run) with random weights, saved once: LoRA and QLoRA load them."""
        folder = self.home / "model"
        folder.mkdir()
        for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
            if (TINY / f).exists():
                shutil.copy(TINY / f, folder / f)
        config = ONE_B if self.gpu else json.loads((TINY / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps(config, indent=1))
        code = (
            "import sys, torch, transformers as t\n"
            "c = t.AutoConfig.from_pretrained(sys.argv[1])\n"
            "gpu = torch.cuda.is_available()\n"
            "with torch.device('cuda' if gpu else 'cpu'):\n"
            "    m = t.AutoModelForCausalLM.from_config(c, torch_dtype=torch.bfloat16 if gpu else torch.float32)\n"
            "m.save_pretrained(sys.argv[1])\n"
            "print(sum(p.numel() for p in m.parameters()))\n"
        )
        made = subprocess.run([sys.executable, "-c", code, str(folder)], capture_output=True, text=True, timeout=300)
        if made.returncode:
            raise RuntimeError(f"could not make the model: {made.stderr.strip()[-400:]}")
        return {"path": str(folder), "params": int(made.stdout.split()[-1]), "dry_run": not self.gpu}

    def train(self, model: str, label: str, method: str, flags: list[str]) -> dict[str, Any]:
        seq, batch = (2048, 8) if self.gpu else (64, 4)  # a step of 16k tokens: seconds per recipe on one GPU
        plan_method = "full" if method == "scratch" else method
        plan_flags = [f for f in flags if f not in ("--offload", "on")]
        if "--offload" in flags:
            plan_flags += ["--offload", "on"]
        plan_file = self.home / f"plan-{len(self.report['training'])}.json"
        # A dry run takes the formula's plan: tracing it (a third of a CPU minute) is the planner's, tested apart.
        verify = [] if self.gpu else ["--no-verify"]
        search = json.loads(self.cli("plan", "--model", model, "--method", plan_method, "--seq", str(seq),
                                     "--batch", str(batch), "--json", *verify, *plan_flags))  # fmt: skip
        plan_file.write_text(json.dumps(search))
        best = search.get("best")
        if not best:
            return {"refused": next((r.get("reason") for r in search.get("rejected") or []), "no plan fits")}
        # The plan carries the recipe it was sized for; the job takes it from there (apply_plan_training).
        job = json.loads(self.cli(
            "run", "train", "--model", model if method != "scratch" else str(Path(model) / "config.json"),
            "--method", method, "--data", str(DATA), "--plan", str(plan_file), "--steps", str(self.steps), "--json",
        ))["job"]  # fmt: skip
        done = self.wait(job["id"])
        metrics = json.loads(self.cli("metrics", job["id"], "--json"))
        progress = done.get("progress") or done.get("measured") or {}
        mfus = [r["mfu"] for r in metrics["records"] if isinstance(r.get("mfu"), int | float)]
        planned_peak = max(m["total"] for m in best["memory"])
        peak = max((progress.get("peak_memory_by_rank") or {"0": 0}).values()) or None
        tps = progress.get("steady_tokens_per_s")
        timing = best.get("timing") or {}
        return {
            "job": job["id"], "state": done["state"], "exit_reason": done.get("exit_reason"),
            "layout": (best.get("parallelism") or {}).get("family"), "recipe_words": best.get("recipe"),
            "planned_peak_gib": planned_peak / 2**30, "peak_gib": peak / 2**30 if peak else None,
            "peak_ratio": peak / planned_peak if peak else None,
            "planned_tokens_per_s": timing.get("tokens_per_s"), "tokens_per_s": tps,
            "speed_ratio": tps / timing["tokens_per_s"] if tps and timing.get("tokens_per_s") else None,
            "planned_mfu": timing.get("mfu"), "mfu": sorted(mfus)[len(mfus) // 2] if mfus else None,
            "output": (done.get("output") or {}).get("folder"),
        }  # fmt: skip

    def inference(self, model: str) -> dict[str, Any]:
        """The engine's greedy completion beside transformers' generate() on the same folder."""
        new = 32
        job = json.loads(self.cli("run", "infer", "--model", model, "--prompt", PROMPT, "--max-new-tokens", str(new),
                                  "--temperature", "0", "--json"))["job"]  # fmt: skip
        done = self.wait(job["id"])
        if done["state"] != "completed":
            raise RuntimeError(f"inference job {job['id']} {done['state']}: {done.get('exit_reason')}")
        (ours,) = json.loads(self.cli("results", job["id"], "--json"))["results"]
        code = (
            "import sys, json, torch, transformers as t\n"
            "tok = t.AutoTokenizer.from_pretrained(sys.argv[1])\n"
            "dev = 'cuda' if torch.cuda.is_available() else 'cpu'\n"
            "m = t.AutoModelForCausalLM.from_pretrained(sys.argv[1], torch_dtype=torch.bfloat16 if dev == 'cuda' "
            "else torch.float32).to(dev)\n"
            "ids = tok(sys.argv[2], return_tensors='pt').to(dev)\n"
            "out = m.generate(**ids, max_new_tokens=int(sys.argv[3]), do_sample=False)\n"
            "print(json.dumps(tok.decode(out[0][ids['input_ids'].shape[1]:], skip_special_tokens=True)))\n"
        )
        ref = subprocess.run([sys.executable, "-c", code, model, PROMPT, str(new)], capture_output=True, text=True,
                             timeout=CALL_TIMEOUT_S, env={**os.environ, "PYTHONPATH": ""})  # fmt: skip
        if ref.returncode:
            raise RuntimeError(f"generate() failed: {ref.stderr.strip()[-400:]}")
        theirs = json.loads(ref.stdout.strip().splitlines()[-1])
        return {"job": job["id"], "state": done["state"], "engine": ours.get("completion"), "generate": theirs,
                "same": ours.get("completion") == theirs}  # fmt: skip

    # -- plumbing ---------------------------------------------------------------------------------------------
    def cli(self, *words: str) -> str:
        r = subprocess.run([sys.executable, "-m", "rigpilot.engine.cli", *words], capture_output=True, text=True,
                           env=self.env, timeout=CALL_TIMEOUT_S, cwd=self.home)  # fmt: skip
        if r.returncode:
            raise RuntimeError(f"rigpilot {' '.join(words[:3])}…: {(r.stderr or r.stdout).strip()[-500:]}")
        return r.stdout

    def wait(self, job: str) -> dict[str, Any]:
        deadline = time.monotonic() + CALL_TIMEOUT_S
        while time.monotonic() < deadline:
            view = json.loads(self.cli("jobs", "--json"))
            rec = next((j for j in view.get("jobs", []) if j["id"] == job), None)
            if rec and rec["state"] in ("completed", "failed", "cancelled", "interrupted"):
                return json.loads(self.cli("metrics", job, "--json"))["job"]  # the whole view: output, progress
            time.sleep(2)
        self.cli("cancel", job)
        raise RuntimeError(f"job {job} did not end within {CALL_TIMEOUT_S} s (cancelled)")

    def _step(self, fn: Any) -> Any:
        t0 = time.monotonic()
        try:
            result = fn()
        except Exception as e:  # one broken step is a finding; the others still run
            result = {"error": f"{type(e).__name__}: {e}"}
        if isinstance(result, dict):
            result["seconds"] = round(time.monotonic() - t0, 1)
        return result

    def _write(self) -> None:
        (self.out / "gpu_check.json").write_text(json.dumps(self.report, indent=1, default=str))
        (self.out / "gpu_check.txt").write_text(self.table() + "\n")

    def table(self) -> str:
        r = self.report
        head = "DRY RUN on CPU ranks (simulated machine): the figures say nothing about GPUs" if r["dry_run"] else ""
        lines = [f"Rigpilot GPU check — torch {r['torch']}, {r['steps']} steps per recipe. {head}".rstrip()]
        m = r.get("machine") or {}
        lines.append(f"machine: {m.get('label', m.get('error', '?'))}; nvidia-smi agrees: {m.get('agree', m.get('nvidia_smi'))}")
        doc = r.get("doctor") or {}
        lines.append("rigpilot doctor: " + (doc.get("error") or doc.get("stderr") or f"exit {doc.get('exit')}"))
        lines += ["  " + line for line in (doc.get("table") or "").splitlines()]
        lines.append(f"{'recipe':<24} {'state':<10} {'peak GiB':>9} {'plan':>7} {'ratio':>6} {'tok/s':>9} "
                     f"{'plan':>9} {'ratio':>6} {'MFU':>6} {'plan':>6}")  # fmt: skip
        for t in r["training"]:
            if "error" in t or "refused" in t:
                lines.append(f"{t['recipe']:<24} {(t.get('error') or 'refused: ' + t['refused'])[:100]}")
                continue
            lines.append(
                f"{t['recipe']:<24} {t['state']:<10} {_f(t['peak_gib'], '.2f'):>9} {_f(t['planned_peak_gib'], '.2f'):>7} "
                f"{_f(t['peak_ratio'], '.2f'):>6} {_f(t['tokens_per_s'], ',.0f'):>9} "
                f"{_f(t['planned_tokens_per_s'], ',.0f'):>9} {_f(t['speed_ratio'], '.2f'):>6} {_f(t['mfu'], '.0%'):>6} "
                f"{_f(t['planned_mfu'], '.0%'):>6}"
            )
        inf = r.get("inference") or {}
        if "error" in inf:
            lines.append(f"inference: {inf['error']}")
        elif inf:
            lines.append(f"inference: engine and generate() {'agree' if inf['same'] else 'DIFFER'} "
                         f"({inf['engine']!r} vs {inf['generate']!r})")  # fmt: skip
        return "\n".join(lines)

    def close(self) -> None:
        subprocess.run([sys.executable, "-m", "rigpilot.engine.cli", "engine", "--stop"], env=self.env,
                       capture_output=True, timeout=60)  # fmt: skip
        shutil.rmtree(self.home, ignore_errors=True)


def _scratch_env(home: Path, simulate: str | None) -> dict[str, str]:
    env = {**os.environ, "HOME": str(home), "PYTHONUNBUFFERED": "1"}
    for var, sub in (("XDG_CONFIG_HOME", "config"), ("XDG_STATE_HOME", "state"), ("XDG_CACHE_HOME", "cache"),
                     ("XDG_DATA_HOME", "data"), ("XDG_RUNTIME_DIR", "run")):  # fmt: skip
        (home / sub).mkdir(mode=0o700, parents=True, exist_ok=True)
        env[var] = str(home / sub)
    if simulate:
        env["RIGPILOT_SIMULATE"] = simulate
    return env


def _cuda_available() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except ImportError:
        return False


def _torch_version() -> str:
    try:
        import torch

        return str(torch.__version__)
    except ImportError:
        return "missing"


def _number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


def _f(v: Any, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


if __name__ == "__main__":
    sys.exit(main())
