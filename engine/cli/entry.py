"""`rigpilot SUBCOMMAND`: the command line (bare `rigpilot` is app.launcher's).

Every data command takes `--simulate PROFILE` and `--import FILE` (repeatable)
and prints JSON with `--json` (schemas in docs/cli-json.md). Bad input prints
one line and exits 2.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

from rigpilot.engine import __version__
from rigpilot.engine.argtypes import positive_float
from rigpilot.engine.cli import refusals
from rigpilot.engine.errors import UserError
from rigpilot.engine.examples import note as examples_note
from rigpilot.engine.examples import shipped_example
from rigpilot.engine.jobspec.spec import INFER_SETTINGS, TRAIN_SETTINGS
from rigpilot.engine.settings import RENTED_EXAMPLE

EXIT_USAGE = 2


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        # argparse prints the whole usage block; one line that names the problem is kinder.
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


# The parents are _Parser too: add_parser(parents=...) takes parsers of the subparsers' own class.
def _machine_options() -> _Parser:
    p = _Parser(add_help=False)
    g = p.add_argument_group("machine")
    g.add_argument("--simulate", metavar="PROFILE", help="use a simulated machine (see 'rigpilot profiles')")
    g.add_argument(
        "--import", dest="import_paths", metavar="FILE", action="append", type=Path,
        help="describe a machine from nvidia-smi output: 'topo -m' text, '-q' text or '-q -x' XML, "
        "'nvlink --status'; repeat to combine files of one machine",
    )
    g.add_argument(
        "--gpu-model", metavar="KEY",
        help="with --import of a 'topo -m' file alone (it names no GPU model): the GPUs' model, a key of the GPU "
        "spec table (e.g. rtx-4090, a100-sxm4-80gb, h100-sxm5)",
    )  # fmt: skip
    return p


def _json_option() -> _Parser:
    p = _Parser(add_help=False)
    p.add_argument("--json", action="store_true", help="print JSON (schema in docs/cli-json.md)")
    return p


# app/launcher.py acts on these before argparse sees them (they start Qt, which the CLI never imports); they are
# declared here so that `rigpilot --help` and the man page (generated from this parser) describe them.
APP_OPTIONS_TITLE = "the app (each of these comes first, on its own)"
SELF_TEST_HELP = (
    "check this installation and exit: start the app offscreen, connect to your engine service "
    "(starting it if it is not running) and receive the machine and two telemetry samples, build and draw every "
    "page (Dashboard, Topology, Planner, Jobs, Serving, Settings), and export the Dashboard's chart as CSV. It prints "
    "'self-test passed' and exits 0, or names the first check that failed and exits 1, within 90 s. With DIR, "
    "each page's PNG and telemetry.csv are kept there. Needs no display and no PyTorch"
)
SCREENSHOTS_HELP = (
    "save a PNG of every page and of each job-wizard page into DIR (the README's pictures): made offscreen, on a "
    "simulated machine with throw-away settings, while it runs the shipped tiny example job (needs the engine "
    "environment)"
)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="rigpilot", description="Run AI work on a multi-GPU workstation.")
    parser.add_argument("--version", action="version", version=f"rigpilot {__version__}")
    app = parser.add_argument_group(APP_OPTIONS_TITLE)
    app.add_argument("--self-test", nargs="?", const="", metavar="DIR", help=SELF_TEST_HELP)
    app.add_argument("--screenshots", metavar="DIR", help=SCREENSHOTS_HELP)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    machine, js = _machine_options(), _json_option()

    p = sub.add_parser("gpus", parents=[machine, js], help="the GPUs and what they are doing, like nvidia-smi")
    p.set_defaults(func=cmd_gpus)

    p = sub.add_parser("topo", parents=[machine, js], help="how the GPUs are wired, in 'nvidia-smi topo -m' notation")
    p.set_defaults(func=cmd_topo)

    p = sub.add_parser("watch", parents=[machine, js], help="live view of the GPUs, refreshing in place")
    p.add_argument("--interval", type=positive_float, default=1.0, metavar="SECONDS", help="refresh period (default 1)")
    p.add_argument("--count", type=int, default=0, metavar="N", help="stop after N frames (default: until Ctrl-C)")
    p.set_defaults(func=cmd_watch)

    p = sub.add_parser("profiles", parents=[js], help="the simulated machines")
    p.set_defaults(func=cmd_profiles)

    p = sub.add_parser(
        "settings", parents=[js], help="show or change your settings (the simulated machine, CPU ranks, prices)",
        description="rigpilot settings: what is set and which machine the engine serves. "
        "rigpilot settings set simulated-profile 8x-h100-sxm: the machine shown when no NVIDIA GPU is present; "
        "a running engine switches to it at once unless jobs are queued or running. "
        "rigpilot settings set max-cpu-ranks N: processes per simulated job. "
        "rigpilot settings set electricity-price 0.30 --currency EUR: what a kWh costs you, for the cost of "
        "each job's energy ('none' clears it). "
        "rigpilot settings add-rented NAME --gpu KEY --count N --price-per-gpu-hour P --currency C: a rented "
        "machine at the price you pay, for 'rigpilot plan --tokens N --compare-rented'; remove-rented NAME drops it. "
        f"Example: {RENTED_EXAMPLE}",
    )  # fmt: skip
    p.add_argument("action", nargs="?", choices=["show", "set", "add-rented", "remove-rented"], default="show")
    p.add_argument("key", nargs="?", metavar="KEY|NAME", help=", ".join(sorted(SETTING_KEYS)) + "; or a rented machine's name")
    p.add_argument("value", nargs="?", metavar="VALUE")
    p.add_argument("--currency", metavar="CODE", help="three-letter currency code (EUR, USD, ...)")
    p.add_argument("--gpu", metavar="KEY", help="add-rented: the GPU model, a key of the GPU spec table (e.g. h100-sxm5)")
    p.add_argument("--count", metavar="N", help="add-rented: GPUs in the machine")
    p.add_argument("--price-per-gpu-hour", metavar="PRICE", help="add-rented: what one GPU-hour costs you")
    p.set_defaults(func=cmd_settings)

    p = sub.add_parser(
        "engine-env", parents=[js], help="the per-user PyTorch environment the job workers run in",
        description="status: what it has; install: create or complete it (resumable); repair: delete it and its "
        "cache, then install; remove: delete it and its cache; wheels: the 'pip download' commands that fetch, on "
        "a machine with internet access, the wheels for 'install --offline --find-links DIR'.",
    )  # fmt: skip
    p.add_argument("action", choices=["status", "install", "repair", "remove", "wheels"])
    p.add_argument("--torch-backend", default="auto", metavar="auto|cpu|cu126|…",
                   help="which PyTorch build (default: auto, the CUDA build for the installed NVIDIA driver, "
                   "the CPU build where there is none)")
    p.add_argument("--torch-version", metavar="VERSION",
                   help="another torch than the tested one (default: the version Rigpilot pins)")
    p.add_argument("--wheel", type=Path, metavar="FILE", help="install torch from this wheel")
    p.add_argument("--find-links", type=Path, action="append", metavar="DIR",
                   help="look for wheels in this folder too (repeatable); with --offline, only there")
    p.add_argument("--offline", action="store_true",
                   help="no network at all: install from the --find-links folders (see the 'wheels' action)")
    p.add_argument("--index-url", metavar="URL", help="package index to use instead of PyPI")
    p.add_argument("--python", metavar="PATH",
                   help="the Python 3.11+ interpreter to build the environment on (default: the app's)")
    p.set_defaults(func=cmd_engine_env)

    p = sub.add_parser(
        "forget", help="delete all your Rigpilot data: settings, jobs, checkpoints, the engine environment, caches",
        description="Stops your engine service, lists what it deletes with sizes, asks, then deletes it. Links "
        "inside Rigpilot's folders are removed, never followed: what they point to stays. Other users' data and "
        "the installed program are not touched.",
    )  # fmt: skip
    p.add_argument("--yes", action="store_true", help="do not ask")
    p.set_defaults(func=cmd_forget)

    from rigpilot.engine.cli.plan import register as register_plan

    register_plan(sub, parents=[machine, js])
    from rigpilot.engine.cli.commands import register as register_jobs

    register_jobs(sub, parents=[machine, js])
    from rigpilot.engine.cli.doctor import register as register_doctor

    register_doctor(sub, js)
    from rigpilot.engine.cli.serve import register as register_serve

    register_serve(sub)
    from rigpilot.engine.cli.compare import register as register_compare

    register_compare(sub, js)
    return parser


def _discover(args: argparse.Namespace):
    from rigpilot.engine.hardware.discovery import open_backend

    return open_backend(simulate=getattr(args, "simulate", None), import_paths=getattr(args, "import_paths", None),
                        gpu_model=getattr(args, "gpu_model", None))  # fmt: skip


def _machine(args: argparse.Namespace):
    """The machine a command shows or plans for, and its notes.

    The one the engine serves when it runs and the user named none (it may have switched since it
    started); else found as the engine would find it, by the same `open_backend`. So `gpus`, `topo`,
    `plan` and `run` never disagree.
    """
    from rigpilot.engine.api.client import EngineUnavailable

    if getattr(args, "gpu_model", None) and not getattr(args, "import_paths", None):
        raise UserError("--gpu-model names the GPUs of an imported topo -m file: add --import FILE")
    client = _running_engine(args)
    if client is not None:
        try:
            with client:
                return _engine_machine(client)
        except (OSError, EngineUnavailable):
            pass  # it stopped in between: find the machine as it would have
    d = _discover(args)
    d.backend.close()
    return d.machine, d.notes


def _stored_doctor(machine: Any) -> dict[str, Any] | None:
    """The engine's machine check of this machine on this driver (what a finished `rigpilot doctor` left)."""
    from rigpilot.engine import paths
    from rigpilot.engine.jobs import doctor_store

    return doctor_store.latest(machine, paths.doctor_dir())[0]


