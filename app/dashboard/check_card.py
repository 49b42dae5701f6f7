"""The Dashboard's machine-check card: one line on the last check of this machine, and a way to the full view.

"Machine check: 2 problems — …the worst finding…" in the worst finding's colour, "Not checked yet" with a
button that runs one, or a check running; the button opens Settings → Check this machine (the main window
wires `sig_open`).
"""

from __future__ import annotations

from typing import Any

from PySide6.QtCore import Signal
from PySide6.QtWidgets import QFrame, QHBoxLayout, QLabel, QPushButton, QVBoxLayout, QWidget

from rigpilot.app.doctor.model import CheckState, headline
from rigpilot.app.doctor.source import CheckSource
from rigpilot.app.widgets.elided_label import ElidedLabel
from rigpilot.app.widgets.icons import set_icon
from rigpilot.app.widgets.style import set_banner


class CheckCard(QFrame):
    sig_open = Signal(bool)  # open the machine check view; True: and start a check there

    def __init__(self, link: Any, parent: QWidget | None = None, *, source: CheckSource | None = None):
        super().__init__(parent)
        self.setObjectName("machineCheckCard")
        self.source = source or CheckSource(link, self)
        # One line whatever the finding's length (the whole of it in the tooltip): the card stays as short as
        # the host panel beside it, so the GPU cards below keep their room.
        self.text = ElidedLabel("Machine check: asking the engine…")
        self.text.setObjectName("machineCheckLine")
        self.title = QLabel("Machine check")
        self.title.setObjectName("machineCheckTitle")
        font = self.title.font()
        font.setBold(True)
        self.title.setFont(font)
        self.button = QPushButton("Details…")
        self.button.setObjectName("openMachineCheck")
        set_icon(self.button, "check-machine")
        self.headline = ""  # the whole line the card says, as headline() words it
        self._starts = False  # the button runs a check (none stored for this machine and driver)
        self.button.clicked.connect(lambda: self.sig_open.emit(self._starts))
        column = QVBoxLayout(self)
        column.setContentsMargins(8, 6, 8, 6)
        column.addWidget(self.title)
        column.addWidget(self.text)
        row = QHBoxLayout()
        row.addStretch(1)
        row.addWidget(self.button)
        column.addLayout(row)
        set_banner(self, "info")
        self.source.sig_changed.connect(self.show_state)
        if self.source.loaded:
            self.show_state(self.source.state)

    def show_state(self, state: CheckState) -> None:
        status, line = headline(state)
        if state.report is None and state.running:
            line = "Machine check running…"
        self._starts = state.report is None and not state.running and not state.error
        if self._starts:
            line = f"{line} — check this machine's GPUs and links" if state.why in (None, "never") else line
        self.headline = line
        # "Machine check: 2 problems" above, the worst finding's words under it (whole in the tooltip).
        title, _, rest = line.partition(" — ")
        split = bool(rest) and title.startswith("Machine check")
        self.title.setText(title if split else "Machine check")
        self.text.setText(rest if split else line)  # its tooltip holds the whole of it
        self.button.setText("Check this machine" if self._starts else "Details…")
        self.button.setToolTip("Open Settings → Check this machine" + (" and start a check" if self._starts else ""))
        set_banner(self, status)  # type: ignore[arg-type]
