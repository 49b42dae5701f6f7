"""The desktop app in a real X server, used as a person uses it: keys and clicks through the X server, pictures.

Xvfb (and openbox, where it is installed) start in a fixture on a display Xvfb picks itself; the engine
service and the app run as their own processes with their own XDG folders, on the default simulated machine
(4×RTX 4090). The app is started by tests/support/x11_app.py: `rigpilot`'s own start-up plus a probe that writes what
is on the screen (titles, texts, where each named widget is) to a file, so the test knows where to click;
every key and click still goes through the X server (XTEST, via xdotool). The flow:

Ctrl+N opens the job wizard; Ctrl+Enter walks it with its defaults (the shipped tiny example) and launches;
the job's loss, read back from the engine, falls; the finished job's Summary tab says how to load its model;
"Try it" runs one prompt on that model as an inference job and shows the engine's completion; Settings
switches the simulated machine to 8×H100 and the engine, the window title, the dashboard, the topology and
planner pages and `rigpilot gpus` all follow.

Screenshots go to tmp_path; with RIGPILOT_E2E_SHOTS=DIR the main ones are also kept there by name, which is
how docs/screenshots' flow pictures are made:

    RIGPILOT_E2E_SHOTS=docs/screenshots .venv/bin/python -m pytest -m slow tests/gui/test_gui_x11_e2e.py

It costs about a minute on a 2-core machine.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import pytest

from support.engine import leftover_job_processes
from support.paths import REPO
from support.waiting import wait_for

PROFILE = "4x-rtx4090"
SCREEN = "1400x900x24"
MAIN_TITLE = "Rigpilot — "  # the window's title once the engine said which machine it runs on
WIZARD_TITLE = "New job"
START_TIMEOUT_S = 60.0
JOB_TIMEOUT_S = 180.0

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(shutil.which("Xvfb") is None, reason="Xvfb is not installed (Debian: apt-get install xvfb)"),
    pytest.mark.skipif(
        shutil.which("xdotool") is None, reason="xdotool is not installed (Debian: apt-get install xdotool)"
    ),
]


@dataclass
class Desktop:
    """A display with a window manager, and the environment every process of the test shares."""

    display: str
    env: dict[str, str]
    tmp: Path
    shots: list[Path] = field(default_factory=list)
    processes: list[subprocess.Popen] = field(default_factory=list)
    engine: subprocess.Popen | None = None
    app: subprocess.Popen | None = None

    def run(self, *words: str, timeout: float = 20) -> subprocess.CompletedProcess:
        return subprocess.run(words, env=self.env, capture_output=True, text=True, timeout=timeout)

    def xdotool(self, *words: str) -> str:
        out = self.run("xdotool", *words)
        return out.stdout.strip() if out.returncode == 0 else ""

    def windows(self, name: str) -> list[str]:
        """Ids of the visible windows whose title matches the regular expression `name`."""
        return self.xdotool("search", "--onlyvisible", "--name", name).split()

    def press(self, window: str, keys: str) -> None:
        """Keys typed into `window` through XTEST, as a keyboard types them (XSendEvent is not used: Qt
        ignores synthetic events)."""
        self.xdotool("windowactivate", "--sync", window)
        self.xdotool("key", "--clearmodifiers", keys)

    def screenshot(self, name: str, window: str = "root", keep: bool = True) -> Path:
        """The screen (or one window, by id) as a PNG; kept under its own name in $RIGPILOT_E2E_SHOTS."""
        path = self.tmp / "shots" / f"{len(self.shots) + 1:02d}-{name}.png"
        path.parent.mkdir(exist_ok=True)
        out = self.run("import", "-window", window, str(path)) if shutil.which("import") else None
        if out is None or out.returncode != 0 or not path.is_file():
            return path  # ImageMagick missing or failing: the pictures are a record, not what is tested
        self.shots.append(path)
        folder = os.environ.get("RIGPILOT_E2E_SHOTS")
        if folder and keep:
            Path(folder).mkdir(parents=True, exist_ok=True)
            shutil.copy(path, Path(folder) / f"{name}.png")
        return path

    def probe(self) -> dict[str, Any]:
        """What the app's probe (tests/support/x11_app.py) last saw on the screen."""
        try:
            return json.loads((self.tmp / "probe.json").read_text())
        except (OSError, ValueError):
            return {"windows": [], "widgets": {}}

    def widget(self, name: str, timeout: float = 20, when: Callable[[dict[str, Any]], Any] = bool) -> dict[str, Any]:
        """The visible widget called `name` (its object name), once `when` holds for it."""

        def seen() -> dict[str, Any] | None:
            w = self.probe()["widgets"].get(name)
            return w if w is not None and when(w) else None

        return wait_for(seen, timeout, what=f"visible widget {name!r}")

    def click(self, rect: list[int]) -> None:
        """A left click in the middle of a screen rectangle [x, y, width, height], through XTEST."""
        x, y, w, h = rect
        self.xdotool("mousemove", "--sync", str(x + w // 2), str(y + h // 2))
        self.xdotool("click", "1")

    def type_text(self, text: str) -> None:
        self.xdotool("type", "--delay", "20", text)

    def engine_request(self, rtype: str, **args: Any) -> Any:
        from rigpilot.engine.api.client import EngineClient

        with EngineClient(autostart=False, timeout=10) as c:
            return c.request(rtype, **args)

    def rigpilot(self, *words: str, timeout: float = 60) -> subprocess.CompletedProcess:
        """The command line (`rigpilot WORDS`), with this desktop's engine."""
        return self.run(sys.executable, "-m", "rigpilot.app.launcher", *words, timeout=timeout)


def _start(desktop: Desktop, words: list[str], log_name: str, **kw: Any) -> subprocess.Popen:
    with (desktop.tmp / log_name).open("ab") as log:  # the child keeps its own copy of the descriptor
        proc = subprocess.Popen(words, env=desktop.env, stdin=subprocess.DEVNULL, stdout=log, stderr=log, **kw)
    desktop.processes.append(proc)
    return proc


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _stop_engine(proc: subprocess.Popen) -> None:
    from rigpilot.engine.api.client import EngineClient

    try:
        with EngineClient(autostart=False, timeout=10) as c:
            c.request("shutdown")
        proc.wait(20)
    except Exception:  # not answering: the hard way
        _stop(proc)


def _stop_any_engine() -> None:
    """Shut down an engine of this test's runtime folder that the test did not start (the app's autostart)."""
    from rigpilot.engine.api.client import EngineClient

    try:
        with EngineClient(autostart=False, timeout=10) as c:
            pid = c.hello.get("pid")
            c.request("shutdown")
    except Exception:  # none answers: nothing to stop
        return
    if isinstance(pid, int):
        with contextlib.suppress(psutil.Error):
            psutil.Process(pid).wait(20)


def _window_manager_up(d: Desktop) -> bool:
    """Up once it has put its check window on the root window (EWMH); without xprop, after a second."""
    if shutil.which("xprop") is None:
        time.sleep(1.0)
        return True
    return "window id" in d.run("xprop", "-root", "_NET_SUPPORTING_WM_CHECK").stdout


@pytest.fixture
def desktop(tmp_path, monkeypatch):
    """Xvfb on a free display (it picks the number: -displayfd), openbox on it when installed, and XDG
    folders of the test's own; everything started here is stopped afterwards."""
    xvfb = subprocess.Popen(
        ["Xvfb", "-displayfd", "1", "-screen", "0", SCREEN, "-nolisten", "tcp"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    number = xvfb.stdout.readline().strip().decode() if xvfb.stdout else ""
    if not number:
        _stop(xvfb)
        pytest.fail("Xvfb did not say which display it took")
    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o700)
    env = {
        "DISPLAY": f":{number}",
        "XDG_RUNTIME_DIR": str(run_dir),
        "XDG_CONFIG_HOME": str(tmp_path / "config"),
        "XDG_DATA_HOME": str(tmp_path / "data"),
        "XDG_STATE_HOME": str(tmp_path / "state"),
        "XDG_CACHE_HOME": str(tmp_path / "cache"),
        "HF_HUB_OFFLINE": "1",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    }
    for key, value in env.items():
        monkeypatch.setenv(key, value)  # this process's EngineClient finds the same engine
    # This process stays offscreen; the app draws on the X server.
    d = Desktop(env["DISPLAY"], {**os.environ, **env, "QT_QPA_PLATFORM": "xcb"}, tmp_path)
    try:
        if shutil.which("openbox"):
            _start(d, ["openbox"], "openbox.log")
            wait_for(lambda: _window_manager_up(d), 10, what="window manager")
        yield d
    finally:
        if d.engine is not None:
            _stop_engine(d.engine)
        for proc in reversed(d.processes):
            _stop(proc)
        if d.engine is None:
            _stop_any_engine()  # one the app started itself, before the test's own (a step failed early)
        for leftover in leftover_job_processes(tmp_path):
            leftover.kill()
        _stop(xvfb)
        if xvfb.stdout is not None:
            xvfb.stdout.close()


# -- steps: each a small function of the desktop, in the order a user takes them --------------------------------


def start_engine(d: Desktop) -> None:
    """The engine service on the simulated machine (as the app would start it, but stopped by the test)."""
    d.engine = _start(d, [sys.executable, "-m", "rigpilot.engine.service", "--telemetry-period", "0.5",
                          "--grace", "3"], "engine.log", cwd=d.tmp)  # fmt: skip

    def answers() -> bool:
        from rigpilot.engine.api.client import EngineClient

        assert d.engine is not None and d.engine.poll() is None, (d.tmp / "engine.log").read_text()
        try:
            with EngineClient(autostart=False, timeout=5) as c:
                return c.hello.get("pid") == d.engine.pid
        except Exception:
            return False

    wait_for(answers, START_TIMEOUT_S, what="engine service")


def start_app(d: Desktop) -> str:
    """The desktop app, until its window is up and connected; returns the window's id."""
    d.app = _start(d, [sys.executable, str(REPO / "tests" / "support" / "x11_app.py"), str(d.tmp / "probe.json")], "app.log", cwd=d.tmp)

    def window() -> str:
        assert d.app is not None and d.app.poll() is None, (d.tmp / "app.log").read_text()
        found = d.windows(f"^{MAIN_TITLE}")
        return found[0] if found else ""

    main = wait_for(window, START_TIMEOUT_S, what="connected main window")
    time.sleep(2.0)  # the start-up check of the worker environment answers 1.5 s after the first frame
    d.screenshot("app-started", main, keep=False)
    return main


def open_wizard_with_ctrl_n(d: Desktop, main: str) -> str:
    """Ctrl+N in the main window opens the job wizard; returns the wizard's window id."""
    assert not d.windows(f"^{WIZARD_TITLE}$")
    d.press(main, "ctrl+n")
    wizard = wait_for(lambda: (d.windows(f"^{WIZARD_TITLE}$") or [""])[0], 20, what="job wizard after Ctrl+N")
    d.screenshot("new-job", wizard)
    return wizard


def jobs(d: Desktop) -> list[dict[str, Any]]:
    return d.engine_request("jobs")["jobs"]


def launch_with_the_defaults(d: Desktop, wizard: str) -> str:
    """Next through every page and Launch on Review, all with Ctrl+Enter; returns the submitted job's id.

    While a page's check runs, Next is disabled and Ctrl+Enter does nothing (unlike Alt+N, it types nothing
    into the focused field), so it is pressed until the engine has the job; the engine's list is read before
    each press, so no key lands on the main window once the wizard has closed."""
    before = {j["id"] for j in jobs(d)}
    deadline = time.monotonic() + 90
    presses = 0
    while not (new := [j for j in jobs(d) if j["id"] not in before]):
        assert time.monotonic() < deadline, "the wizard did not submit a job within 90 s"
        assert d.windows(f"^{WIZARD_TITLE}$"), "the wizard closed without submitting a job"
        d.press(wizard, "ctrl+Return")
        presses += 1
        time.sleep(0.5)
        if presses <= 10:
            d.screenshot("wizard-next", keep=False)
    (job,) = new
    assert job["kind"] == "train" and "tiny-llama" in (job.get("name") or ""), job
    wait_for(lambda: not d.windows(f"^{WIZARD_TITLE}$"), 20, what="the wizard to close after Launch")
    return job["id"]


def losses(d: Desktop, job_id: str) -> tuple[dict[int, float], str]:
    """Rank 0's training loss by step, and the job's state, from the engine's metric pages."""
    by_step: dict[int, float] = {}
    cursor: dict[str, int] | None = None
    while True:
        page = d.engine_request("metrics", job=job_id, since_cursor=cursor)
        for rec in page["records"]:
            if rec.get("rank") == 0 and rec.get("step") is not None and rec.get("loss") is not None:
                by_step[int(rec["step"])] = float(rec["loss"])
        cursor = page["cursor"]
        if not page.get("more"):
            return by_step, page.get("state", "")


def watch_the_loss_fall(d: Desktop, main: str, job_id: str) -> dict[int, float]:
    """Until the job completes; its loss over the last steps is below the first steps'."""
    seen: dict[str, Any] = {"shot": False}

    def done() -> bool:
        by_step, state = losses(d, job_id)
        if len(by_step) >= 5 and not seen["shot"]:
            seen["shot"] = True
            d.screenshot("job-running", main)
        assert state not in ("failed", "cancelled"), f"the example job {state}: {d.engine_request('job', job=job_id)}"
        seen["losses"] = by_step
        return state == "completed"

    wait_for(done, JOB_TIMEOUT_S, interval=1.0, what="completed example job")
    time.sleep(1.0)  # the Jobs page draws the last records
    d.screenshot("job-completed", main, keep=False)
    by_step = losses(d, job_id)[0]
    steps = sorted(by_step)
    assert len(steps) >= 10, by_step
    first = sum(by_step[s] for s in steps[:3]) / 3
    last = sum(by_step[s] for s in steps[-3:]) / 3
    assert last < first * 0.9, f"the loss did not fall: {first:.3f} -> {last:.3f}"
    return by_step


def the_cli_lists_the_job(d: Desktop, job_id: str) -> None:
    """`rigpilot` in a terminal of the same user sees the same engine and job."""
    out = d.rigpilot("jobs")
    assert out.returncode == 0 and job_id in out.stdout, out.stdout + out.stderr


def cli_machine(d: Desktop) -> dict[str, Any]:
    """The machine `rigpilot gpus --json` reports in a terminal of the same user (its `label` and `gpus`)."""
    out = d.rigpilot("gpus", "--json")
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)["machine"]


def the_cli_and_the_window_show_the_same_machine(d: Desktop, main: str) -> None:
    """The window's title names the machine `rigpilot gpus` reports (after a switch in Settings, too)."""
    label = cli_machine(d)["label"]
    title = d.xdotool("getwindowname", main)
    assert title == f"{MAIN_TITLE}{label}", (title, label)


def open_the_summary(d: Desktop, main: str, job_id: str) -> None:
    """The finished job's page (Launch opened it) has a Summary tab; a click on it shows the result."""
    tabs = d.widget("jobTabs", when=lambda w: any(t["text"] == "Summary" for t in w.get("tabs", [])))
    (summary,) = [t for t in tabs["tabs"] if t["text"] == "Summary"]
    d.click(summary["rect"])
    heading = d.widget("summaryHeading", when=lambda w: w.get("text"))["text"]
    assert "completed" in heading.lower(), heading
    snippet = d.widget("loadSnippet", when=lambda w: w.get("text"))["text"]
    assert "from_pretrained" in snippet, snippet  # how to load what the job saved
    d.screenshot("job-summary", main)


def try_it(d: Desktop, main: str) -> None:
    """A prompt typed into "Try it" runs a small inference job on the trained model; its completion shows."""
    before = {j["id"] for j in jobs(d)}
    tabs = d.widget("jobTabs", when=lambda w: any(t["text"] == "Try it" for t in w.get("tabs", [])))
    d.click(next(t for t in tabs["tabs"] if t["text"] == "Try it")["rect"])
    d.click(d.widget("tryPrompt", when=lambda w: w["enabled"])["rect"])
    d.type_text("ROMEO:")
    d.xdotool("key", "--clearmodifiers", "Return")
    new = wait_for(lambda: [j for j in jobs(d) if j["id"] not in before], 30, what="the Try it job")
    (job,) = new
    assert job["kind"] == "infer", job

    def finished() -> bool:
        state = d.engine_request("job", job=job["id"])["job"]["state"]
        assert state not in ("failed", "cancelled"), d.engine_request("job", job=job["id"])
        return state == "completed"

    wait_for(finished, JOB_TIMEOUT_S, interval=1.0, what="the Try it job to complete")
    (result,) = d.engine_request("results", job=job["id"])["results"]
    shown = d.widget("tryOutput", when=lambda w: w.get("text"))["text"]
    assert result["new_tokens"] > 0, result
    # A barely trained model may answer with blank lines only; the box then shows them as ⏎.
    assert shown.replace("⏎", "").replace("·", " ").replace("→", "\t") == result["completion"], (result, shown)
    d.screenshot("try-it", main)


def a_planner_change_marks_the_plan_stale(d: Desktop, main: str) -> None:
    """Planner (Ctrl+3): a model typed and Enter plans it; one more sequence in the batch marks the plan shown
    stale (a banner, Launch disabled) until it is planned again."""
    d.press(main, "ctrl+3")
    d.click(d.widget("modelEdit")["rect"])
    d.xdotool("key", "ctrl+a")
    d.type_text("qwen2.5-0.5b")
    d.xdotool("key", "Return")
    d.widget("launchPlan", timeout=60, when=lambda w: w["enabled"])
    assert "planStale" not in d.probe()["widgets"]
    d.click(d.widget("batch")["rect"])
    d.xdotool("key", "Up")
    d.widget("planStale", when=lambda w: "inputs changed" in w["text"])
    assert not d.widget("launchPlan")["enabled"]
    d.screenshot("planner-stale", main)
    d.click(d.widget("modelEdit")["rect"])  # Enter in the model's field plans again (Plan is scrolled away)
    d.xdotool("key", "Return")
    d.widget("launchPlan", timeout=60, when=lambda w: w["enabled"])
    assert "planStale" not in d.probe()["widgets"]


def no_traceback_reached_the_user(d: Desktop) -> None:
    """The app said nothing on its terminal that a user would read as a crash."""
    log = (d.tmp / "app.log").read_text(errors="replace")
    assert "Traceback" not in log, log


# -- the flow --------------------------------------------------------------------------------------------------


def scroll_into_view(d: Desktop, name: str, area: str, at_least: int = 10_000) -> dict[str, Any]:
    """Turn the mouse wheel over the middle of the widget `area` until the widget `name` shows inside it (whole,
    or its top `at_least` pixels), as a user scrolls a page down to what they look for; returns the widget."""
    for _ in range(40):
        w, box = d.widget(name), d.widget(area)
        (_, y, _, height), (bx, by, bw, bh) = w["rect"], box["rect"]
        if by <= y and y + min(height, at_least) <= by + bh:
            return w
        d.xdotool("mousemove", "--sync", str(bx + bw // 2), str(by + bh // 2))
        d.xdotool("click", "5" if y + height > by + bh else "4")
        time.sleep(0.5)  # the probe writes every 0.4 s
    raise AssertionError(f"{name} did not scroll into view inside {area}")


def start_a_scaling_study(d: Desktop, main: str, job_id: str) -> str:
    """On the Summary tab, "How does this scale?" on 1 and 2 GPUs: the start answers at once and the button
    stays disabled while the study runs, each point's progress shows; returns the study's id."""
    tabs = d.widget("jobTabs")
    d.click(next(t for t in tabs["tabs"] if t["text"] == "Summary")["rect"])
    scroll_into_view(d, "scaleButton", "jobTabs")
    d.click(d.widget("scaleCounts", when=lambda w: w["enabled"])["rect"])
    d.xdotool("key", "--clearmodifiers", "ctrl+a")
    d.type_text("1,2")
    d.click(d.widget("scaleButton", when=lambda w: w["enabled"])["rect"])
    d.widget("scaleProgress", when=lambda w: "planning GPU counts 1, 2" in w["text"] or "GPU (job" in w["text"])
    assert not d.widget("scaleButton")["enabled"]  # a second click cannot start a second study
    (study,) = d.engine_request("scaling_studies", job=job_id)["studies"]
    d.widget("scaleProgress", when=lambda w: "1 GPU (job" in w["text"], timeout=120)
    d.screenshot("scaling-running", main)
    return study["id"]


def the_scaling_study_draws_a_correct_chart(d: Desktop, main: str, study_id: str) -> None:
    """Back on the job's Summary tab: the study ends, its chart has GPUs on x and speed-up on y from 0."""
    d.press(main, "ctrl+4")
    done = d.widget("scaleProgress", when=lambda w: "points measured" in w["text"] or "did not finish" in w["text"],
                    timeout=JOB_TIMEOUT_S)  # fmt: skip
    assert "all 2 points measured" in done["text"], done["text"]
    # The wheel turned over the page (and so over the chart) scrolls it; it never zooms the chart.
    scroll_into_view(d, "scaleChart", "jobTabs", at_least=150)
    chart = d.widget("scaleChart", when=lambda w: len(w["curves"].get("linear", [[]])[0]) == 2)
    (x0, x1), (y0, y1) = chart["view_range"]
    assert x0 == 0 and x1 > 2 and y0 == 0 and y1 > 0, chart["view_range"]
    assert chart["curves"]["linear"] == [[1.0, 2.0], [1.0, 2.0]]
    assert chart["curves"]["predicted"][0] == [1.0, 2.0] and all(y > 0 for y in chart["curves"]["predicted"][1])
    measured = chart["curves"]["measured"][0] + chart["curves"]["noise (not a result)"][0]
    assert sorted(measured) == [1.0, 2.0], chart["curves"]  # every point drawn, as a result or as noise
    assert d.widget("scaleButton")["enabled"]
    shown = d.engine_request("scaling_study", study=study_id)["study"]
    assert shown["state"] == "completed" and [p["gpus"] for p in shown["points"]] == [1, 2]
    d.screenshot("scaling-study", main)


def switch_the_machine_while_jobs_run(d: Desktop, main: str, wanted: str = "H100") -> str:
    """Settings (Ctrl+6) → the simulated machine → Save while the study's jobs run: the switch is kept and made
    when they end, and Settings says so; returns the label the engine served before."""
    before = cli_machine(d)["label"]
    d.press(main, "ctrl+6")
    combo = d.widget("simulatedProfile")
    target = next(i for i, text in enumerate(combo["items"]) if wanted in text)
    d.click(combo["rect"])  # its list opens on the current entry
    time.sleep(0.5)
    steps = target - combo["current"]
    for _ in range(abs(steps)):
        d.xdotool("key", "Down" if steps > 0 else "Up")
    d.xdotool("key", "Return")
    d.widget("simulatedProfile", when=lambda w: w["current"] == target)
    d.click(d.widget("save", when=lambda w: w["enabled"])["rect"])
    said = d.widget("settingsStatus", when=lambda w: "Saved" in w["text"])["text"]
    assert "switches to" in said and "when its" in said, said
    assert cli_machine(d)["label"] == before  # not while they run
    d.screenshot("settings-switch-deferred", main)
    return before


def the_deferred_switch_happens_and_every_page_follows(d: Desktop, main: str, wanted: str = "H100") -> None:
    """Once the last job ended the engine serves the new machine by itself; Settings says it switched, the
    window title follows, and the 8-GPU dashboard shows every card whole on the screen."""
    label = wait_for(lambda: wanted in cli_machine(d)["label"] and cli_machine(d)["label"], 60,
                     what="the engine to switch when the jobs ended")  # fmt: skip
    wait_for(lambda: d.xdotool("getwindowname", main) == f"{MAIN_TITLE}{label}", 20, what="the window title to follow")
    d.press(main, "ctrl+6")
    d.widget("settingsStatus", when=lambda w: "it switched when its jobs ended" in w["text"])
    d.screenshot("settings", main)
    gpus = len(cli_machine(d)["gpus"])
    assert gpus == 8
    d.press(main, "ctrl+1")  # the dashboard: all 8 cards whole inside the window, above the chart
    window = next(w for w in d.probe()["windows"] if w["title"].startswith(MAIN_TITLE))["rect"]
    cards = [d.widget(f"gpuCard{i}") for i in range(gpus)]
    ax, ay, aw, ah = d.widget("cardsArea")["rect"]  # the pane the cards scroll in, above the chart
    for card in cards:
        x, y, w, h = card["rect"]
        inside = window[0] <= x and x + w <= window[0] + window[2] and window[1] <= y and y + h <= window[1] + window[3]
        assert inside and ax <= x and x + w <= ax + aw and ay <= y and y + h <= ay + ah, (card, window, (ax, ay, aw, ah))
    d.screenshot("dashboard-after-switch", main)
    d.press(main, "ctrl+2")
    d.widget("machineTitle", when=lambda w: wanted in w.get("text", ""))
    d.press(main, "ctrl+3")  # the Planner's GPU check boxes
    d.widget(f"gpu-{gpus - 1}")


def test_a_user_runs_the_example_tries_its_model_and_switches_the_machine(desktop):
    from rigpilot.app.wizard.state import examples_present

    if not examples_present():
        pytest.skip("the shipped tiny example is missing from this checkout")
    start_engine(desktop)
    main = start_app(desktop)
    wizard = open_wizard_with_ctrl_n(desktop, main)
    job_id = launch_with_the_defaults(desktop, wizard)
    watch_the_loss_fall(desktop, main, job_id)
    the_cli_lists_the_job(desktop, job_id)
    the_cli_and_the_window_show_the_same_machine(desktop, main)
    open_the_summary(desktop, main, job_id)
    try_it(desktop, main)
    study = start_a_scaling_study(desktop, main, job_id)
    switch_the_machine_while_jobs_run(desktop, main)
    the_scaling_study_draws_a_correct_chart(desktop, main, study)
    the_deferred_switch_happens_and_every_page_follows(desktop, main)
    the_cli_and_the_window_show_the_same_machine(desktop, main)
    a_planner_change_marks_the_plan_stale(desktop, main)
    assert desktop.app is not None and desktop.app.poll() is None, "the app exited"
    no_traceback_reached_the_user(desktop)