def _stored_calibration() -> dict[str, Any] | None:
    """The engine's latest calibration of this machine (what a finished `rigpilot run calibrate` left)."""
    from rigpilot.engine import paths
    from rigpilot.engine.jobs import calibration_store

    return calibration_store.stored(paths.calibration_path())


def _notes(notes: list[str]) -> None:
    for n in notes:
        print(f"note: {n}", file=sys.stderr)


def _print_json(schema: str, payload: dict[str, Any]) -> None:
    print(json.dumps({"schema": schema, **payload}, indent=2))


def _running_engine(args: argparse.Namespace):
    """The engine service, when one runs and the user named no machine.

    Its telemetry is the one to show: on a simulated machine only the engine
    knows the load its jobs put on the GPUs. Never starts a service.
    """
    if getattr(args, "simulate", None) or getattr(args, "import_paths", None):
        return None
    from rigpilot.engine.api.client import EngineClient, EngineUnavailable, service_running
    from rigpilot.engine.cli.commands import print_notice

    if not service_running():
        return None
    try:
        client = EngineClient(autostart=False, client_name="cli", on_notice=print_notice)
        client.connect()
        return client
    except EngineUnavailable:
        return None


def _engine_machine(client):
    from rigpilot.engine.hardware.machine import Machine

    reply = client.request("machine")
    return Machine.from_dict(reply["machine"]), list(reply.get("notes", []))


