"""No visible text is cut short on any page or job-wizard page at 1280×800, in the light theme and the dark one.

One window for the module (pages are visited in turn, so this stays cheap), at the size the main window
opens at on a 1280×800 screen, with a fixed font so the measure is the same on every machine. Each page is
measured by tests/support/clipping.py after the theme is applied. A page that clips today is a strict
xfail naming what clips: it turns into a failure the day it is fixed, to be unmarked then.
"""

import pytest
from PySide6.QtCore import QSettings
from PySide6.QtGui import QFont, QPalette
from PySide6.QtWidgets import QApplication

from rigpilot.app.main_window import PAGES, MainWindow
from rigpilot.app.screenshots import SIZE
from rigpilot.app.widgets.theme import apply_theme, current_theme

from support.clipping import clipped_text
from support.doctor_gui_reports import broken_report, reply
from support.gui_fakes import FakeLink, accept_checks, make_job, real_plan_reply

FONT = QFont("DejaVu Sans", 9)

# page key -> what clips there today (strict xfail: remove the entry when it is fixed).
KNOWN_CLIPS: dict[str, str] = {}


@pytest.fixture(scope="module")
def window(tmp_path_factory):
    """The main window on a simulated 4×RTX 4090 with a running and a finished job and a machine check that found
    two broken links, in private settings."""
    mp = pytest.MonkeyPatch()
    tmp = tmp_path_factory.mktemp("clipping")
    mp.setenv("XDG_CONFIG_HOME", str(tmp / "config"))
    mp.setenv("XDG_STATE_HOME", str(tmp / "state"))
    for fmt in (QSettings.Format.NativeFormat, QSettings.Format.IniFormat):
        QSettings.setPath(fmt, QSettings.Scope.UserScope, str(tmp / "qt"))
    app = QApplication.instance()
    assert isinstance(app, QApplication)
    font, theme = app.font(), current_theme()
    app.setFont(FONT)
    # Four GPUs: a simulated 4×RTX 4090's default job, whose GPU charts read out four values in a small chart.
    finished = make_job("job-2", gpus=[0, 1, 2, 3], state="completed", name="tiny-llama shakespeare")
    # A served model, listening: its row and the chat on the Serving page.
    served = {**make_job("job-3", gpus=[3], name="tiny-llama shakespeare"), "kind": "serve",
              "settings": {"kind": "serve", "model": "/tmp/rigpilot-jobs/job-2/output"}}  # fmt: skip
    link = FakeLink("4x-rtx4090", jobs=[make_job("job-1", gpus=[0, 1]), finished, served])
    serving = [{"kind": "status", "phase": "serving", "url": "http://127.0.0.1:41234/v1", "model": served["name"]}]
    metrics = link.replies["metrics"]
    link.replies["metrics"] = lambda job, **kw: (
        {"job": job, "records": serving, "cursor": {}, "more": False, "state": "running"} if job == "job-3"
        else metrics(job=job, **kw)
    )  # fmt: skip
    link.replies["plan"] = real_plan_reply(link.machine_obj)
    # A machine check with two broken links: its card, its view in Settings and its marks on the Topology page.
    link.replies["doctor_report"] = reply(broken_report())
    accept_checks(link)  # the wizard's Review page asks the engine what it would run
    w = MainWindow(link)
    w.resize(*SIZE)
    w.show()
    link.connect_engine()
    yield w
    w.hide()  # close() asks about the running job in a modal box
    w.deleteLater()
    apply_theme(app, theme)
    app.setFont(font)
    mp.undo()


def settled_clips(qtbot, root) -> list[str]:
    """What clips under `root` once its layouts have settled. A page shown or filled for the first time lays out
    in events posted one after another (on a busy machine a label measured mid-way had its old width), so a
    clip is reported only if it is still there after a while."""
    qtbot.wait(50)  # the first layouts run before anything is measured: a widget not laid out yet shows nothing
    problems: list[str] = []

    def clean() -> bool:
        problems[:] = clipped_text(root)
        return not problems

    try:
        qtbot.waitUntil(clean, timeout=2000)
    except qtbot.TimeoutError:
        pass
    return problems


