"""The Planner page's question: the model, the workload, and how many nodes like this one.

The form only reads and writes a `PlanRequest` (less the GPUs, which the page's
selector owns); what is asked of the engine, and when, is the page's business.
"""

from __future__ import annotations

from typing import Any

from PySide6.QtWidgets import (
    QCheckBox,
    QComboBox,
    QDoubleSpinBox,
    QFormLayout,
    QGroupBox,
    QLabel,
    QSpinBox,
    QVBoxLayout,
    QWidget,
)

from rigpilot.app.planner.model import (
    AUTO,
    FORCE_TP_TEXT,
    METHODS,
    NODE_LINK_CHOICES,
    NODES_MAX,
    OFFLOAD,
    PRECISIONS,
    QUANTIZATION,
    TASKS,
    PlanRequest,
    recipe_choice,
    recipe_choices,
)
from rigpilot.app.planner.model_picker import ModelPicker
from rigpilot.app.widgets.form_row import form_row
from rigpilot.engine.planner.settings import PLAN_SETTINGS
from rigpilot.engine.recipe import RECIPE_SETTINGS
from rigpilot.engine.schema import ADAPTER_METHODS


def _combo(name: str, items: list[tuple[Any, str]]) -> QComboBox:
    box = QComboBox()
    box.setObjectName(name)
    for value, text in items:
        box.addItem(text, value)
    return box


def _spin(name: str, low: int, high: int, value: int, step: int = 1) -> QSpinBox:
    box = QSpinBox()
    box.setObjectName(name)
    box.setRange(low, high)
    box.setValue(value)
    box.setSingleStep(step)
    box.setAccelerated(True)
    return box


def _select(box: QComboBox, value: Any) -> None:
    index = box.findData(value)
    if index >= 0:
        box.setCurrentIndex(index)