def _engine_latest_sample(client, machine):
    """The engine's newest sample of `machine` (one from before a machine switch does not count)."""
    from rigpilot.engine.hardware.telemetry import TelemetrySample

    reply = client.request("telemetry_history", since=time.time() - 30, limit=100)
    for raw in reversed(reply.get("samples") or []):
        sample = TelemetrySample.from_dict(raw)
        if _sample_of(sample, machine):
            return sample
    client.request("subscribe", topics=["telemetry"])
    deadline = time.monotonic() + 5.0
    while (left := deadline - time.monotonic()) > 0:
        ev = client.next_event(left)
        if ev is not None and ev.get("event") == "telemetry":
            sample = TelemetrySample.from_dict(ev["sample"])
            if _sample_of(sample, machine):
                return sample
    return None


def _sample_of(sample, machine) -> bool:
    have = {g.index: g.memory_total for g in sample.gpus}
    want = {g.index: g.memory_total for g in machine.gpus}
    return have.keys() == want.keys() and all(have[i] in (None, want[i]) for i in want)


def cmd_gpus(args: argparse.Namespace) -> int:
    from rigpilot.engine.hardware.sampler import Sampler
    from rigpilot.engine.terminal import gpus_table

    client = _running_engine(args)
    sample = None
    if client is not None:
        with client:
            machine, notes = _engine_machine(client)
            sample = _engine_latest_sample(client, machine)
        d = type("FromEngine", (), {"machine": machine, "notes": notes})()
    if sample is None:
        local = _discover(args)
        try:
            if client is not None and local.machine.to_dict() != d.machine.to_dict():
                raise UserError(f"the engine serves {d.machine.label} but sent no telemetry of it yet; try again")
            d = local
            sample = Sampler(d.backend).sample()
        finally:
            local.backend.close()
    if args.json:
        _print_json("rigpilot.gpus/1", {"machine": d.machine.to_dict(), "telemetry": sample.to_dict(), "notes": d.notes})
    else:
        _notes(d.notes)
        print(gpus_table(d.machine, sample))
    return 0


