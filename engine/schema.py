"""Each job setting declared once, and everything generated from that declaration.

A setting is a field of a spec dataclass (engine.jobspec.spec) declared with `setting(...)`: its default, its
allowed values (a `Range` or a `Choice`), its command-line flags, the label the app shows, one sentence of
help and its unit. From that one declaration come the `rigpilot run` options (`add_options`, `given`), the
engine's refusal of a value outside its range (`Setting.check`, the same sentence on the command line and in
the engine), the socket's bounds (a `Setting` is an `Annotated` limit in engine.api.protocol) and the
app's words (labels, tooltips, the command preview). The model is torchtitan's ConfigManager: one dataclass,
the CLI built from it, so flags, defaults, ranges and help cannot drift apart.

The enumerations of values that travel on the wire and in job.json (precision, method, job state ...) are
owned here too, as StrEnums whose values are those strings.

No Qt and no torch: the app imports this module.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, get_type_hints

from rigpilot.engine.errors import UserError


class Precision(StrEnum):
    """Training: the mixed-precision compute dtype; inference: the weights' dtype."""

    FP32 = "fp32"
    BF16 = "bf16"
    FP16 = "fp16"


class MasterWeights(StrEnum):
    """The dtype training keeps its weights, gradients and optimizer state in."""

    FP32 = "fp32"  # fp32 master weights under mixed-precision compute (the default)
    BF16 = "bf16"  # everything in bf16, torchtune's everyday recipe: about half the memory per parameter


class Optimizer(StrEnum):
    """The optimizer a training job steps with."""

    ADAMW = "adamw"  # torch.optim.AdamW (fused or foreach as the device allows)
    ADAMW8BIT = "adamw8bit"  # torchao's AdamW8bit: both moments block-quantized to 8 bits


class TrainMethod(StrEnum):
    FULL = "full"
    LORA = "lora"
    QLORA = "qlora"  # LoRA on a 4-bit NF4 base
    SCRATCH = "scratch"  # a fresh model from a config.json


ADAPTER_METHODS = (TrainMethod.LORA, TrainMethod.QLORA)  # train adapters on a frozen base
FINE_TUNE_METHODS = (TrainMethod.FULL, *ADAPTER_METHODS)  # from pretrained weights: all but scratch


class Checkpointing(StrEnum):
    """Activation checkpointing, in order of memory saved."""

    NONE = "none"
    SELECTIVE = "selective"
    FULL = "full"


class InferBackend(StrEnum):
    AUTO = "auto"  # the submission replaces it with the backend it chose
    TRANSFORMERS = "transformers"  # Rigpilot's own generator
    VLLM = "vllm"


class JobState(StrEnum):
    QUEUED = "queued"
    STARTING = "starting"
    RUNNING = "running"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"
    INTERRUPTED = "interrupted"


ACTIVE_STATES = (JobState.STARTING, JobState.RUNNING)  # ranks are (being) started
UNFINISHED_STATES = (JobState.QUEUED, *ACTIVE_STATES)
UNSUCCESSFUL_STATES = (JobState.FAILED, JobState.CANCELLED, JobState.INTERRUPTED)  # ended; resumable
TERMINAL_STATES = (JobState.COMPLETED, *UNSUCCESSFUL_STATES)


def _num(v: float) -> str:
    if v == int(v) and abs(v) >= 10**6:
        return f"{int(v):,}"
    return f"{v:g}"


@dataclass(frozen=True)
class Range:
    """The allowed values of a number: [lo, hi], either end open when said."""

    lo: float
    hi: float
    hi_open: bool = False  # [lo, hi) rather than [lo, hi]
    lo_open: bool = False  # (lo, hi]

    def holds(self, v: float) -> bool:
        above = v > self.lo if self.lo_open else v >= self.lo
        below = v < self.hi if self.hi_open else v <= self.hi
        return above and below

    def text(self) -> str:
        left = "(" if self.lo_open else "["
        right = ")" if self.hi_open else "]"
        return f"in {left}{_num(self.lo)}, {_num(self.hi)}{right}"

    def problem(self, value: Any) -> str | None:
        """For the socket's `Annotated` checks (engine.api.protocol): why `value` is refused, or None."""
        if isinstance(value, int | float) and not isinstance(value, bool) and not self.holds(value):
            return f"{self.text()}, got {_shown(value)}"
        return None