class WorkloadForm(QWidget):
    """The "Model" and "Workload" boxes; `nodes_box` (nodes and the link between them) goes with the GPUs."""

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.picker = ModelPicker()
        self._workload_controls()
        workload = self._workload_rows()
        self.nodes_box = QWidget()
        self.nodes_box.setLayout(self._nodes_form())
        self.task.currentIndexChanged.connect(self._task_changed)
        self.method.currentIndexChanged.connect(self._task_changed)

        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        model_box = QGroupBox("Model")
        QVBoxLayout(model_box).addWidget(self.picker)
        workload_box = QGroupBox("Workload")
        workload_box.setLayout(workload)
        layout.addWidget(model_box)
        layout.addWidget(workload_box)
        self._task_changed()

    def _workload_controls(self) -> None:
        self.task = _combo("task", TASKS)
        self.method = _combo("method", METHODS)
        self.method.setToolTip(
            "Full: every weight trains. LoRA: small adapters train. QLoRA: adapters over a 4-bit base"
        )
        self.lora_rank = _spin("loraRank", 1, 1024, 16)
        self.lora_rank.setToolTip("Rank of the LoRA adapters: more capacity, more memory")
        self.quant = _combo("quantization", QUANTIZATION)
        self.seq_len = _spin("seqLen", 1, 1_048_576, 2048, 256)
        self.seq_len.setToolTip("Tokens per sequence (training) or context of prompt plus answer (inference)")
        self.batch = _spin("batch", 1, 65_536, 16)
        self.new_tokens = _spin("newTokens", 1, 1_048_576, 256, 64)
        self.new_tokens.setToolTip("Tokens generated per sequence; the rest of the context is the prompt")
        self.tokens = QDoubleSpinBox()
        self.tokens.setObjectName("tokenBudget")
        self.tokens.setRange(0.0, 1_000_000.0)
        self.tokens.setDecimals(2)
        self.tokens.setSuffix(" billion tokens")
        # Nothing else depends on it: without a budget the plans still say tokens/s and time per step.
        self.tokens.setSpecialValueText("not set: no time to finish")
        self.tokens.setToolTip(
            "How many tokens to train on, in billions. Set it to get a predicted time to finish "
            "(the “To finish” column); plans are the same either way"
        )
        self.precision = _combo("precision", PRECISIONS)
        self.precision.setToolTip("Training: mixed precision in this dtype. Inference: the weights' dtype")
        # The training recipe, one drop-down per setting from its declaration (the job's own: label and help).
        self.recipe: dict[str, QComboBox] = {}
        for name in RECIPE_SETTINGS:
            head, *rest = name.split("_")
            self.recipe[name] = box = _combo(head + "".join(w.title() for w in rest), recipe_choices(name))
            box.setToolTip(PLAN_SETTINGS[name].help)
        self.master_weights = self.recipe["master_weights"]
        self.offload = _combo("offload", OFFLOAD)
        self.offload.setToolTip(
            "CPU offload moves parameters, gradients and optimizer state to host RAM (FSDP2's CPUOffloadPolicy): "
            "it fits larger models and runs slower. Auto tries it only where nothing else fits"
        )
        self.force_tp = QCheckBox(FORCE_TP_TEXT)
        self.force_tp.setObjectName("forceTp")
        self.force_tp.setToolTip(
            "Tensor parallelism is kept within GPUs joined by NVLink or one PCIe switch; "
            "check this to consider it over slower links too"
        )

    def _workload_rows(self) -> QFormLayout:
        workload = QFormLayout()
        workload.addRow("Task", self.task)
        workload.addRow("Method", self.method)
        workload.addRow("LoRA rank", self.lora_rank)
        workload.addRow("Weights", self.quant)
        workload.addRow("Sequence length", self.seq_len)
        self.batch_label = QLabel("Batch")
        workload.addRow(self.batch_label, self.batch)
        workload.addRow("New tokens", self.new_tokens)
        workload.addRow("Train on", self.tokens)
        workload.addRow("Precision", self.precision)
        for name, box in self.recipe.items():
            workload.addRow(PLAN_SETTINGS[name].label, box)
        workload.addRow("CPU offload", self.offload)
        workload.addRow(self.force_tp)
        self.workload_form = workload
        return workload

    def _nodes_form(self) -> QFormLayout:
        """Several machines: how many nodes like this one, and the link between them (training only)."""
        self.nodes = _spin("nodes", 1, NODES_MAX, 1)
        self.internode = _combo("internode", NODE_LINK_CHOICES)
        _select(self.internode, PlanRequest(model="").internode)
        form = QFormLayout()
        form.setContentsMargins(0, 0, 0, 0)
        self.nodes_row = form_row(
            form, "Nodes", self.nodes,
            "Identical machines like this one, each with the selected GPUs. Tensor parallelism stays inside a "
            "node; data or pipeline parallelism spans nodes, and fewer nodes are used where more would not pay.",
            compact=True,
        )  # fmt: skip
        self.internode_row = form_row(
            form, "Link between nodes", self.internode,
            "The network joining the nodes: its bandwidth decides what can cross it each step.", compact=True,
        )  # fmt: skip
        self.nodes_form = form
        self.nodes.valueChanged.connect(self._nodes_changed)
        return form

    def _nodes_changed(self) -> None:
        training = self.task.currentData() == "train"
        self.nodes_form.setRowVisible(self.nodes_row, training)
        self.nodes_form.setRowVisible(self.internode_row, training and self.nodes.value() > 1)

    def _task_changed(self) -> None:
        training = self.task.currentData() == "train"
        lora = training and self.method.currentData() in ADAPTER_METHODS
        rows = self.workload_form
        rows.setRowVisible(self.method, training)
        rows.setRowVisible(self.lora_rank, lora)
        rows.setRowVisible(self.quant, not training)
        rows.setRowVisible(self.new_tokens, not training)
        rows.setRowVisible(self.tokens, training)
        rows.setRowVisible(self.offload, training)
        for box in self.recipe.values():
            rows.setRowVisible(box, training)
        self._nodes_changed()
        self.batch_label.setText("Batch (sequences per step)" if training else "Sequences at once")
        self.batch.setToolTip(
            "Sequences per optimizer step, over all GPUs" if training else "Sequences generated at the same time"
        )

    def request(self, gpus: list[int]) -> PlanRequest:
        """What the form asks, on `gpus`."""
        return PlanRequest(
            model=self.picker.model(),
            task=self.task.currentData(),
            method=self.method.currentData(),
            precision=self.precision.currentData(),
            **{name: None if box.currentData() == AUTO else box.currentData() for name, box in self.recipe.items()},
            seq_len=self.seq_len.value(),
            batch=self.batch.value(),
            gpus=gpus,
            lora_rank=self.lora_rank.value(),
            weight_bits=self.quant.currentData(),
            new_tokens=self.new_tokens.value(),
            token_budget=round(self.tokens.value() * 1e9) or None,
            force_tp=self.force_tp.isChecked(),
            offload=self.offload.currentData(),
            nodes=self.nodes.value(),
            internode=self.internode.currentData(),
        )

    def set_request(self, r: PlanRequest) -> None:
        """Fill the form from `r` (its GPUs are the page's)."""
        self.picker.set_model(r.model, chosen=False)
        _select(self.task, r.task)
        _select(self.method, r.method)
        _select(self.precision, r.precision)
        for name, box in self.recipe.items():
            _select(box, recipe_choice(name, getattr(r, name)))
        _select(self.quant, r.weight_bits)
        self.seq_len.setValue(r.seq_len)
        self.batch.setValue(r.batch)
        self.lora_rank.setValue(r.lora_rank)
        self.new_tokens.setValue(r.new_tokens)
        self.tokens.setValue((r.token_budget or 0) / 1e9)
        self.force_tp.setChecked(r.force_tp)
        _select(self.offload, r.offload)
        self.nodes.setValue(r.nodes)
        _select(self.internode, r.internode)

    def use_seq_len(self, tokens: int) -> None:
        """The model's context as the sequence length; inference keeps at least half of it for the prompt."""
        self.seq_len.setValue(tokens)
        self.new_tokens.setValue(min(self.new_tokens.value(), max(tokens // 2, 1)))