def cmd_topo(args: argparse.Namespace) -> int:
    from rigpilot.engine.hardware.topology import describe, render_matrix, summarize

    m, notes = _machine(args)
    d = type("Found", (), {"machine": m, "notes": notes})()
    if args.json:
        gpus = [g.index for g in m.gpus]
        cells = [[("X" if a == b else (m.pair(a, b).topo_code if m.pair(a, b) else None)) for b in gpus] for a in gpus]
        _print_json(
            "rigpilot.topo/1",
            {
                "machine": m.to_dict(),
                "matrix": {"gpus": gpus, "cells": cells},
                "summary": summarize(m).to_dict(),
                "description": describe(m),
                "notes": d.notes,
            },
        )
        return 0
    _notes(d.notes)
    print(m.label)
    print()
    print(render_matrix(m))
    print()
    print("Summary:")
    for line in describe(m):
        print(f"  {line}")
    for n in m.notes:
        print(f"  note: {n}")
    return 0


def _engine_samples(client, current: dict[str, Any]):
    from rigpilot.engine.hardware.machine import Machine
    from rigpilot.engine.hardware.telemetry import TelemetrySample

    client.request("subscribe", topics=["telemetry"])
    for ev in client.events():
        if ev.get("event") == "telemetry":
            yield TelemetrySample.from_dict(ev["sample"])
        elif ev.get("event") == "machine":  # the engine switched machines: draw the new one from now on
            current["machine"] = Machine.from_dict(ev["machine"])


def _local_samples(sampler, frames: queue.Queue):
    sampler.start()
    while True:
        yield frames.get()


def cmd_watch(args: argparse.Namespace) -> int:
    from rigpilot.engine.hardware.sampler import Sampler
    from rigpilot.engine.terminal import watch_frame

    client = _running_engine(args)
    sampler = None
    current: dict[str, Any] = {}  # the machine drawn: the engine may switch it while this runs
    if client is not None:
        current["machine"], notes = _engine_machine(client)
        samples = _engine_samples(client, current)
    else:
        d = _discover(args)
        current["machine"], notes = d.machine, d.notes
        frames: queue.Queue = queue.Queue(maxsize=2)
        sampler = Sampler(d.backend, period=args.interval, slow_period=max(5.0, args.interval))
        sampler.subscribe(lambda s: _offer(frames, s))
        samples = _local_samples(sampler, frames)
    tty = sys.stdout.isatty() and not args.json
    if not args.json:
        _notes(notes)
    if tty:
        sys.stdout.write("\x1b[?1049h\x1b[?25l")  # alternate screen, hide cursor
    shown = 0
    try:
        for sample in samples:
            if args.count and shown >= args.count:
                break
            if args.json:
                print(json.dumps({"schema": "rigpilot.telemetry/1", **sample.to_dict()}), flush=True)
            elif tty:
                body = watch_frame(current["machine"], sample).replace("\n", "\x1b[K\n")
                sys.stdout.write("\x1b[H" + body + "\x1b[K\x1b[J")
                sys.stdout.flush()
            else:
                print(watch_frame(current["machine"], sample, width=200) + "\n", flush=True)
            shown += 1
    except KeyboardInterrupt:
        pass
    finally:
        if sampler is not None:
            sampler.stop()
            sampler.backend.close()
        if client is not None:
            client.close()
        if tty:
            sys.stdout.write("\x1b[?25h\x1b[?1049l")
            sys.stdout.flush()
    return 0