@dataclass(frozen=True)
class Choice:
    options: tuple[str, ...]

    def holds(self, v: Any) -> bool:
        return v in self.options

    def text(self) -> str:
        return "one of " + ", ".join(self.options)

    def problem(self, value: Any) -> str | None:
        return None if not isinstance(value, str) or self.holds(value) else f"({self.text()}), got {_shown(value)}"


def _shown(value: Any) -> str:
    if isinstance(value, str):
        return repr(value[:60])
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10**12:
        return f"{value:.3g}"
    return str(value)


@dataclass(frozen=True)
class Setting:
    """One setting's declaration; `key`, `default` and `type` are filled in from the field it sits on."""

    label: str  # the app's words for it ("Micro-batch")
    help: str  # one sentence, the app's tooltip and the CLI's help, without the default (added from `default`)
    flags: tuple[str, ...] = ()  # its command-line flags, the first the one shown; none: not on the command line
    bound: Range | Choice | None = None
    unit: str = ""  # "tokens", "steps" ... ("" where it has none)
    metavar: str | None = None
    default_words: str | None = None  # how the help names the default where its value alone would not say
    zero_words: str | None = None  # what 0 means where it means something else ("never", "all")
    parse: Callable[[str], Any] | None = None  # the command line's reading of a value of its own form
    choice_words: tuple[tuple[str, str], ...] = ()  # the app's words for a choice ("qlora": "QLoRA (4-bit base)")
    key: str = ""  # "train.micro_batch", "max_restarts"
    default: Any = None
    type: Any = None  # the field's annotation
    # value -> {other setting's name: the value it must then have}; checked on the whole group (`check_group`)
    requires: tuple[tuple[str, tuple[tuple[str, str], ...]], ...] = ()
    # A training-recipe setting the planner's search may choose where the user leaves it open (its ladder,
    # engine.planner.recipes.LADDER); one it never chooses stays at its default unless asked for.
    searched: bool = False

    @property
    def name(self) -> str:
        return self.key.rpartition(".")[2]

    @property
    def flag(self) -> str | None:
        return self.flags[0] if self.flags else None

    @property
    def lo(self) -> float:
        """The smallest value a number setting allows."""
        if not isinstance(self.bound, Range):
            raise TypeError(f"{self.key} is not a number with a range")
        return self.bound.lo

    @property
    def hi(self) -> float:
        """The largest value a number setting allows."""
        if not isinstance(self.bound, Range):
            raise TypeError(f"{self.key} is not a number with a range")
        return self.bound.hi

    @property
    def choices(self) -> tuple[str, ...] | None:
        return self.bound.options if isinstance(self.bound, Choice) else None

    def choice_word(self, value: Any) -> str:
        """The app's words for one of its choices (the value itself where none are declared)."""
        return dict(self.choice_words).get(str(value), str(value))

    def problem(self, value: Any) -> str | None:
        """The socket's check of a request argument that is this setting (engine.api.protocol)."""
        return self.bound.problem(value) if self.bound is not None else None

    def refusal(self, value: Any) -> UserError | None:
        """The one-line refusal of `value`, or None where it is allowed (None is: the default applies)."""
        if value is None or self.bound is None:
            return None
        if isinstance(self.bound, Range) and (isinstance(value, bool) or not isinstance(value, int | float)):
            return None  # type checks are the protocol's; a bool here is already refused there
        if self.bound.holds(value):
            return None
        where = self.key.replace(".", " setting ", 1)
        text = f"{where}={_shown(value)}: must be {self.bound.text()}"
        if isinstance(self.bound, Range):
            return UserError(text, reason="out_of_range", setting=self.key, value=value,
                             lo=self.bound.lo, hi=self.bound.hi)  # fmt: skip
        return UserError(text, reason="not_a_choice", setting=self.key, value=value, choices=list(self.bound.options))

    def check(self, value: Any) -> None:
        error = self.refusal(value)
        if error is not None:
            raise error

    def conflict(self, values: Any) -> UserError | None:
        """The refusal of this setting's value in `values` (the dataclass it sits on) where another setting of
        that group contradicts it (`requires`), else None."""
        mine = getattr(values, self.name, None)
        for value, needs in self.requires:
            if str(mine) != value:  # declared values are strings: a bool's is "True"
                continue
            for other, wanted in needs:
                theirs = getattr(values, other, None)
                if theirs != wanted:
                    given = (self.name if mine else f"without {self.name}") if _is_bool(self) else f"{self.name}={mine}"
                    return UserError(
                        f"{given} needs {other}={wanted} (it is {theirs})",
                        reason="conflicting_settings", setting=self.key, value=mine,
                        other=self.key[: len(self.key) - len(self.name)] + other, needs=wanted, found=theirs,
                    )  # fmt: skip
        return None

    def help_text(self) -> str:
        """The help line: the sentence, then the default where a value has one worth naming."""
        shown = self.default_words
        if shown is None and self.default is not None and not isinstance(self.default, bool | list):
            shown = _num(self.default) if isinstance(self.default, int | float) else str(self.default)
        return f"{self.help.rstrip('.')} (default {shown})." if shown else self.help


