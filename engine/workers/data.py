"""Training data: read text / JSONL / chat files, tokenize, pack into blocks, split, shard per data-parallel rank.

Every rank does the same reading and tokenizing on its own. That costs some
CPU, but no rank ever waits for another here, so a bad file fails all ranks at
once with the same clear message instead of one rank failing and the others
hanging in a barrier.

Determinism is the point of this module: the blocks, the train/eval split and
the order of batches depend only on the files, the tokenizer, the settings and
the seed, so a resumed run sees exactly the batches the uninterrupted one would.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rigpilot.engine.errors import UserError
from rigpilot.engine.jobspec.datasets import Document, Messages, record_document

TEXT_SUFFIXES = {".txt", ".md", ".text"}
JSONL_SUFFIXES = {".jsonl", ".json", ".ndjson"}
MAX_EVAL_BATCHES = 50  # per data-parallel rank: an evaluation must stay a small fraction of a run
TEXT_CHUNK_CHARS = 1 << 18  # tokenize big text files in pieces so memory stays flat
FALLBACK_ROLES = {"system": "<|system|>", "user": "<|user|>", "assistant": "<|assistant|>"}


def dataset_files(paths: list[str]) -> list[Path]:
    """The files behind the dataset entries (a folder stands for its text and JSONL files, sorted)."""
    if not paths:
        raise UserError("no dataset given: add a .txt or .jsonl file to the job's train settings")
    files: list[Path] = []
    for entry in paths:
        p = Path(entry).expanduser()
        if p.is_dir():
            found = sorted(
                f for f in p.rglob("*") if f.is_file() and f.suffix.lower() in TEXT_SUFFIXES | JSONL_SUFFIXES
            )
            if not found:
                raise UserError(f"dataset folder {p} has no .txt or .jsonl files")
            files.extend(found)
        elif p.is_file():
            if p.suffix.lower() not in TEXT_SUFFIXES | JSONL_SUFFIXES:
                raise UserError(f"dataset {p}: unsupported format {p.suffix or '(no suffix)'}; use .txt or .jsonl")
            files.append(p)
        else:
            raise UserError(f"dataset {p} not found")
    return files


def read_documents(path: Path, text_field: str = "text") -> list[Document]:
    """The documents of one file; raises UserError naming the file (and line) when it cannot be used."""
    try:
        raw = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise UserError(f"dataset {path} is not UTF-8 text ({e.reason} at byte {e.start})") from e
    except OSError as e:
        raise UserError(f"dataset {path}: cannot read ({e.strerror or e})") from e
    if not raw.strip():
        raise UserError(f"dataset {path} is empty")
    if path.suffix.lower() in TEXT_SUFFIXES:
        return [Document(text=raw)]
    records = _json_records(path, raw)
    docs = [record_document(path, line, rec, text_field) for line, rec in records]
    if not docs:
        raise UserError(f"dataset {path} is empty")
    return docs


def _json_records(path: Path, raw: str) -> list[tuple[int, Any]]:
    stripped = raw.lstrip()
    if path.suffix.lower() == ".json" and stripped.startswith("["):
        try:
            return list(enumerate(json.loads(raw), start=1))
        except json.JSONDecodeError as e:
            raise UserError(f"dataset {path}: not valid JSON ({e})") from e
    records = []
    for n, line in enumerate(raw.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            records.append((n, json.loads(line)))
        except json.JSONDecodeError as e:
            raise UserError(f"dataset {path} line {n}: not valid JSON ({e.msg})") from e
    return records


def render_chat(messages: Messages, tokenizer: Any, add_generation_prompt: bool = False) -> str:
    """The conversation as the model was trained to see it: its chat template, else a plain fallback."""
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    eos = tokenizer.eos_token or ""
    text = "".join(f"{FALLBACK_ROLES.get(m['role'], '<|' + m['role'] + '|>')}\n{m['content']}{eos}\n" for m in messages)
    return text + (f"{FALLBACK_ROLES['assistant']}\n" if add_generation_prompt else "")


@dataclass
class Tokenized:
    ids: list[int]
    trained: list[bool]  # per token: does the loss predict it (False: prompt tokens, when they are masked)
    unmaskable: bool = False  # a chat whose template does not render turn by turn: trained on every token


def _encode(text: str, tokenizer: Any) -> list[int]:
    # Chat templates write their own BOS where they want one; adding special tokens would double it.
    return list(tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"])


def _chat(messages: Messages, tokenizer: Any, train_on_prompts: bool) -> Tokenized:
    ids = _encode(render_chat(messages, tokenizer), tokenizer)
    if train_on_prompts:
        return Tokenized(ids, [True] * len(ids))
    # Each answer spans from the end of the conversation before it (with the assistant's header, the
    # generation prompt) to the end of the conversation through it. That holds only when the template
    # renders a conversation as the concatenation of its turns; where it does not (templates that
    # drop earlier reasoning, say), the whole conversation is trained and the job says so.
    trained = [False] * len(ids)
    try:
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            before = _encode(render_chat(messages[:i], tokenizer, add_generation_prompt=True), tokenizer)
            through = _encode(render_chat(messages[: i + 1], tokenizer), tokenizer)
            if ids[: len(before)] != before or ids[: len(through)] != through:
                raise ValueError("not rendered turn by turn")
            trained[len(before) : len(through)] = [True] * (len(through) - len(before))
    except Exception:  # a template may also refuse a partial conversation
        return Tokenized(ids, [True] * len(ids), unmaskable=True)
    return Tokenized(ids, trained)


def tokenize_document(doc: Document, tokenizer: Any, train_on_prompts: bool = True) -> Tokenized:
    """Token ids of one document, ending with the end-of-sequence token so packed documents stay apart.

    For a conversation without `train_on_prompts`, only the assistant's answers are marked trained.
    """
    if doc.messages is not None:
        out = _chat(doc.messages, tokenizer, train_on_prompts)
    else:
        text = doc.text or ""
        ids = []
        for start in range(0, len(text), TEXT_CHUNK_CHARS):
            piece = text[start : start + TEXT_CHUNK_CHARS]
            # verbose=False: packing makes long documents fine, so no "longer than the model's maximum" warning.
            ids.extend(tokenizer(piece, add_special_tokens=start == 0, verbose=False)["input_ids"])
        out = Tokenized(ids, [True] * len(ids))
    eos = tokenizer.eos_token_id
    if eos is None:
        eos = tokenizer.sep_token_id
    if eos is not None and (not out.ids or out.ids[-1] != eos):
        out.ids.append(eos)
        out.trained.append(out.trained[-1] if out.trained else True)  # an answer's end is part of it
    return out


def pack(token_ids: list[int] | list[bool], block_len: int) -> torch.Tensor:
    """Consecutive, non-overlapping blocks of block_len tokens (the tail that does not fill one is dropped)."""
    n = len(token_ids) // block_len
    dtype = torch.bool if token_ids and isinstance(token_ids[0], bool) else torch.long
    return torch.tensor(token_ids[: n * block_len], dtype=dtype).view(n, block_len)


def split_blocks(blocks: torch.Tensor, eval_fraction: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A seeded random split into (train, eval); eval gets at least one block when eval_fraction > 0."""
    n = blocks.shape[0]
    n_eval = 0
    if eval_fraction > 0 and n > 1:
        n_eval = min(max(1, round(n * eval_fraction)), n - 1)
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    eval_idx, train_idx = perm[:n_eval].sort().values, perm[n_eval:].sort().values
    return blocks[train_idx], blocks[eval_idx]