def _offer(q: queue.Queue, item: Any) -> None:
    # A slow terminal must not back up the sampler: drop the oldest frame instead.
    while True:
        try:
            q.put_nowait(item)
            return
        except queue.Full:
            try:
                q.get_nowait()
            except queue.Empty:
                pass


def cmd_profiles(args: argparse.Namespace) -> int:
    from rigpilot.engine.hardware.simulated import list_profiles

    profiles = list_profiles()
    if args.json:
        _print_json("rigpilot.profiles/1", {"profiles": profiles})
        return 0
    w = max(len(p["id"]) for p in profiles)
    print("Simulated machines (use with --simulate PROFILE):")
    for p in profiles:
        print(f"  {p['id']:<{w}}  {p['title']}")
    return 0


SETTING_KEYS = {
    "simulated-profile": "simulated_profile", "max-cpu-ranks": "max_cpu_ranks", "electricity-price": "electricity_price",
}  # fmt: skip


def cmd_settings(args: argparse.Namespace) -> int:
    from rigpilot.engine.hardware.simulated import load_profile
    from rigpilot.engine.settings import Settings

    settings = Settings.load()
    for w in settings.warnings:
        print(f"note: {w}", file=sys.stderr)
    applied: dict[str, Any] | None = None
    refused = None
    if args.action in ("add-rented", "remove-rented"):
        _change_rented(args, settings)
    elif args.action == "set":
        if args.key is None or args.value is None or args.key not in SETTING_KEYS:
            raise UserError(
                "set what? rigpilot settings set simulated-profile PROFILE | max-cpu-ranks N | "
                "electricity-price PRICE --currency CODE"
            )
        field = SETTING_KEYS[args.key]
        if field == "electricity_price":
            _set_price(args, settings)
        elif field == "simulated_profile":
            load_profile(args.value)  # an unknown profile: one line naming the known ones
            value: Any = args.value
        else:
            try:
                value = int(args.value)
            except ValueError:
                value = 0
            if not 1 <= value <= 1024:
                raise UserError(f"max-cpu-ranks takes a whole number from 1 to 1024, not {args.value!r}")
        if field != "electricity_price":
            setattr(settings, field, value)
        settings.save()
        if field != "electricity_price":  # the engine reads the price from the file whenever it changes
            applied, refused = _apply_to_engine(args)
    machine, _ = _machine(argparse.Namespace())
    if args.json:
        _print_json("rigpilot.settings/1", {
            "settings": {
                **{k: getattr(settings, f) for k, f in SETTING_KEYS.items()},
                "electricity-currency": settings.electricity_currency, "rented-machines": settings.rented_machines,
            },
            "path": str(Settings.path()),
            "machine": machine.to_dict(), "engine_running": applied is not None or refused is not None
            or _running_engine(argparse.Namespace()) is not None, "not_applied": refused,
        })  # fmt: skip
    else:
        for key, f in SETTING_KEYS.items():
            if f == "electricity_price":
                price = settings.price()
                shown = f"{price['per_kwh']:g} {price['currency']}/kWh" if price else "not set"
                print(f"{key}: {shown}")
            else:
                print(f"{key}: {getattr(settings, f)}")
        print("rented machines:" if settings.rented_machines else f"rented machines: none (add one: {RENTED_EXAMPLE})")
        for m in settings.rented_machines:
            print(f"  {m['name']}: {m['gpus']}× {m['gpu']} at {m['price_per_gpu_hour']:g} {m['currency']} per GPU-hour")
        print(f"(stored in {Settings.path()})")
        print(f"machine: {machine.label}")
        if refused:
            print(f"saved, but the engine keeps its machine for now: {refused}", file=sys.stderr)
    return 1 if refused else 0


def _set_price(args: argparse.Namespace, settings: Any) -> None:
    from rigpilot.engine.settings import check_currency, check_price

    if args.value.strip().lower() in ("none", "off", ""):
        settings.electricity_price = settings.electricity_currency = None
        return
    currency = args.currency or settings.electricity_currency
    if currency is None:
        raise UserError("say which currency: rigpilot settings set electricity-price 0.30 --currency EUR")
    try:
        settings.electricity_price = check_price(args.value, "electricity-price")
        settings.electricity_currency = check_currency(currency)
    except ValueError as e:
        raise UserError(str(e)) from None