def setting(default: Any = dataclasses.MISSING, *, default_factory: Any = dataclasses.MISSING,
            label: str, help: str, flags: tuple[str, ...] | str = (), range: Range | None = None,
            choices: type[StrEnum] | tuple[str, ...] | None = None, unit: str = "", metavar: str | None = None,
            default_words: str | None = None, zero_words: str | None = None,
            parse: Callable[[str], Any] | None = None, requires: dict[str, dict[str, str]] | None = None,
            choice_words: Mapping[str, str] | None = None, searched: bool = False) -> Any:  # fmt: skip
    """A dataclass field declared as a setting (see `Setting`): the one place its facts are written."""
    bound: Range | Choice | None = range
    if isinstance(default, StrEnum):
        default = default.value  # job.json and the wire carry the plain string
    if choices is not None:
        bound = Choice(tuple(str(c) for c in choices))
    decl = Setting(label=label, help=help, flags=(flags,) if isinstance(flags, str) else tuple(flags), bound=bound,
                   unit=unit, metavar=metavar, default_words=default_words, zero_words=zero_words, parse=parse,
                   requires=tuple((str(v), tuple((k, str(w)) for k, w in needs.items()))
                                  for v, needs in (requires or {}).items()),
                   choice_words=tuple((str(k), v) for k, v in (choice_words or {}).items()),
                   searched=searched)  # fmt: skip
    if default_factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=default_factory, metadata={"setting": decl})
    return dataclasses.field(default=default, metadata={"setting": decl})


def declared(cls: type, section: str = "") -> dict[str, Setting]:
    """The settings declared on dataclass `cls`, by field name, with key ("section.name"), default and type."""
    hints = get_type_hints(cls)
    out: dict[str, Setting] = {}
    for f in dataclasses.fields(cls):
        decl = f.metadata.get("setting")
        if decl is None:
            continue
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        key = f"{section}.{f.name}" if section else f.name
        out[f.name] = dataclasses.replace(decl, key=key, default=default, type=hints[f.name])
    return out


# -- the command line ------------------------------------------------------------------------------------


def _is_list(s: Setting) -> bool:
    return "list[" in str(s.type)


def _is_bool(s: Setting) -> bool:
    return s.type is bool


def _number_kind(s: Setting) -> type | None:
    text = str(s.type)
    if "float" in text:
        return float
    if "int" in text and not _is_list(s):
        return int
    return None


def _reader(s: Setting) -> Callable[[str], Any]:
    """argparse's `type` for a number setting: read it, then refuse it outside its range in the engine's words."""
    kind = _number_kind(s)

    def read(text: str) -> Any:
        try:
            value = kind(text) if kind is not None else text
        except ValueError:
            word = "a whole number" if kind is int else "a number"
            raise argparse.ArgumentTypeError(f"not {word}: {text!r}") from None
        if isinstance(value, float) and not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"must be a finite number, not {text!r}")
        error = s.refusal(value)
        if error is not None:
            raise argparse.ArgumentTypeError(str(error))
        return value

    read.__name__ = s.name  # argparse names the type in its "invalid <name> value" fallback
    return read


def add_option(parser: argparse.ArgumentParser | Any, s: Setting, *, help: str | None = None) -> None:
    """The command-line option of setting `s` (dest: its field name; None when not given)."""
    if not s.flags:
        raise ValueError(f"{s.key} has no command-line flag")
    kw: dict[str, Any] = {"dest": s.name, "help": help or s.help_text()}
    if _is_bool(s):
        kw.update(action="store_true", default=None)
    else:
        if s.parse is not None and isinstance(s.bound, Choice):
            # Another spelling read as its choice (`--pp-schedule gpipe`), then held to the choices like the rest.
            kw.update(choices=s.bound.options, type=s.parse)
        elif s.parse is not None:
            kw["type"] = s.parse  # one word read whole (`--gpus 0,1`), not a repeated flag
        elif isinstance(s.bound, Choice):
            kw.update(choices=s.bound.options, type=_reader(s))  # a wrong one refused in the engine's words
        elif _number_kind(s) is not None:
            kw["type"] = _reader(s)
        elif _is_list(s):
            kw.update(action="append", default=[])
        kw["metavar"] = s.metavar
    parser.add_argument(*s.flags, **kw)


