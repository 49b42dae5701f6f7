#!/usr/bin/env python3
"""Write rigpilot(1) from the command line's own argparse parsers.

    python3 packaging/manpage.py --out rigpilot.1     # Rigpilot and its dependencies importable

The page is generated, never edited, so it cannot drift from `rigpilot --help`:
every command, nested command (`run train`), option, choice and default comes
from `rigpilot.engine.cli.entry.build_parser()`, the options the launcher acts on
before argparse (the self-test, the screenshots) included.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import re
import sys
from pathlib import Path

DESCRIPTION = """\
Rigpilot detects the GPUs of a workstation and how they are wired (NVLink, PCIe
switches, CPU sockets), recommends how to split a model across them, and runs
training, fine-tuning and sharded-inference jobs under that plan in a
background PyTorch engine.

Without a command, \\fBrigpilot\\fR opens the desktop app. With one, it is the
command line: every data command takes \\fB\\-\\-simulate\\fR \\fIPROFILE\\fR and
\\fB\\-\\-import\\fR \\fIFILE\\fR, prints JSON with \\fB\\-\\-json\\fR, and a mistake
in the arguments prints one line and exits 2."""

TAIL = r"""
.SH FILES
.TP
.I ~/.config/rigpilot/
settings
.TP
.I ~/.local/state/rigpilot/
job records, logs, metrics, checkpoints, telemetry history
.TP
.I ~/.local/share/rigpilot/engine-env/
the per-user PyTorch engine environment (\fBrigpilot engine-env\fR)
.TP
.I /usr/lib/systemd/user/rigpilot-engine.service
a systemd user unit that keeps the engine service running
.PP
The XDG_CONFIG_HOME, XDG_STATE_HOME, XDG_DATA_HOME and XDG_CACHE_HOME
variables move these folders. Removing the package leaves them to each user:
\fBrigpilot forget\fR and \fBrigpilot engine\-env remove\fR delete them.
.SH EXIT STATUS
0 on success, 2 for a mistake in the arguments or another error Rigpilot can
explain in one line, 1 otherwise.
.SH SEE ALSO
.BR nvidia\-smi (1),
.BR torchrun (1),
.I /usr/share/doc/rigpilot/README.Debian
"""


def roff(text: str) -> str:
    """Plain text as roff: backslashes, minus signs and non-ASCII characters escaped."""
    text = text.replace("\\", "\\e").replace("-", "\\-")
    return "".join(ch if ord(ch) < 128 else f"\\[u{ord(ch):04X}]" for ch in text)


def line(text: str) -> str:
    """A roff text line: one starting with a period or an apostrophe would be read as a request."""
    return "\\&" + text if text[:1] in (".", "'") else text


def _metavar(action: argparse.Action) -> str:
    if action.metavar is not None:
        return action.metavar if isinstance(action.metavar, str) else " ".join(action.metavar)
    if action.choices is not None:
        return "{" + ",".join(str(c) for c in action.choices) + "}"
    return action.dest.upper()


def _takes_value(action: argparse.Action) -> bool:
    return action.nargs != 0


def _help(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    if not action.help:
        return ""
    # argparse's own expansion of %(default)s, %(choices)s and friends, as --help shows them.
    return parser._get_formatter()._expand_help(action)


def _option_label(action: argparse.Action) -> str:
    names = ", ".join(f"\\fB{roff(s)}\\fR" for s in action.option_strings)
    if _takes_value(action):
        value = f"\\fI{roff(_metavar(action))}\\fR"
        names += f" [{value}]" if action.nargs == "?" else f" {value}"
    return names


def _positional_label(action: argparse.Action) -> str:
    return f"\\fI{roff(_metavar(action))}\\fR"


def _synopsis(path: list[str], parser: argparse.ArgumentParser) -> str:
    parts = [f"\\fB{roff(' '.join(path))}\\fR"]
    visible = [a for a in parser._actions if a.help != argparse.SUPPRESS and not isinstance(a, argparse._HelpAction)]
    if any(a.option_strings for a in visible):
        parts.append("[\\fIOPTIONS\\fR]")
    for a in visible:
        if isinstance(a, argparse._SubParsersAction):
            parts.append(f"\\fI{roff(_metavar(a))}\\fR ...")
        elif not a.option_strings:
            parts.append(_positional_label(a))
    return " ".join(parts)


def _subparsers(parser: argparse.ArgumentParser) -> list[tuple[str, str, argparse.ArgumentParser, list[str]]]:
    """(name, help, parser, aliases) of each subcommand; an alias is the same parser under another name."""
    out: list[tuple[str, str, argparse.ArgumentParser, list[str]]] = []
    for a in parser._actions:
        if isinstance(a, argparse._SubParsersAction):
            helps = {c.dest: c.help or "" for c in a._choices_actions}
            first: dict[int, list[str]] = {}
            for name, sub in a.choices.items():
                if id(sub) in first:
                    first[id(sub)].append(name)
                    continue
                first[id(sub)] = []
                out.append((name, helps.get(name, ""), sub, first[id(sub)]))
    return out


def _options(parser: argparse.ArgumentParser) -> list[str]:
    out = []
    for group in parser._action_groups:
        actions = [
            a for a in group._group_actions
            if a.help != argparse.SUPPRESS and not isinstance(a, (argparse._HelpAction, argparse._SubParsersAction))
        ]  # fmt: skip
        if not actions:
            continue
        if group.title not in ("positional arguments", "options", "optional arguments"):
            out.append(".PP")
            out.append(f"\\fI{roff(group.title)}\\fR:")
        for a in actions:
            out.append(".TP")
            out.append(_option_label(a) if a.option_strings else _positional_label(a))
            out.append(line(roff(_help(parser, a))) if a.help else "\\&")
    return out


def _command(path: list[str], help_text: str, parser: argparse.ArgumentParser) -> list[str]:
    out = [f'.SS "{roff(" ".join(path))}"', line(roff(help_text[:1].upper() + help_text[1:] + "."))]
    if parser.description and parser.description != help_text:
        out += [".PP", line(roff(parser.description))]
    out += [".PP", _synopsis(path, parser)]
    out += [".RS", *(_options(parser) or [".PP", "No options."]), ".RE"]
    for name, sub_help, sub, aliases in _subparsers(parser):
        out += _command([*path, name], sub_help, sub) + _aliases(path, name, aliases)
    return out


def _aliases(path: list[str], name: str, aliases: list[str]) -> list[str]:
    out = []
    for alias in aliases:
        out += [f'.SS "{roff(" ".join([*path, alias]))}"', line(roff(f"The same as {' '.join([*path, name])}."))]
    return out


def _app_options(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    """The options app/launcher.py acts on (the self-test, the screenshots): one synopsis line each."""
    from rigpilot.engine.cli.entry import APP_OPTIONS_TITLE

    return [a for g in parser._action_groups if g.title == APP_OPTIONS_TITLE for a in g._group_actions]


def render(parser: argparse.ArgumentParser, version: str, date: dt.date) -> str:
    prog = parser.prog
    out = [
        f'.TH {prog.upper()} 1 "{date.isoformat()}" "{prog} {version}" "User Commands"',
        ".SH NAME",
        f"{prog} \\- {roff((parser.description or '').rstrip('.')[:1].lower() + (parser.description or '').rstrip('.')[1:])}",
        ".SH SYNOPSIS",
        f"\\fB{prog}\\fR",
        ".br",
        f"\\fB{prog}\\fR \\fICOMMAND\\fR [\\fIOPTIONS\\fR]",
    ]
    for a in _app_options(parser):
        dots = f"[\\fI{roff(_metavar(a))}\\fR]" if a.nargs == "?" else f"\\fI{roff(_metavar(a))}\\fR"
        out += [".br", f"\\fB{prog} {roff(a.option_strings[0])}\\fR {dots}"]
    out += [".SH DESCRIPTION", *DESCRIPTION.splitlines()]
    out = [x if x else ".PP" for x in out]
    out += [".SH OPTIONS"]
    out += [o for o in _options(parser)]
    out += [".SH COMMANDS"]
    for name, help_text, sub, aliases in _subparsers(parser):
        out += _command([prog, name], help_text, sub) + _aliases([prog], name, aliases)
    return "\n".join(out) + "\n" + TAIL.lstrip("\n")


def _build_date() -> dt.date:
    # Reproducible builds: the date of the source, not of the build.
    epoch = os.environ.get("SOURCE_DATE_EPOCH")
    return dt.datetime.fromtimestamp(int(epoch), dt.UTC).date() if epoch else dt.date.today()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="where to write the page (roff source)")
    args = ap.parse_args()
    os.environ["COLUMNS"] = "80"
    from rigpilot.engine import __version__
    from rigpilot.engine.cli.entry import build_parser

    text = render(build_parser(), __version__, _build_date())
    if re.search(r"[^\x00-\x7f]", text):
        raise SystemExit("manpage: non-ASCII text left in the page")
    args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