def _change_rented(args: argparse.Namespace, settings: Any) -> None:
    from rigpilot.engine.settings import check_rented_machine

    if not args.key:
        raise UserError(f"which machine? {RENTED_EXAMPLE}")
    kept = [m for m in settings.rented_machines if m["name"] != args.key.strip()]
    if args.action == "remove-rented":
        if len(kept) == len(settings.rented_machines):
            names = ", ".join(m["name"] for m in settings.rented_machines) or "none"
            raise UserError(f"no rented machine {args.key!r}; yours: {names}")
    else:
        missing = [f"--{n}" for n, v in (("gpu", args.gpu), ("count", args.count),
                   ("price-per-gpu-hour", args.price_per_gpu_hour), ("currency", args.currency)) if v is None]  # fmt: skip
        if missing:
            raise UserError(f"add-rented needs {', '.join(missing)}: {RENTED_EXAMPLE}")
        row = {"name": args.key, "gpu": args.gpu, "gpus": args.count, "price_per_gpu_hour": args.price_per_gpu_hour,
               "currency": args.currency}  # fmt: skip
        try:
            kept.append(check_rented_machine(row))
        except ValueError as e:
            raise UserError(str(e)) from None
    settings.rented_machines = kept
    settings.save()


def _apply_to_engine(args: argparse.Namespace) -> tuple[dict[str, Any] | None, str | None]:
    """Ask a running engine to act on the saved settings now: (its answer, None) or (None, why it refused)."""
    from rigpilot.engine.api.client import EngineError, EngineUnavailable

    client = _running_engine(argparse.Namespace())
    if client is None:
        return None, None
    try:
        with client:
            return client.request("reload_machine"), None
    except (OSError, EngineUnavailable):
        return None, None  # it stopped in between: the next one starts on the saved settings
    except EngineError as e:
        return None, str(e)


def cmd_engine_env(args: argparse.Namespace) -> int:
    from rigpilot.engine import provision, runtime
    from rigpilot.engine.userdata import human_size

    progress = (lambda line: print(json.dumps({"progress": line}), flush=True)) if args.json else print
    if args.action == "wheels":
        folder = (args.find_links or [Path("rigpilot-wheels")])[0]
        commands = provision.wheels_commands(folder=folder, torch_backend=args.torch_backend, base_python=args.python)
        if args.json:
            _print_json("rigpilot.engine-env-wheels/1", {"folder": str(folder.expanduser().absolute()), "commands": commands})
        else:
            print(f"On a machine with internet access, fetch the wheels into {folder}, copy it here, then run "
                  f"'rigpilot engine-env install --offline --find-links {folder}':")  # fmt: skip
            print("\n".join(commands))
        return 0
    if args.action == "remove":
        removed = provision.remove(progress=progress)
        if args.json:
            _print_json("rigpilot.engine-env-removed/1", {"removed": [{"path": str(p), "bytes": n} for p, n in removed]})
        elif not removed:
            print("no engine environment to remove")
        else:
            print(f"removed the engine environment and its cache ({human_size(sum(n for _, n in removed))})")
        return 0
    if args.action in ("install", "repair"):
        fn = provision.install if args.action == "install" else provision.repair
        fn(torch_backend=args.torch_backend, torch_version=args.torch_version, wheel=args.wheel,
           find_links=args.find_links, index_url=args.index_url, base_python=args.python, offline=args.offline,
           progress=progress)  # fmt: skip
    machine, _ = _machine(argparse.Namespace())
    caps = [] if machine.simulated else [g.compute_capability for g in machine.gpus if g.compute_capability]
    st = runtime.status(caps)
    if args.json:
        _print_json("rigpilot.engine-env/1", st.to_dict())
    else:
        if st.installed:
            build = f"CUDA {st.cuda_version}" if st.cuda_version else "CPU build"
            print(f"engine environment: {st.python}: torch {st.torch_version} ({build})")
            vllm = f"vLLM {st.vllm_version}" if st.vllm_version else "no vLLM"
            print(f"inference backends: transformers (Rigpilot's own), {vllm}")
        for p in st.problems:
            print(f"problem: {p}")
    return 0 if st.installed and not st.problems else 1