def add_options(parser: argparse.ArgumentParser | Any, settings: dict[str, Setting]) -> None:
    for s in settings.values():
        if s.flags:
            add_option(parser, s)


def given(args: argparse.Namespace, settings: dict[str, Setting]) -> dict[str, Any]:
    """The values of `settings` the command line was given (a flag left out: the engine's default applies)."""
    out = {}
    for name, s in settings.items():
        if not s.flags:
            continue
        value = getattr(args, s.name, None)
        if value is None or value is False or value == "" or (value == [] and s.parse is None):
            continue  # left out (a repeatable flag never given is an empty list)
        out[name] = value
    return out


def flag_words(s: Setting, value: Any) -> list[str] | None:
    """`value` as the command line writes it for setting `s`: [flag, text], [flag] or [] (a false switch or
    an empty list); None where the command line cannot say it (no flag, or a value its choices lack)."""
    if not s.flags:
        return None
    if _is_bool(s):
        return [s.flags[0]] if value else []
    if _is_list(s) and s.parse is not None:  # one word: `--gpus 0,1`
        return [s.flags[0], ",".join(map(str, value))] if value else []
    if _is_list(s):
        return [w for item in value or [] for w in (s.flags[0], str(item))]
    if value is None:
        return []
    if isinstance(s.bound, Choice) and value not in s.bound.options:
        return None
    return [s.flags[0], command_text(value)]


def flag_phrase(s: Setting, value: Any) -> str:
    """Setting `s` given `value`, as a command line's sentence names it: "--seq 1024"; a switch by its flag
    alone ("--fp8"), or "without --fp8" where it is off (the flags are switches with no --no- form)."""
    if not s.flags:
        raise ValueError(f"{s.key or s.label} has no command-line flag to name it by")
    if _is_bool(s):
        on = value == "True" if isinstance(value, str) else bool(value)  # `requires` declares values as strings
        return s.flags[0] if on else f"without {s.flags[0]}"
    said = flag_words(s, value)
    return " ".join(said) if said else f"{s.flags[0]} {command_text(value)}"


def command_text(value: Any) -> str:
    """A scalar as typed on a command line: floats in full (repr: 3.14159265e-05 comes back unchanged)."""
    return repr(value) if isinstance(value, float) else str(value)


def shown_value(s: Setting, value: Any) -> str:
    """A value in the app's and the CLI's words: its unit after a number, lists joined."""
    if isinstance(value, list):
        return ", ".join(map(str, value))
    if isinstance(value, bool):
        return "on" if value else "off"
    if value == 0 and s.zero_words:
        return s.zero_words
    if isinstance(value, float):
        text = f"{value:g}"
    else:
        text = str(value)
    return f"{text} {s.unit}" if s.unit and isinstance(value, int | float) else text


def setting_words(s: Setting, value: Any) -> str:
    """ "Warmup: 10 steps": a setting and its value, as a note or a difference between jobs names it."""
    return f"{s.label}: {shown_value(s, value)}"


def check_group(values: Any, settings: dict[str, Setting]) -> None:
    """Each setting of `values` (a dataclass whose fields `settings` declares) in range, and none contradicting
    another: the one check the engine runs at submission and a rank runs again before its first step."""
    for name, decl in settings.items():
        decl.check(getattr(values, name))
    for decl in settings.values():
        error = decl.conflict(values)
        if error is not None:
            raise error


def iter_settings(*groups: dict[str, Setting]) -> Iterator[Setting]:
    for group in groups:
        yield from group.values()


# -- sentences that name settings ------------------------------------------------------------------------
# The planner's advice ("use sequences of 1024 tokens (--seq 1024)") names settings. It is written once, as a
# template with a slot per setting, and each client words the settings its own way from their declarations:
# the command line by flag, the app by the label of the control that sets it. Nobody rewrites the sentence.


class Style(StrEnum):
    """How a sentence names a setting."""

    CLI = "cli"  # its flag and value: "--seq 4096"
    APP = "app"  # its control's label and value: "Sequence length 4096"


@dataclass(frozen=True)
class Ref:
    """A setting a sentence names, by its name among the settings the sentence is worded from, with the value
    the sentence gives it (None: the setting itself, "--seq" or "Sequence length")."""

    setting: str
    value: Any = None

    def to_dict(self) -> dict[str, Any]:
        return {"setting": self.setting, "value": self.value}