def _cases():
    for theme in ("light", "dark"):
        for key, _, _ in PAGES:
            marks = []
            if key in KNOWN_CLIPS:
                marks.append(pytest.mark.xfail(strict=True, reason=f"{key}: {KNOWN_CLIPS[key]}"))
            yield pytest.param(theme, key, marks=marks, id=f"{theme}-{key}")


@pytest.mark.parametrize(("theme", "page"), list(_cases()))
def test_no_text_is_clipped(window, qtbot, theme, page):
    app = QApplication.instance()
    apply_theme(app, theme)
    window.show_page(page)
    qtbot.waitUntil(lambda: window.stack.currentWidget() is window.pages[page])
    problems = settled_clips(qtbot, window)
    assert not problems, f"{page} ({theme}) clips:\n" + "\n".join(problems)


@pytest.mark.parametrize("theme", ["light", "dark"])
def test_a_finished_job_fits(window, qtbot, theme):
    """The Jobs page with a finished job open (its Summary tab and the list beside it)."""
    apply_theme(QApplication.instance(), theme)
    jobs = window.show_page("jobs")
    jobs.open_job("job-2")
    problems = settled_clips(qtbot, window)
    assert not problems, f"jobs with a job open ({theme}) clips:\n" + "\n".join(problems)


def test_the_themes_are_readable():
    """Text, muted text and the status colours (as status_text draws them) read on both themes' backgrounds."""
    from PySide6.QtGui import QPalette

    from rigpilot.app.widgets.palette import ACCENT, BAD, GOOD, WARN, status_text
    from rigpilot.app.widgets.theme import contrast_ratio, dark_palette, light_palette

    R = QPalette.ColorRole
    for palette in (light_palette(), dark_palette()):
        for fg, bg in ((R.WindowText, R.Window), (R.Text, R.Base), (R.ButtonText, R.Button),
                       (R.PlaceholderText, R.Base), (R.PlaceholderText, R.Window), (R.HighlightedText, R.Highlight),
                       (R.ToolTipText, R.ToolTipBase)):  # fmt: skip
            assert contrast_ratio(palette.color(fg), palette.color(bg)) >= 4.5, (fg, bg)
        for status in (GOOD, WARN, BAD, ACCENT):
            for bg in (R.Window, R.Base):
                assert contrast_ratio(status_text(status, palette), palette.color(bg)) >= 3.0, (status.name(), bg)


def test_the_appearance_setting_applies_at_once_and_is_kept(qtbot):
    from rigpilot.app.settings.model import read_theme
    from rigpilot.app.settings.page import SettingsPage
    from rigpilot.app.widgets.theme import dark_palette

    app = QApplication.instance()
    before = current_theme()
    page = SettingsPage(FakeLink("4x-rtx4090"))
    qtbot.addWidget(page)
    try:
        page.appearance.setCurrentIndex(page.appearance.findData("dark"))
        assert current_theme() == "dark" and read_theme() == "dark"
        assert app.palette().color(app.palette().ColorRole.Window) == dark_palette().color(
            dark_palette().ColorRole.Window
        )
        QSettings().setValue("appearance/theme", "purple")  # hand-edited: follows the system
        assert read_theme() == "system"
    finally:
        apply_theme(app, before)


@pytest.mark.parametrize("theme", ["light", "dark"])
def test_the_planner_with_a_plan_fits(window, qtbot, theme):
    from rigpilot.app.planner.model import PlanRequest

    apply_theme(QApplication.instance(), theme)
    planner = window.show_page("planner")
    answers: list[object] = []
    planner.sig_plan_ready.connect(answers.append)
    planner.sig_plan_failed.connect(answers.append)
    planner.set_request(PlanRequest(model="llama-2-7b", task="train", method="full", precision="bf16",
                                    seq_len=2048, batch=16, gpus=[0, 1, 2, 3]))  # fmt: skip
    planner.request_plan()
    qtbot.waitUntil(lambda: bool(answers), timeout=60_000)
    assert isinstance(answers[0], dict), answers[0]
    problems = settled_clips(qtbot, window)
    assert not problems, f"planner with a plan ({theme}) clips:\n" + "\n".join(problems)