def cmd_forget(args: argparse.Namespace) -> int:
    import getpass

    from rigpilot.engine import userdata

    items = userdata.plan()
    if not items:
        print("Rigpilot keeps nothing for you on this machine: nothing to delete")
        return 0
    blockers = userdata.blockers()
    if blockers:
        raise UserError("; ".join(blockers))
    width = max(len(str(i.path)) for i in items)
    print(f"This deletes everything Rigpilot keeps for {getpass.getuser()}:")
    for i in items:
        if i.link_to is not None:
            print(f"  {i.path!s:<{width}}  {'link':>9}  a link to {i.link_to}: the link goes, what it points to stays")
        else:
            print(f"  {i.path!s:<{width}}  {userdata.human_size(i.size):>9}  {i.what}")
    pid = userdata.engine_pid()
    print(f"Total {userdata.human_size(userdata.total_size(items))}."
          + (f" Your engine service (pid {pid}) is stopped first." if pid is not None else "")
          + " Links inside these folders are removed, not followed: your own datasets and models elsewhere stay."
          + " Rigpilot itself stays installed.")  # fmt: skip
    if not args.yes:
        if not sys.stdin.isatty():
            raise UserError("nothing deleted: there is no terminal to ask on; run 'rigpilot forget --yes' to delete")
        try:
            answer = input("Delete all of this? [y/N] ")
        except EOFError:
            answer = ""
        if answer.strip().lower() not in ("y", "yes"):
            print("nothing deleted")
            return 1
    userdata.stop_engine()
    had_unit = bool(userdata.systemd_files())
    items = userdata.plan()  # again: the engine may have written while it stopped
    for i in items:
        try:
            userdata.delete(i.path)
        except OSError as e:
            raise UserError(f"could not delete all of {i.path} ({e.filename}: {e.strerror})") from None
    if had_unit:
        userdata.reload_systemd()
    print(f"deleted: {userdata.human_size(userdata.total_size(items))} freed")
    return 0


# The options that take a model, data or prompts path: where the README's `examples/…` paths appear.
# The options that may name a shipped example: argparse's dests, which for a declared setting are its field names.
EXAMPLE_OPTIONS = ("model", TRAIN_SETTINGS["dataset"].name, INFER_SETTINGS["prompts_file"].name)


def _use_shipped_examples(args: argparse.Namespace) -> None:
    """`examples/…` paths this folder lacks become the shipped examples' paths, one line each (engine/examples.py)."""
    try:
        cwd = os.getcwd()
    except OSError:  # the folder was deleted under the shell: the command says what it cannot find
        return
    for dest in EXAMPLE_OPTIONS:
        value = getattr(args, dest, None)
        if not value:
            continue
        given = value if isinstance(value, list) else [value]
        used = [shipped_example(v, cwd) if isinstance(v, str) else None for v in given]
        for text, path in zip(given, used, strict=True):
            if path is not None:
                print(examples_note(text, path), file=sys.stderr)
        resolved = [str(path) if path is not None else text for text, path in zip(given, used, strict=True)]
        setattr(args, dest, resolved if isinstance(value, list) else resolved[0])


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    args = parser.parse_args(argv)
    for option, given in (("--self-test", args.self_test), ("--screenshots", args.screenshots)):
        if given is not None:  # the launcher takes them only as the first word
            print(f"rigpilot: error: {option} comes first, on its own: rigpilot {option} "
                  f"{'[DIR]' if option == '--self-test' else 'DIR'}", file=sys.stderr)  # fmt: skip
            return EXIT_USAGE
    func: Callable[[argparse.Namespace], int] | None = getattr(args, "func", None)
    if func is None:
        parser.print_help()
        return EXIT_USAGE
    _use_shipped_examples(args)
    args.machine_factory = lambda: _machine(args)[0]
    if not (getattr(args, "simulate", None) or getattr(args, "import_paths", None)):
        args.stored_calibration = _stored_calibration
        args.stored_doctor = _stored_doctor
    try:
        return func(args)
    except UserError as e:
        print(f"rigpilot: error: {refusals.words(e)}", file=sys.stderr)
        return EXIT_USAGE
    except BrokenPipeError:
        # `rigpilot gpus | head` closes the pipe early; that is not an error.
        sys.stderr.close()
        return 0


if __name__ == "__main__":
    sys.exit(main())
