"""`rigpilot plan`: will a model fit on these GPUs, and what is the fastest way to split it?

    rigpilot plan --model llama-3.1-8b --task train --method lora --gpus 0,1
    rigpilot plan --model ./my-model --task infer --quant 4bit --json
    rigpilot plan --model mistral-7b --export deepspeed > ds_config.json
    rigpilot plan --model llama-3.1-8b --nodes 2 --internode 25gbe
    rigpilot plan --model llama-3.1-8b --node-machine box1.json --node-machine box2.json --internode ndr

Prints the best plan with its explanation, runners-up and rejected families (or
the smallest changes that make it fit). With --export the artifact goes to
stdout and the explanation to stderr, so it can be redirected into a file.
Exit status: 0 with a plan, 1 when nothing fits, 2 for bad input.

The formula's plan prints at once; the top plans' memory is then traced on the
engine's own model and each outcome printed below it as it comes, then what the
traces changed (Ctrl-C stops the check, --no-verify skips it). Traces are kept
in the trace cache (engine.planner.trace_cache): a plan traced before is
verified at once. --json and --export print once, verified, as they always have.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rigpilot.engine import schema
from rigpilot.engine.errors import UserError
from rigpilot.engine.given_path import MISSING, PathRefused, check_given_path, shown
from rigpilot.engine.hardware.importers import unknown_model_gpus
from rigpilot.engine.hardware.machine import Source
from rigpilot.engine.planner import machine_check, verify
from rigpilot.engine.planner.amounts import TIGHT_FILL, fmt_gib
from rigpilot.engine.planner.calibration import MachineCalibration, apply_stored
from rigpilot.engine.planner.calibration import apply as apply_calibration
from rigpilot.engine.planner.cluster import DEFAULT_LINK, NODE_LINKS, check_nodes, node_link
from rigpilot.engine.planner.export import export_best
from rigpilot.engine.planner.plan import LoraSettings, Plan, Workload, recipe_words
from rigpilot.engine.planner.search import RANKING, SearchOptions, SearchResult
from rigpilot.engine.planner.settings import PLAN_SETTINGS as P
from rigpilot.engine.planner.settings import QUANT_BITS
from rigpilot.engine.planner.verify import search_checked
from rigpilot.engine.recipe import RECIPE_SETTINGS, open_words

DEFAULT_SEQ = 2048
DEFAULT_TRAIN_BATCH = 16
DEFAULT_NEW_TOKENS = 256


def register(subparsers: Any, parents: list[argparse.ArgumentParser] | None = None) -> argparse.ArgumentParser:
    """Add the `plan` subcommand to an argparse subparsers object; its handler is `run_plan`."""
    parents = parents or []
    p = subparsers.add_parser(
        "plan",
        parents=parents,
        help="will a model fit on these GPUs, and the fastest way to split it",
        description="Plan training or inference of a model on this machine's GPUs.",
    )
    p.add_argument("--model", required=True, metavar="ID|PATH", help="preset name, folder with config.json, or Hugging Face repo id")
    p.add_argument("--task", choices=("train", "infer"), default="train")
    # Each option below is a setting's one declaration (engine.planner.settings: the job's own where `run train`
    # shares it), so a value is refused in the engine's sentence and the planner's advice names the same flag.
    schema.add_option(p, P["method"], help="training method (default full)")
    schema.add_option(p, P["seq_len"], help=f"sequence length in tokens (default {DEFAULT_SEQ} or the model's context)")
    # Read here, not by the declaration's range: the planner refuses a batch out of range in its own sentence.
    p.add_argument(*P["batch"].flags, dest="batch", type=int, metavar=P["batch"].metavar, help=P["batch"].help)
    schema.add_option(p, P["precision"], help="compute dtype (training: mixed precision; default bf16)")
    # The indices as written ("all", "0,1"): parse_gpus refuses a bad list in the planner's sentence.
    p.add_argument(*P["gpus"].flags, dest="gpus", metavar="0,1,...", help="GPU indices to use (default: all)")
    if not any(a.option_strings == ["--json"] for parent in parents for a in parent._actions):
        p.add_argument("--json", action="store_true", help="print JSON")
    schema.add_option(p, P["export"])
    g = p.add_argument_group("details")
    schema.add_option(g, P["lora_rank"])
    r = p.add_argument_group("training recipe", "each left out is as its line says: chosen by the search (the "
                             "plainest that fits) or left at its default; given, it is pinned")  # fmt: skip
    for name in RECIPE_SETTINGS:
        value, meaning = open_words(name)  # the declaration says whether the search chooses it
        left_out = meaning if P[name].searched else f"{value}; {meaning}"
        schema.add_option(r, P[name], help=f"{P[name].help.rstrip('.')} (default: {left_out}).")
        if P[name].searched and P[name].type is bool:
            # A switch pinned off: the search never reaches for it.
            r.add_argument(f"--no-{P[name].flags[0].removeprefix('--')}", dest=name, action="store_false",
                           help=f"never use it ({P[name].label.lower()})")  # fmt: skip
    g.add_argument("--lora-targets", metavar="NAMES", help="comma-separated linear names, or all-linear (the default)")
    for name in ("quant", "new_tokens", "tokens"):
        schema.add_option(g, P[name])
    g.add_argument(
        "--compare-rented", action="store_true",
        help="with --tokens: time and cost to process them here and on the rented machines in your settings",
    )  # fmt: skip
    schema.add_option(g, P["force_tp"])
    schema.add_option(g, P["offload"])
    g.add_argument("--calibration", type=Path, metavar="FILE", help="what `rigpilot run calibrate` measured on this machine (its output/calibration.json)")
    m = p.add_argument_group("several machines")
    # Read as written: parse_nodes and cluster.node_link refuse a bad value in the planner's sentences.
    m.add_argument(*P["nodes"].flags, dest="nodes", default="1", metavar=P["nodes"].metavar, help=P["nodes"].help)
    m.add_argument(
        *P["internode"].flags, dest="internode", default=DEFAULT_LINK, metavar=P["internode"].metavar,
        help=f"the link between nodes: {', '.join(NODE_LINKS)} or a measured bandwidth in GB/s (default {DEFAULT_LINK})",
    )  # fmt: skip
    m.add_argument(
        "--node-machine", dest="node_machines", action="append", metavar="FILE|PROFILE",
        help="one node's machine: a simulated profile, a machine JSON (rigpilot gpus --json) or nvidia-smi "
        "files joined by commas; repeat once per node (the nodes must carry the same GPUs)",
    )  # fmt: skip
    g.add_argument("--script", metavar="FILE", help="the training or inference script exports launch")
    g.add_argument(
        "--no-verify", action="store_true",
        help="skip tracing the top plans' memory on the engine's own model (the formula alone)",
    )  # fmt: skip
    p.set_defaults(func=run_plan)
    return p


def parse_gpus(text: str | None) -> list[int] | None:
    """'0,1,3' -> [0, 1, 3]; None or 'all' -> None (every GPU); '' -> [] (rejected by the search)."""
    if text is None or text.strip().lower() == "all":
        return None
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UserError(f"--gpus takes GPU indices separated by commas, like 0,1,3 (got {text!r})") from None


def parse_nodes(text: str | int) -> int:
    try:
        value: Any = int(str(text).strip())
    except ValueError:
        value = text  # not a number: check_nodes refuses it in the planner's sentence
    return check_nodes(value)


def load_node_machine(text: str) -> Any:
    """One `--node-machine`: a simulated profile's id, a machine JSON file, or nvidia-smi files joined by commas.

    A machine JSON goes through the same check as the engine's `plan` request (planworker.plan_machine)."""
    from rigpilot.engine.api.protocol import ProtocolError
    from rigpilot.engine.hardware.simulated import list_profiles
    from rigpilot.engine.service.planworker import plan_machine

    if text in {p["id"] for p in list_profiles()}:
        return plan_machine(text)
    paths = [Path(x) for x in text.split(",") if x.strip()]
    if not paths:
        raise UserError("--node-machine takes a simulated profile, a machine JSON or nvidia-smi files, not nothing")
    for path in paths:
        try:
            check_given_path(path, "--node-machine file")
        except PathRefused as e:
            if e.problem != MISSING:
                raise
            raise UserError(f"{e}, nor is {shown(text)!r} a simulated profile (see 'rigpilot profiles')") from None
    if len(paths) == 1 and paths[0].suffix.lower() == ".json":
        try:
            doc = json.loads(paths[0].read_text())
        except (OSError, ValueError) as e:
            raise UserError(f"--node-machine {paths[0]}: not a machine JSON ({e})") from None
        if isinstance(doc, dict) and isinstance(doc.get("machine"), dict):
            doc = doc["machine"]  # what `rigpilot gpus --json` prints
        try:
            return plan_machine(doc)
        except ProtocolError as e:
            raise UserError(f"--node-machine {paths[0]}: {e.message}") from None
    from rigpilot.engine.hardware.discovery import open_backend

    found = open_backend(import_paths=paths)
    found.backend.close()
    return found.machine