@dataclass
class Dataset:
    train: torch.Tensor  # (n, block_len) token ids
    eval: torch.Tensor
    block_len: int
    num_tokens: int
    files: list[Path]
    # (n, block_len) bools, True where the loss predicts the token; None when it predicts every token.
    train_trained: torch.Tensor | None = None
    eval_trained: torch.Tensor | None = None
    trained_tokens: int = 0  # tokens the loss predicts
    unmaskable_chats: int = 0  # conversations trained whole because their template could not be split


def read_dataset(paths: list[str], text_field: str) -> tuple[list[Path], list[Document]]:
    """Every document of the dataset; read before the model loads, so a bad file fails in seconds."""
    files = dataset_files(paths)
    return files, [doc for f in files for doc in read_documents(f, text_field)]


def build_dataset(
    files: list[Path],
    docs: list[Document],
    tokenizer: Any,
    block_len: int,
    eval_fraction: float,
    seed: int,
    train_on_prompts: bool = True,
) -> Dataset:
    ids: list[int] = []
    trained: list[bool] = []
    unmaskable = 0
    for doc in docs:
        t = tokenize_document(doc, tokenizer, train_on_prompts)
        ids.extend(t.ids)
        trained.extend(t.trained)
        unmaskable += t.unmaskable
    if len(ids) < block_len:
        names = ", ".join(str(f) for f in files)
        raise UserError(
            f"dataset {names} has {len(ids)} tokens, fewer than one training sequence of {block_len}: "
            "lower seq_len or add data"
        )
    blocks = pack(ids, block_len)
    train, evaluation = split_blocks(blocks, eval_fraction, seed)
    data = Dataset(train=train, eval=evaluation, block_len=block_len, num_tokens=len(ids), files=files)
    data.trained_tokens, data.unmaskable_chats = sum(trained), unmaskable
    if not all(trained):
        if not any(trained):
            names = ", ".join(str(f) for f in files)
            raise UserError(f"dataset {names} has no assistant answers to train on, only prompts")
        data.train_trained, data.eval_trained = split_blocks(pack(trained, block_len), eval_fraction, seed)
    return data


