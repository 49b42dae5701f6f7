"""Start-up: only the page on screen is built before the first frame; every other page once, later or on its visit."""

import json
import os
import subprocess
import sys
from collections import Counter

import pytest

from rigpilot.app import main_window
from rigpilot.app.main_window import PAGES, MainWindow

from support.gui_fakes import FakeLink, make_job
from support.paths import REPO

HEAVY_MODULES = [target.split(":")[0] for key, _, target in PAGES if key != "dashboard"]


@pytest.fixture
def builds(monkeypatch) -> Counter:
    """How many times each page class was built, by page key."""
    counts: Counter = Counter()
    load = main_window._load_page

    def counting(target: str):
        cls = load(target)
        key = next(k for k, _, t in PAGES if t == target)

        def build(link):
            counts[key] += 1
            return cls(link)

        return build

    monkeypatch.setattr(main_window, "_load_page", counting)
    return counts


def test_only_the_page_on_screen_is_built_before_the_first_frame(qtbot, builds, monkeypatch):
    at_first_frame: list[dict] = []
    build_next = MainWindow._build_next_page

    def first_turn(self):
        if not at_first_frame:  # the first zero-timer after the first paint
            at_first_frame.append(dict(builds))
        build_next(self)

    monkeypatch.setattr(MainWindow, "_build_next_page", first_turn)
    link = FakeLink("8x-h100-sxm")
    w = MainWindow(link)
    qtbot.addWidget(w)
    assert dict(builds) == {"dashboard": 1}
    assert w.stack.currentWidget() is w.pages.built["dashboard"]
    w.show()
    link.connect_engine()
    qtbot.waitUntil(lambda: bool(at_first_frame), timeout=30_000)  # a busy machine's first frame can take long
    assert at_first_frame[0] == {"dashboard": 1}
    # After the first frame the others follow, one per turn of the event loop, each once.
    qtbot.waitUntil(lambda: len(w.pages.built) == len(PAGES), timeout=30_000)
    assert dict(builds) == {key: 1 for key, _, _ in PAGES}
    w.close()


def test_visiting_each_page_builds_it_once_and_shows_it_whole(qtbot, builds):
    link = FakeLink("4x-rtx4090", jobs=[make_job("job-1", [0, 1], state="completed")])
    w = MainWindow(link)  # never shown: no page is built after a first frame, only on a visit
    qtbot.addWidget(w)
    link.connect_engine()
    for _ in range(2):
        for row, (key, _, _) in enumerate(PAGES):
            w.nav.setCurrentRow(row)
            page = w.stack.currentWidget()
            assert page is w.pages[key] and page.objectName() == f"page-{key}"  # never the placeholder
    assert dict(builds) == {key: 1 for key, _, _ in PAGES}
    assert w.stack.count() == len(PAGES)
    assert [w.stack.widget(i).objectName() for i in range(len(PAGES))] == [f"page-{k}" for k, _, _ in PAGES]
    w.close()


def test_a_page_built_after_the_engine_connected_catches_up(qtbot):
    link = FakeLink("4x-rtx4090", jobs=[make_job("job-1", [2, 3], state="completed")])
    w = MainWindow(link)
    qtbot.addWidget(w)
    link.connect_engine()
    qtbot.waitUntil(lambda: len(w.pages["dashboard"].cards) == 4)
    asked = len(link.requests("jobs"))
    topology = w.show_page("topology")  # built now, long after sig_state(connected) and sig_machine went by
    assert topology.objectName() == "page-topology"
    qtbot.waitUntil(lambda: len(link.requests("jobs")) > asked)
    planner = w.show_page("planner")
    assert sorted(planner.gpus.boxes) == [0, 1, 2, 3]  # the machine it missed
    assert planner.machines is topology.machines  # one list of imported machines for both
    w.close()


def test_the_last_page_is_built_first_and_unbuilt_pages_keep_their_saved_state(qtbot, builds):
    w = MainWindow(FakeLink("1x-rtx4090"))
    qtbot.addWidget(w)
    w.show_page("jobs")
    w.close()
    saved = {k: w.settings.value(k) for k in w.settings.allKeys() if k.startswith("pages/")}
    assert saved  # the Jobs and Dashboard pages save their state
    builds.clear()
    again = MainWindow(FakeLink("1x-rtx4090"))
    qtbot.addWidget(again)
    assert dict(builds) == {"jobs": 1} and again.current_page_key() == "jobs"
    assert again.stack.currentWidget() is again.pages.built["jobs"]
    again.close()  # the Dashboard was never built: what it saved last time is still there
    assert {k: again.settings.value(k) for k in again.settings.allKeys() if k.startswith("pages/")} == saved


def test_the_app_paints_its_first_frame_without_importing_the_other_pages(tmp_path):
    """The real start-up path (rigpilot.app.main), in a process of its own: the modules of the pages not on
    screen, the job wizard and the engine-environment dialog are not imported before the first frame."""
    probe = (
        "import json, sys\n"
        "from rigpilot.app import engine_link, main, main_window\n"
        "engine_link.EngineLink.start = lambda self: None\n"  # no engine service started for this test
        "def first_frame(self):\n"
        "    print('PROBE ' + json.dumps({'built': sorted(self.pages.built), 'modules': sorted(m for m in sys.modules"
        " if m.startswith('rigpilot.app.'))}), flush=True)\n"
        "    self.link.stop()\n"
        "    main_window.QApplication.quit()\n"
        "main_window.MainWindow._first_frame_done = first_frame\n"
        "sys.exit(main.main())\n"
    )
    env = dict(
        os.environ, QT_QPA_PLATFORM="offscreen", RIGPILOT_EXIT_AFTER_FIRST_PAINT="1", PYTHONPATH=str(REPO),
        XDG_CONFIG_HOME=str(tmp_path / "config"), XDG_DATA_HOME=str(tmp_path / "data"),
        XDG_STATE_HOME=str(tmp_path / "state"), XDG_CACHE_HOME=str(tmp_path / "cache"),
        XDG_RUNTIME_DIR=str(tmp_path / "run"),
    )  # fmt: skip
    (tmp_path / "run").mkdir(mode=0o700)
    proc = subprocess.run(
        [sys.executable, "-c", probe], cwd=REPO, env=env, capture_output=True, text=True, timeout=60
    )  # fmt: skip
    line = next((x for x in proc.stdout.splitlines() if x.startswith("PROBE ")), None)
    assert line is not None, proc.stdout + proc.stderr
    seen = json.loads(line.removeprefix("PROBE "))
    assert seen["built"] == ["dashboard"]
    imported = set(seen["modules"])
    assert "rigpilot.app.dashboard.page" in imported
    for module in [*HEAVY_MODULES, "rigpilot.app.wizard.wizard", "rigpilot.app.engine_env.dialog"]:
        assert module not in imported, f"{module} was imported before the first frame"