def test_the_measure_finds_cut_text_and_passes_what_fits(qtbot):
    """The helper itself: each kind of cut it must see, and the deliberate elision it must let through."""
    from PySide6.QtWidgets import QLabel, QPushButton, QVBoxLayout, QWidget

    from rigpilot.app.widgets.elided_label import ElidedLabel

    root = QWidget()
    qtbot.addWidget(root)
    layout = QVBoxLayout(root)
    fits = QLabel("OK")
    cut = QLabel("a label far too long for forty pixels")
    cut.setFixedWidth(40)
    wrapped = QLabel("a wrapped label with many words that needs several lines at this width")
    wrapped.setWordWrap(True)
    wrapped.setFixedSize(80, 20)
    button = QPushButton("A button with a long text")
    button.setFixedWidth(50)
    elided = ElidedLabel("an elided label with its whole text in the tooltip")
    elided.setFixedWidth(60)
    indented = QLabel("an indented note")  # its indent takes width only, as a task's note under its radio button
    indented.setWordWrap(True)
    indented.setIndent(24)
    for w in (fits, cut, wrapped, button, elided, indented):
        layout.addWidget(w)
    root.show()
    qtbot.waitExposed(root)
    problems = clipped_text(root)
    assert len(problems) == 3, problems
    assert any("far too long" in p for p in problems)
    assert any("wrapped label" in p and "high" in p for p in problems)
    assert any("A button" in p for p in problems)
    elided.setToolTip("")
    assert any("elided without" in p for p in clipped_text(root))


def test_a_theme_switch_recolours_the_gpu_cards_titles(window, qtbot):
    """A card's title follows the theme it is shown in (a style sheet on it once kept the light theme's dark text
    on the dark theme's card); the GPU's chart colour is a swatch beside it."""
    app = QApplication.instance()
    window.show_page("dashboard")
    card = next(iter(window.pages["dashboard"].cards.values()))
    for theme in ("light", "dark", "light"):
        apply_theme(app, theme)
        qtbot.wait(20)
        assert card.title.palette().color(card.title.foregroundRole()) == app.palette().color(QPalette.ColorRole.WindowText)
        assert not card.title.styleSheet() and not card.swatch.pixmap().isNull()


# The pages the job wizard walks with its defaults (the shipped tiny example), Launch aside: it only submits.
WIZARD_WALK = ("TASK", "MODEL", "DATA", "GPUS", "PLAN", "HYPER", "REVIEW")


@pytest.mark.parametrize("theme", ["light", "dark"])
def test_the_wizard_pages_fit(window, qtbot, theme):
    """Each wizard page as New job… opens it, at the size the wizard opens at on a 1280×800 screen and at the
    screenshots' size. The defaults' GPUs run the module's job, so the GPUs page is measured with its refusal
    shown too, before the job is told to queue."""
    from PySide6.QtCore import QSize

    from rigpilot.app.widgets.window_size import small_screen_size
    from rigpilot.app.wizard import page_base
    from rigpilot.app.wizard.wizard import DESIGN_SIZE, SETTINGS_KEY

    apply_theme(QApplication.instance(), theme)
    window.new_job_action.trigger()
    wizard = window.wizard
    qtbot.waitExposed(wizard)
    problems: list[str] = []

    def measure(what: str) -> None:
        for size in (small_screen_size(DESIGN_SIZE), QSize(*SIZE)):
            wizard.resize(size)
            qtbot.waitUntil(lambda s=size: wizard.size() == s)
            problems.extend(f"{what} at {size.width()}×{size.height()}: {p}" for p in settled_clips(qtbot, wizard))

    try:
        for name in WIZARD_WALK:
            assert wizard.currentId() == getattr(page_base, name)
            page = wizard.currentPage()
            qtbot.waitUntil(lambda p=page: not p.busy, timeout=20_000)
            if name == "GPUS":
                assert not page.isComplete()  # GPUs 0 and 1 are busy
                measure("GPUS (busy)")
                page.queue.setChecked(True)
                qtbot.waitUntil(page.isComplete, timeout=20_000)
            measure(name)
            assert page.isComplete(), f"{name}: {page.message.text()}"
            wizard.next()
    finally:
        wizard.reject()
        QSettings().remove(SETTINGS_KEY)  # the other theme's walk starts from the same defaults
    assert not problems, f"the wizard ({theme}) clips:\n" + "\n".join(problems)