class ShardedBatches:
    """Deterministic batches of block indices for one data-parallel rank (a stateful DistributedSampler).

    Each epoch is a seeded permutation of all training blocks, cut into optimizer
    steps of dp_size * batch_size * accum blocks; a step is `accum` global batches
    of dp_size * batch_size, and rank r takes its slice of every global batch. The
    leftover that does not fill a whole step is skipped, so every rank does the
    same number of steps, and an epoch ends between steps, never inside one: a
    step is the same chunk of blocks whatever the layout splits it into (ranks,
    micro-batches, accumulation, pipeline micro-batches). The position, in global
    batches, is checkpointed.
    """

    def __init__(
        self, num_blocks: int, batch_size: int, dp_rank: int, dp_size: int, seed: int, accum: int = 1
    ) -> None:
        self.num_blocks, self.batch_size = num_blocks, batch_size
        self.dp_rank, self.dp_size, self.seed, self.accum = dp_rank, dp_size, seed, accum
        steps_per_epoch = num_blocks // (batch_size * dp_size * accum)
        self.batches_per_epoch = steps_per_epoch * accum
        if steps_per_epoch == 0:
            per_step = f"{dp_size} data-parallel ranks x {batch_size} sequences" + (
                f" x {accum} accumulated micro-batches" if accum > 1 else ""
            )
            raise UserError(
                f"dataset gives {num_blocks} training sequences, fewer than one step needs "
                f"({per_step}): lower seq_len, micro_batch or grad_accum, or add data"
            )
        self.epoch = 0
        self.position = 0  # batches of this epoch already handed out
        self._perm: torch.Tensor | None = None

    def _permutation(self) -> torch.Tensor:
        if self._perm is None:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
            self._perm = torch.randperm(self.num_blocks, generator=g)
        return self._perm

    def next_indices(self) -> torch.Tensor:
        return self.next_global_indices()[self.dp_rank]

    def next_global_indices(self) -> torch.Tensor:
        """The next global batch, (dp_size, batch_size): row r is what rank r takes.

        Every rank knows the whole batch, so what depends only on the blocks (the trained tokens a
        step normalises by) needs no collective.
        """
        if self.position >= self.batches_per_epoch:
            self.epoch, self.position, self._perm = self.epoch + 1, 0, None
        start = self.position * self.dp_size * self.batch_size
        self.position += 1
        return self._permutation()[start : start + self.dp_size * self.batch_size].view(self.dp_size, self.batch_size)

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position}

    @property
    def blocks_per_batch(self) -> int:
        """The unit of `position`: blocks in one global batch of this layout."""
        return self.batch_size * self.dp_size

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.position, self._perm = int(state["epoch"]), int(state["position"]), None

    def resumed(self, written_blocks_per_batch: int | None) -> None:
        """After load_state_dict from a checkpoint whose layout cut `written_blocks_per_batch` blocks per
        global batch (None: unknown, an older checkpoint: taken as this one's): continue at the same block.

        A position that falls inside a step, in this layout's steps, starts the next epoch instead (an older
        Rigpilot ended epochs per micro-batch, so inside a step), so steps and epochs line up from here on.
        """
        blocks = self.position * (written_blocks_per_batch or self.blocks_per_batch)
        per_step = self.blocks_per_batch * self.accum
        if blocks % per_step:
            self.epoch, self.position = self.epoch + 1, 0
        else:
            self.position = blocks // self.blocks_per_batch


def eval_batches(
    blocks: torch.Tensor, batch_size: int, dp_rank: int, dp_size: int, trained: torch.Tensor | None = None
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's share of the eval blocks as (blocks, trained mask) batches, always batch_size rows.

    Every rank gets the same number of batches (the collectives inside a forward pass need that) and
    every batch is full (a pipeline schedule splits exactly the batch it was built for): the last
    global batch is filled up with copies of the last block whose mask is all False, so a loss
    normalised by the trained tokens ignores them. `trained` is the blocks' own mask (None: every
    token is trained).
    """
    n = blocks.shape[0]
    if n == 0:
        return
    mask = trained if trained is not None else torch.ones(blocks.shape, dtype=torch.bool)
    per_rank = min(-(-n // (batch_size * dp_size)), MAX_EVAL_BATCHES)
    for b in range(per_rank):
        start = (b * dp_size + dp_rank) * batch_size
        rows = torch.arange(start, start + batch_size)
        real = rows < n
        rows = rows.clamp(max=n - 1)
        yield blocks[rows], mask[rows] & real.unsqueeze(1)


def mask_for_mlm(
    block: torch.Tensor,
    mask_id: int,
    vocab_size: int,
    special_ids: list[int],
    generator: torch.Generator,
    prob: float = 0.15,
) -> tuple[torch.Tensor, torch.Tensor]:
    """BERT's masking: (inputs, labels). 15% of tokens are predicted; of those 80% become [MASK], 10% random, 10% kept."""
    labels = block.clone()
    chance = torch.full(block.shape, prob)
    if special_ids:
        chance[torch.isin(block, torch.tensor(special_ids))] = 0.0
    picked = torch.bernoulli(chance, generator=generator).bool()
    labels[~picked] = -100
    inputs = block.clone()
    to_mask = torch.bernoulli(torch.full(block.shape, 0.8), generator=generator).bool() & picked
    inputs[to_mask] = mask_id
    to_random = torch.bernoulli(torch.full(block.shape, 0.5), generator=generator).bool() & picked & ~to_mask
    inputs[to_random] = torch.randint(vocab_size, block.shape, generator=generator)[to_random]
    return inputs, labels