def workload_from_args(args: argparse.Namespace, context: int | None) -> Workload:
    task = args.task
    # A method for inference, or --quant for training, is refused by the planner's check (validate_workload).
    bits = QUANT_BITS[args.quant or P["quant"].default]
    method = args.method or "full"
    seq = args.seq_len if args.seq_len is not None else min(DEFAULT_SEQ, context or DEFAULT_SEQ)
    batch = args.batch if args.batch is not None else (DEFAULT_TRAIN_BATCH if task == "train" else 1)
    if batch < 1:
        raise UserError("--batch must be at least 1")
    new_tokens = 0
    if task == "infer":
        new_tokens = args.new_tokens if args.new_tokens is not None else min(DEFAULT_NEW_TOKENS, max(seq // 4, 1))
        if new_tokens < 1:
            raise UserError("--new-tokens must be at least 1")
    elif args.new_tokens is not None:
        raise UserError("--new-tokens applies to inference (--task infer)")
    lora = None
    if method != "full":
        rank = args.lora_rank if args.lora_rank is not None else LoraSettings().rank
        targets = [t.strip() for t in (args.lora_targets or "all-linear").split(",") if t.strip()]
        lora = LoraSettings(rank=rank, alpha=2 * rank, targets=targets)
    elif args.lora_targets:
        raise UserError("--lora-targets needs --method lora or qlora")
    budget = int(args.tokens) if args.tokens is not None else None
    return Workload(
        model=args.model,
        task=task,
        method=method,
        precision=args.precision or P["precision"].default,
        seq_len=seq,
        global_batch=batch,
        **{name: getattr(args, name, None) for name in RECIPE_SETTINGS},
        lora=lora,
        weight_bits=bits,
        new_tokens=new_tokens,
        token_budget=budget,
    )


def _calibration(path: Path | None) -> MachineCalibration | None:
    return None if path is None else MachineCalibration.load(path)


def run_plan(args: argparse.Namespace) -> int:
    from rigpilot.engine.models.describe import describe_model

    factory = getattr(args, "machine_factory", None)
    if factory is None:
        raise UserError("no machine to plan for")
    machine = factory()
    unnamed = unknown_model_gpus(machine) if machine.source is Source.IMPORTED else []
    if unnamed:
        raise UserError(
            f"the model of GPU {', '.join(map(str, unnamed))} is unknown (topo -m names none), so neither is its "
            "memory: give it with --gpu-model KEY (e.g. rtx-4090, a100-sxm4-80gb, h100-sxm5), or import the "
            "machine's `nvidia-smi -q` output too",
            reason="gpu_model_needed", gpus=unnamed,
        )  # fmt: skip
    spec = describe_model(args.model)
    workload = workload_from_args(args, spec.max_position_embeddings)
    nodes = parse_nodes(args.nodes)
    node_link(args.internode)  # a bad --internode is refused before any work
    node_machines = [load_node_machine(x) for x in args.node_machines] if args.node_machines else None
    stored = getattr(args, "stored_calibration", None)
    # The machine the engine runs on: its latest machine check counts here as in the engine's planner.
    stored_check = getattr(args, "stored_doctor", None)
    gpus = parse_gpus(args.gpus)
    looked_at = machine_check.use(
        stored_check(machine) if stored_check is not None and not node_machines else None, machine, gpus
    )
    if args.calibration is None and stored is not None:
        # Its latest calibration too.
        calibrated = apply_stored(stored(), machine, workload.precision, checked=looked_at.calibration)
    else:
        calibrated = apply_calibration(
            _calibration(args.calibration), machine, workload.precision, checked=looked_at.calibration
        )
    # One search, with or without --export: the export translates the plan `plan` shows into the tool's terms.
    searched = functools.partial(
        search_checked, spec, machine, workload, calibrated, gpus=gpus,
        options=SearchOptions(force_tp=bool(args.force_tp), offload=args.offload or P["offload"].default, nodes=nodes,
                              internode=args.internode),
        node_machines=node_machines, machine_check=looked_at,
    )  # fmt: skip
    checked = not getattr(args, "no_verify", False) and verify.enabled()
    if checked and not getattr(args, "json", False) and not args.export and not getattr(args, "compare_rented", False):
        return _plan_then_trace(searched, simulated=machine.simulated)
    result = searched(verify=checked)
    calibrated_status = calibrated[1]
    comparison = _compare_rented(args, spec, machine, workload, result) if getattr(args, "compare_rented", False) else None
    artifact, exported, instead = None, None, None
    if args.export and result.best is not None:
        plans = [result.best, *result.runners_up]
        artifact, exported, instead = export_best(plans, args.export, script=args.script)
    if getattr(args, "json", False):
        payload = {"schema": "rigpilot.plan-search/1", **result.to_dict(), "calibration": calibrated_status.to_dict()}
        if args.export:
            payload["export"] = {"target": args.export, "text": artifact, "plan": exported, "note": instead}
        if comparison is not None:
            payload["rented_comparison"] = comparison
        print(json.dumps(payload, indent=2))
    elif artifact is not None:
        print("\n".join(render_text(result, simulated=machine.simulated)), file=sys.stderr)
        if instead:
            print(f"note: {instead}", file=sys.stderr)
        sys.stdout.write(artifact if artifact.endswith("\n") else artifact + "\n")
    else:
        print("\n".join(render_text(result, simulated=machine.simulated)))
        if comparison is not None:
            from rigpilot.engine.planner.rented import render

            print("\n" + "\n".join(render(comparison)))
    return 0 if result.best is not None else 1


def _plan_then_trace(searched: Callable[..., SearchResult], *, simulated: bool) -> int:
    """The formula's plan at once, then each trace's outcome as it comes, then what the traces changed.

    The answer never waits on the trace: the formula's search is printed first (milliseconds), and Ctrl-C
    during the trace stops it, leaving that answer standing."""
    formula = searched(verify=False)
    print("\n".join(render_text(formula, simulated=simulated)), flush=True)
    plans = verify.to_trace(formula)
    if formula.best is None or not plans:
        return 0 if formula.best is not None else 1
    names = {id(p): _rank(i) for i, p in enumerate(plans)}
    print(f"\nMemory check: the top {len(plans)} plan(s) traced on the engine's own model…", flush=True)

    def arrived(i: int, plan: Plan, answer: dict[str, Any]) -> None:
        line = verify.outcome_line(verify.outcome(plan, answer))
        print(f"  {names.get(id(plan), _rank(i))}  {plan.parallelism.family}: {line}", flush=True)

    memo: dict[str, dict[str, Any]] = {}
    started = time.perf_counter()
    try:
        answers = verify.trace_all(plans, on_answer=arrived, memo=memo)
    except KeyboardInterrupt:
        print("memory check stopped: the formula's figures stand", flush=True)
        return 0
    seconds = time.perf_counter() - started
    # The same search again, every trace known: the verdict as `rigpilot plan --json` gives it.
    final = searched(verify=True, memo=memo)
    traced = sum(bool(a.get("ok")) for a in answers)
    cached = sum(bool(a.get("ok") and a.get("cached")) for a in answers)
    note = f"memory traced for {traced} of {len(plans)} plan(s) in {seconds:.1f} s" + (
        f" ({cached} from the trace cache)" if cached else ""
    )
    print("\n".join([*_after_trace(formula, final, simulated), f"note: {note}"]), flush=True)
    return 0 if final.best is not None else 1


def _after_trace(formula: SearchResult, final: SearchResult, simulated: bool) -> list[str]:
    """What the traces changed, below the formula's answer: the best plan if it gave way, the disagreements."""
    out: list[str] = []
    findings = [line for line in final.explanation if line not in formula.explanation]
    if findings:
        out += [""] + [f"  {line}" for line in findings]
    if final.best is None:
        out.append("Nothing fits once traced.")
        return out
    same = formula.best is not None and final.best.parallelism == formula.best.parallelism
    if not same:
        plans = [final.best, *final.runners_up]
        out += ["", f"Plans once traced, {RANKING}:"]
        out += [f"  {row}" for row in _table(plans, final.workload, nodes=final.nodes > 1)]
    if final.best.peak_memory.traced is not None:
        out += ["", "Memory per GPU of the best plan, traced:"]
        out += [f"  {row}" for row in _memory_table(final.best, simulated)]
    return out


def _compare_rented(args: argparse.Namespace, spec: Any, machine: Any, workload: Workload, result: SearchResult) -> Any:
    """`--compare-rented`: this plan against each rented machine in the settings, for the --tokens budget."""
    from rigpilot.engine.planner.rented import compare
    from rigpilot.engine.settings import Settings

    if workload.token_budget is None:
        raise UserError("--compare-rented needs a token budget: --tokens N (e.g. --tokens 1e9)")
    settings = Settings.load()

    plan_for = searcher(spec, workload, SearchOptions(force_tp=bool(args.force_tp), offload=args.offload or "auto"))
    return compare((machine.label, result.best, machine), settings.rented_machines, workload.token_budget,
                   settings.price(), plan_for)  # fmt: skip


def render_text(result: SearchResult, *, simulated: bool = False) -> list[str]:
    """The search in words; `simulated`: planned for a simulated machine (Machine.simulated)."""
    out = [f"{result.machine}, GPUs {','.join(map(str, result.gpu_indices))}", ""]
    out += [f"  {line}" for line in result.explanation]
    plans = ([result.best] if result.best else []) + result.runners_up
    if plans:
        out += ["", f"Plans, {RANKING}:"]
        out += [f"  {row}" for row in _table(plans, result.workload, nodes=result.nodes > 1)]
        for i, p in enumerate(plans):
            if not p.runs_here:
                out.append(f"  {_rank(i)} cannot run here: {p.runs_here_reason}")
    if result.best is not None:
        out += ["", "Memory per GPU of the best plan:"]
        out += [f"  {row}" for row in _memory_table(result.best, simulated)]
        if result.best.verification:
            out.append(f"  memory {result.best.verification}")
    for note in result.notes + (result.best.notes if result.best else []):
        out.append(f"note: {note}")
    out.append(f"({result.considered} plans considered, {result.fitting} fit, searched in {result.elapsed_s * 1e3:.0f} ms)")
    return out


def _table(plans: list[Plan], w: Workload, *, nodes: bool = False) -> list[str]:
    """The ranked plans; `nodes`: a multi-node search, whose plans may use different numbers of nodes."""
    unit = "tokens/s" if w.training else "gen tok/s"
    # The recipe gets a column where the search changed it for some plan (each plan is sized with its own).
    recipes = [recipe_words(p.workload) if p.workload.training else "" for p in plans]
    shown = len(set(recipes)) > 1 or any(p.workload.training and not p.workload.recipe.plain for p in plans)
    rows = [("", *(("nodes",) if nodes else ()), "family", "layout", *(("recipe",) if shown else ()), unit,
             "step" if w.training else "total", "fullest GPU")]  # fmt: skip
    for i, p in enumerate(plans):
        mb = p.peak_memory
        marks = [*(("traced",) if (mb.traced or 0) > mb.total else ()),
                 *(("tight",) if mb.headroom >= 0 and mb.shown_total > TIGHT_FILL * mb.capacity else ())]  # fmt: skip
        rows.append(
            (
                _rank(i) + ("" if p.runs_here else " ✗"),
                *((str(p.parallelism.nodes),) if nodes else ()),
                p.parallelism.family,
                p.parallelism.describe(),
                *((recipes[i],) if shown else ()),
                f"{p.timing.tokens_per_s:,.0f}",
                f"{p.timing.step_s:.2f} s",
                f"{fmt_gib(mb.shown_total)} / {fmt_gib(mb.capacity)}" + (f" ({', '.join(marks)})" if marks else ""),
            )
        )
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    return ["  ".join(cell.ljust(widths[c]) for c, cell in enumerate(r)).rstrip() for r in rows]


def _rank(i: int) -> str:
    return "best" if i == 0 else f"#{i + 1}"


def _memory_table(plan: Plan, simulated: bool) -> list[str]:
    traced = any(m.traced is not None for m in plan.memory)
    head = ("node:GPU" if plan.parallelism.nodes > 1 else "GPU", "weights", "grads", "optimizer", "activations", "KV cache", "buffers", "overhead", "total",
            *(("traced",) if traced else ()), "of", "free")  # fmt: skip
    rows = [head]
    nodes = plan.parallelism.nodes > 1
    for m in plan.memory:
        rows.append(
            (
                f"{m.node + 1}:{m.gpu}" if nodes else str(m.gpu), fmt_gib(m.weights), fmt_gib(m.gradients), fmt_gib(m.optimizer), fmt_gib(m.activations),
                fmt_gib(m.kv_cache), fmt_gib(m.buffers), fmt_gib(m.overhead), fmt_gib(m.total),
                *((fmt_gib(m.traced) if m.traced is not None else "-",) if traced else ()), fmt_gib(m.capacity),
                fmt_gib(m.headroom),
            )
        )
    widths = [max(len(r[c]) for r in rows) for c in range(len(head))]
    lines = ["  ".join(cell.rjust(widths[c]) for c, cell in enumerate(r)) for r in rows]
    host = plan.host
    avail = fmt_gib(host.available) if host.available else "unknown"
    if host.available and simulated:
        avail = f"the simulated machine's {avail} (jobs' CPU ranks use this host's RAM)"
    lines.append(f"host RAM: {fmt_gib(host.needed)} needed of {avail}" + (f" ({fmt_gib(host.offloaded)} offloaded)" if host.offloaded else ""))
    return lines


def searcher(spec: Any, workload: Any, options: Any = None) -> Any:
    """`plan_for` for `planner.rented.compare`: the planner's search on another machine, uncalibrated (a calibration measured
    this machine, not that one) and untraced; a refusal (a GPU without the workload's dtype) becomes the reason."""
    from rigpilot.engine.errors import UserError
    from rigpilot.engine.planner.search import search
    from rigpilot.engine.planner.settings import sentence_of

    def plan_for(machine: Any) -> tuple[Plan | None, str]:
        try:
            found = search(spec, machine, workload, options=options)
        except UserError as e:
            return None, sentence_of(e)  # its terms too, for the row's why_terms
        return found.best, "" if found.best else "nothing fits"

    return plan_for