@pytest.mark.parametrize("theme", ["light", "dark"])
def test_the_use_this_model_arrow_sits_beside_its_text(window, qtbot, theme):
    """The finished job's "Use this model" menu button: the style keeps the arrow a region of its own at the
    button's right end (as QCommonStyle draws a push button's menu arrow) and the text fits beside it; a tool
    button's instant-popup arrow was drawn over the text's end."""
    from PySide6.QtGui import QFontMetrics
    from PySide6.QtWidgets import QPushButton, QStyle, QStyleOptionButton

    apply_theme(QApplication.instance(), theme)
    jobs = window.show_page("jobs")
    jobs.open_job("job-2")
    button = jobs.detail.use_button
    qtbot.waitUntil(button.isVisible)
    qtbot.wait(50)  # layouts settle after the job is shown
    assert isinstance(button, QPushButton), type(button)
    option = QStyleOptionButton()
    button.initStyleOption(option)
    assert option.features & QStyleOptionButton.ButtonFeature.HasMenu
    style = button.style()
    arrow = style.pixelMetric(QStyle.PixelMetric.PM_MenuButtonIndicator, option, button)
    # CE_PushButtonLabel centres the text in the contents less the arrow's width; the arrow starts 2 px into it.
    text_room = style.subElementRect(QStyle.SubElement.SE_PushButtonContents, option, button).adjusted(0, 0, -arrow, 0)
    arrow_left = button.rect().right() - arrow + 2
    text = button.text().replace("&", "")
    width = QFontMetrics(button.font()).horizontalAdvance(text)
    assert width <= text_room.width(), (width, text_room)
    assert text_room.center().x() + (width + 1) // 2 < arrow_left, (text_room, width, arrow_left)
    assert button.width() >= button.sizeHint().width() >= width + arrow


def test_the_planner_shows_five_ranked_plans(window, qtbot):
    """At 1280×800 with a plan (the best and four runners-up, their layouts wrapped), every ranked plan shows whole
    in the table: the chart and the details below give it the room."""
    from rigpilot.app.planner.model import PlanRequest
    from rigpilot.app.planner.results_view import TABLE_ROWS

    planner = window.show_page("planner")
    # Which GPUs the running job holds is known first: the default selection follows it, and a change after the
    # plan would mark it stale (a banner above the table).
    qtbot.waitUntil(lambda: bool(planner.busy.busy))
    with qtbot.waitSignal(planner.sig_plan_ready, timeout=60_000):
        planner.set_request(PlanRequest(model="llama-2-7b", task="train", method="full", precision="bf16",
                                        seq_len=2048, batch=16, gpus=[0, 1, 2, 3]))  # fmt: skip
        planner.request_plan()
    table = planner.results.table
    assert table.rowCount() >= TABLE_ROWS and not planner.results.is_stale

    def whole_rows() -> int:
        height = table.viewport().height()
        return sum(0 <= table.rowViewportPosition(r) <= height - table.rowHeight(r) for r in range(table.rowCount()))

    qtbot.waitUntil(lambda: whole_rows() >= TABLE_ROWS)
    assert max(table.rowHeight(r) for r in range(TABLE_ROWS)) > table.verticalHeader().defaultSectionSize()  # wrapped


def test_a_theme_switch_recolours_every_chart(window, qtbot):
    """Every chart of the finished job's page takes the theme's background when the theme changes (the peak
    memory chart once kept the light one in the dark theme)."""
    from rigpilot.app.widgets.chart_view import ChartView
    from rigpilot.app.widgets.theme import palette_for

    app = QApplication.instance()
    jobs = window.show_page("jobs")
    jobs.open_job("job-2")
    charts = jobs.findChildren(ChartView)
    assert any(c.objectName() == "peakMemoryChart" for c in charts)

    def themed(theme: str) -> None:
        base = palette_for(theme).color(QPalette.ColorRole.Base)
        assert [c.objectName() for c in charts if c.backgroundBrush().color() != base] == [], theme

    for theme in ("dark", "light"):
        apply_theme(app, theme)  # the widgets hear of it in posted events
        qtbot.waitUntil(lambda t=theme: themed(t))