_SLOT = re.compile(r"\{(\w+)\}")


class Words(str):
    """A sentence that names settings. As a str it is the command line's wording ("use --seq 1024");
    `template` and `refs` are what it is made of ("use {seq}", {"seq": Ref("seq_len", 1024)}), for a client
    that names settings its own way (`worded`). Made by `words`."""

    template: str
    refs: dict[str, Ref]

    def __new__(cls, text: str, template: str, refs: Mapping[str, Ref]) -> Words:
        self = super().__new__(cls, text)
        self.template = template
        self.refs = dict(refs)
        return self

    def __reduce__(self) -> tuple[Any, ...]:  # copy and deepcopy (dataclasses.asdict) keep the parts
        return (Words, (str(self), self.template, self.refs))

    def terms(self) -> dict[str, Any]:
        """The JSON form: {"template": "use {seq}", "refs": {"seq": {"setting": "seq_len", "value": 1024}}}."""
        return {"template": self.template, "refs": {k: r.to_dict() for k, r in self.refs.items()}}


def terms_of(text: str) -> dict[str, Any]:
    """The JSON form of any sentence: a plain one is a template that names no setting."""
    return text.terms() if isinstance(text, Words) else {"template": text, "refs": {}}


class _Slot:
    """A setting's slot, left in the template whatever format spec the template gives it."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __format__(self, spec: str) -> str:
        return "{" + self.name + "}"


def words(settings: Mapping[str, Setting], template: str, /, **slots: Any) -> Words:
    """`template` (str.format syntax) filled from `slots`: a `Ref` names one of `settings`, a `Words` is a
    sentence within this one (the settings it names stay named), anything else is plain text. The str of the
    result names the settings by flag; every setting named needs one."""
    refs: dict[str, Ref] = {name: v for name, v in slots.items() if isinstance(v, Ref)}
    filled: dict[str, Any] = {}
    for name, v in slots.items():
        if isinstance(v, Ref):
            filled[name] = _Slot(name)
        elif isinstance(v, Words):
            renamed: dict[str, str] = {}
            for slot, ref in v.refs.items():
                new, n = slot, 2
                while new in refs:
                    new, n = f"{slot}{n}", n + 1
                renamed[slot], refs[new] = new, ref
            filled[name] = _renamed(v.template, renamed)
        else:
            filled[name] = v
    filled_template = template.format_map(filled)
    return Words(_render(filled_template, refs, settings, Style.CLI), filled_template, refs)


def _renamed(template: str, names: Mapping[str, str]) -> str:
    return _SLOT.sub(lambda m: "{" + names.get(m[1], m[1]) + "}", template)


def named(s: Setting, value: Any, style: Style) -> str:
    """Setting `s` with `value` (None: the setting itself) as a sentence in `style` names it."""
    if style == Style.CLI:
        if not s.flags:
            raise ValueError(f"{s.key or s.label} has no command-line flag to name it by")
        if value is None or _is_bool(s):
            return s.flags[0]
        said = flag_words(s, value)
        return " ".join(said) if said else f"{s.flags[0]} {value}"
    if _is_bool(s):
        return f"“{s.label}”"  # a check box, named by its text
    if value is None:
        return s.label
    if s.choices is not None or s.choice_words:
        return f"{s.label} “{s.choice_word(value)}”"
    if isinstance(value, list):
        return f"{s.label} {', '.join(map(str, value))}"
    return f"{s.label} {value:g}" if isinstance(value, float) else f"{s.label} {value}"


def _render(template: str, refs: Mapping[str, Ref], settings: Mapping[str, Setting], style: Style) -> str:
    def one(m: re.Match[str]) -> str:
        ref = refs.get(m[1])
        return m[0] if ref is None else named(settings[ref.setting], ref.value, style)

    return _SLOT.sub(one, template)


def worded(text: str, terms: Any, settings: Mapping[str, Setting], style: Style = Style.APP) -> str:
    """A sentence in `style`, from its `terms` (`Words.terms`' JSON form); `text`, its command-line wording,
    where there are none or they name a setting `settings` lacks (a reply from an older or newer engine)."""
    if not isinstance(terms, Mapping) or not isinstance(terms.get("template"), str):
        return text
    try:
        refs = {slot: Ref(str(r["setting"]), r.get("value")) for slot, r in (terms.get("refs") or {}).items()}
        return _render(terms["template"], refs, settings, style)
    except (KeyError, TypeError, ValueError, AttributeError):
        return text
