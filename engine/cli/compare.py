"""`rigpilot compare-models JOB`: did fine-tuning help? The base model's and the tuned model's completions of the
user's own prompts side by side, greedy unless told, and the job's held-out loss and perplexity.

How they are made (one serve job per comparison for a LoRA job, prompts batched) is engine.cli.comparison's,
which the app's "Compare with base model" runs too.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from rigpilot.engine.cli.comparison import DEFAULT_MAX_TOKENS, compare_models, held_out_line
from rigpilot.engine.errors import UserError
from rigpilot.engine.jobspec.spec import SERVE_SETTINGS
from rigpilot.engine.schema import add_option
from rigpilot.engine.terminal import printable


def register(sub: Any, js: argparse.ArgumentParser) -> None:
    p = sub.add_parser(
        "compare-models", parents=[js], help="a finished training job's model beside its base, on your prompts",
        description="rigpilot compare-models JOB: the base model's and the tuned model's completions of each "
        "prompt side by side (greedy unless --temperature), served by the engine on the first GPU (a CPU rank "
        "on a simulated machine), and the job's held-out loss and perplexity where it measured them.",
    )  # fmt: skip
    p.add_argument("job", metavar="JOB", help="a finished training job (id, unique prefix or name)")
    p.add_argument("--base", metavar="MODEL", help="the base model to compare with (default: the one the job "
                   "trained from)")  # fmt: skip
    p.add_argument("--prompts", metavar="FILE", help='a JSONL file of {"prompt": ...} records')
    p.add_argument("--prompt", action="append", default=[], metavar="TEXT", help="a prompt; repeatable")
    p.add_argument("--max-tokens", type=_positive, default=DEFAULT_MAX_TOKENS, metavar="N",
                   help=f"new tokens per completion at most (default {DEFAULT_MAX_TOKENS})")  # fmt: skip
    p.add_argument("--temperature", type=float, default=0.0, metavar="T", help="0 (the default): greedy")
    add_option(p, SERVE_SETTINGS["precision"], help="the weights' dtype (default: the job's training precision)")
    p.set_defaults(func=cmd_compare)


def _positive(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"a whole number of tokens of at least 1, not {text!r}")
    return n


def cmd_compare(args: argparse.Namespace) -> int:
    from rigpilot.engine.api.client import EngineClient
    from rigpilot.engine.cli.commands import print_notice
    from rigpilot.engine.workers.prompts import read_prompts

    if not args.prompts and not args.prompt:
        raise UserError("compare on what? give --prompt TEXT (repeatable) or --prompts FILE (JSONL with a "
                        '"prompt" field)', reason="no_prompts")  # fmt: skip
    prompts = read_prompts(args.prompts, args.prompt)
    with EngineClient(on_notice=print_notice) as client:
        doc = compare_models(client, args.job, prompts, base=args.base, max_tokens=args.max_tokens,
                             temperature=args.temperature, precision=args.precision)  # fmt: skip
    if args.json:
        print(json.dumps(doc))
        return 0
    print("\n".join(comparison_lines(doc)))
    return 0


def comparison_lines(doc: dict[str, Any]) -> list[str]:
    """The terminal's side by side: the job and its held-out figures, then per prompt both completions, each
    made safe to print (a model's text may hold control characters)."""
    lines = [f"job {doc['job']} ({printable(str(doc.get('name') or ''))}): {doc['method']} of "
             f"{printable(doc['base_model'])}", f"  {held_out_line(doc.get('held_out'))}"]  # fmt: skip
    for row in doc["results"]:
        lines += ["", f"prompt: {printable(row['prompt'])}", f"  base:  {printable(row['base'])}",
                  f"  tuned: {printable(row['tuned'])}"]  # fmt: skip
    return lines
