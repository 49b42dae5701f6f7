"""Picking a model: type a preset, folder or hub id, choose a preset, browse for a folder, or search the hub.

The text field holds what is sent to the engine. A hub search runs in the
background and lists hub matches, models already in the local Hugging Face
cache and matching presets; offline, it says so and lists the last two.
"""

from __future__ import annotations

from pathlib import Path

from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import (
    QComboBox,
    QFileDialog,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QListWidget,
    QListWidgetItem,
    QPushButton,
    QVBoxLayout,
    QWidget,
)

from rigpilot.app.planner.hub_search import HubResults, search_hub
from rigpilot.app.planner.model import error_text
from rigpilot.app.tasks import run_in_background
from rigpilot.app.widgets.icons import set_icon
from rigpilot.engine.given_path import is_given_folder
from rigpilot.engine.models.presets import list_presets

PRESET_PROMPT = "Presets…"


class ModelPicker(QWidget):
    sig_model_changed = Signal(str)  # the reference as typed or picked, stripped
    sig_model_chosen = Signal(str)  # a deliberate pick: Enter, a preset, a folder, a search result
    sig_hub_results = Signal(object)  # HubResults of the last search

    def __init__(self, parent: QWidget | None = None, *, config_files: bool = False):
        super().__init__(parent)
        self._search_serial = 0
        self.edit = QLineEdit()
        self.edit.setObjectName("modelEdit")
        self.edit.setPlaceholderText("preset, folder, or Hugging Face id (org/name)")
        self.edit.setClearButtonEnabled(True)
        self.edit.textChanged.connect(lambda t: self.sig_model_changed.emit(t.strip()))
        self.edit.returnPressed.connect(lambda: self.sig_model_chosen.emit(self.model()))
        self.presets = QComboBox()
        self.presets.setObjectName("modelPresets")
        # Narrow when closed (the form is narrow); the popup still shows whole names.
        self.presets.setSizeAdjustPolicy(QComboBox.SizeAdjustPolicy.AdjustToMinimumContentsLengthWithIcon)
        self.presets.setMinimumContentsLength(8)
        self.presets.addItem(PRESET_PROMPT)
        for p in list_presets():
            self.presets.addItem(p.name, p.name)
            self.presets.setItemData(self.presets.count() - 1, p.repo_id, Qt.ItemDataRole.ToolTipRole)
        self.presets.activated.connect(self._preset_chosen)
        self.folder_button = QPushButton("Folder…")
        set_icon(self.folder_button, "open-folder")
        self.folder_button.setObjectName("modelFolder")
        self.folder_button.setToolTip("A local folder with config.json (and weights)")
        self.folder_button.clicked.connect(self._ask_folder)
        self.config_button: QPushButton | None = None
        if config_files:
            self.config_button = QPushButton("config.json…")
            self.config_button.setObjectName("modelConfig")
            self.config_button.setToolTip("A model configuration to train from scratch")
            self.config_button.clicked.connect(self._ask_config)
        self.search_button = QPushButton("Search hub")
        set_icon(self.search_button, "search")
        self.search_button.setObjectName("modelSearch")
        self.search_button.setToolTip("Search the Hugging Face hub for the text typed (cached models when offline)")
        self.search_button.clicked.connect(self.search)

        self.results = QListWidget()
        self.results.setObjectName("modelResults")
        self.results.setAccessibleName("Model search results")
        self.results.setMaximumHeight(140)
        self.results.itemActivated.connect(self._result_chosen)
        self.results.itemClicked.connect(self._result_chosen)
        self.results.hide()
        self.message = QLabel()
        self.message.setObjectName("hubMessage")
        self.message.setWordWrap(True)
        self.message.hide()

        row = QHBoxLayout()
        row.setContentsMargins(0, 0, 0, 0)
        row.addWidget(self.presets, 1)
        row.addWidget(self.folder_button)
        if self.config_button is not None:
            row.addWidget(self.config_button)
        row.addWidget(self.search_button)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.addWidget(self.edit)
        layout.addLayout(row)
        layout.addWidget(self.message)
        layout.addWidget(self.results)

    # -- value --------------------------------------------------------------------------------
    def model(self) -> str:
        return self.edit.text().strip()

    def set_model(self, ref: str, chosen: bool = True) -> None:
        self.edit.setText(ref)
        index = self.presets.findData(ref)
        self.presets.setCurrentIndex(max(index, 0))
        if chosen:
            self.sig_model_chosen.emit(self.model())

    # -- ways to pick ---------------------------------------------------------------------------
    def _preset_chosen(self, index: int) -> None:
        name = self.presets.itemData(index)
        if name:
            self.set_model(name)

    def _ask_folder(self) -> None:
        start = self.model() if is_given_folder(self.model()) else str(Path.home())
        folder = QFileDialog.getExistingDirectory(self, "Model folder (with config.json)", start)
        if folder:
            self.set_model(folder)

    def _ask_config(self) -> None:
        path, _ = QFileDialog.getOpenFileName(self, "Model configuration", str(Path.home()), "config.json (*.json)")
        if path:
            self.set_model(path)

    def _result_chosen(self, item: QListWidgetItem) -> None:
        ref = item.data(Qt.ItemDataRole.UserRole)
        if ref:
            self.set_model(ref)

    # -- hub search -----------------------------------------------------------------------------
    def search(self) -> None:
        """Search the hub for the text typed; the answer arrives later (`sig_hub_results`)."""
        self._search_serial += 1
        serial = self._search_serial
        query = self.model()
        self.search_button.setEnabled(False)
        self.message.setText("Searching…")
        self.message.show()
        run_in_background(
            lambda: search_hub(query),
            lambda r: self._show_results(serial, r),
            lambda e: self._search_failed(serial, e),
        )

    def _show_results(self, serial: int, r: HubResults) -> None:
        if serial != self._search_serial:
            return  # a newer search is out
        self.search_button.setEnabled(True)
        self.results.clear()
        for ref in r.hub:
            self._add_result(ref, ref, "from the Hugging Face hub")
        for ref in r.cached:
            self._add_result(f"{ref}  (cached)", ref, "in the local Hugging Face cache: works offline")
        for name in r.presets:
            self._add_result(f"{name}  (preset)", name, "ships with Rigpilot: plans without network")
        found = self.results.count()
        if r.message:
            self.message.setText(r.message if found else r.message + " Nothing matches.")
        else:
            self.message.setText(f"{found} match{'es' if found != 1 else ''}." if found else "Nothing matches.")
        self.message.show()
        self.results.setVisible(found > 0)
        self.sig_hub_results.emit(r)

    def _add_result(self, text: str, ref: str, tip: str) -> None:
        item = QListWidgetItem(text)
        item.setData(Qt.ItemDataRole.UserRole, ref)
        item.setToolTip(tip)
        self.results.addItem(item)

    def _search_failed(self, serial: int, error: BaseException) -> None:
        if serial != self._search_serial:
            return
        self.search_button.setEnabled(True)
        self.message.setText(f"Search failed: {error_text(error)}")
        self.message.show()
