"""The engine service's own command line: `python -m rigpilot.engine.service` (what clients and the systemd
unit start) and the options `rigpilot engine` shares with it. Below the CLI, so the service starts without it."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from rigpilot.engine.argtypes import positive_int
from rigpilot.engine.errors import UserError

if TYPE_CHECKING:  # the server is imported when the service starts, not when the CLI parses its arguments
    from rigpilot.engine.service.server import ServiceOptions


def add_service_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tcp", metavar="ADDR:PORT", help="also accept remote clients here, over TLS with a token login (ADDR defaults to 127.0.0.1)")
    p.add_argument("--simulate", metavar="PROFILE", help="run on a simulated machine")
    p.add_argument("--grace", type=float, default=30.0, metavar="SECONDS", help="cancel: time to checkpoint before SIGKILL (default 30)")
    p.add_argument("--failure-grace", type=float, default=5.0, metavar="SECONDS", help="after a rank fails: time before the rest are killed (default 5)")
    p.add_argument("--telemetry-period", type=float, default=1.0, metavar="SECONDS", help="telemetry sampling period (default 1)")
    p.add_argument("--max-cpu-ranks", type=positive_int, metavar="N", help="ranks per job on a simulated machine (default: setting, else 4; at most the CPU count)")  # fmt: skip


def service_options(args: argparse.Namespace) -> ServiceOptions:
    """The service's options from its parsed arguments; a bad period or grace time is refused in one line."""
    from rigpilot.engine.service.server import ServiceOptions

    if args.telemetry_period <= 0 or args.grace < 0 or args.failure_grace < 0:
        raise UserError("periods and grace times must be positive")
    return ServiceOptions(
        tcp=args.tcp, simulate=args.simulate, telemetry_period=args.telemetry_period, grace_s=args.grace,
        failure_grace_s=args.failure_grace, max_cpu_ranks=args.max_cpu_ranks,
    )  # fmt: skip


def main_service(argv: list[str]) -> int:
    """`python -m rigpilot.engine.service`: what clients and the systemd unit start."""
    p = argparse.ArgumentParser(prog="python -m rigpilot.engine.service")
    add_service_arguments(p)
    p.add_argument("--background", action="store_true", help="exit quietly when a service already runs")
    args = p.parse_args(argv)
    from rigpilot.engine.service.server import run_service

    try:
        return run_service(service_options(args), quiet_if_running=args.background)
    except UserError as e:
        print(f"rigpilot engine: error: {e}", file=sys.stderr)
        return 2
