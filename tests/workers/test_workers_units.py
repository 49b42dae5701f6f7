"""The worker's pieces in one process: mesh arithmetic, data, schedules, model loading, pipeline stages.

The multi-rank jobs themselves are in test_workers_jobs.py.
"""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import pytest
import torch

from rigpilot.engine.errors import UserError
from rigpilot.engine.jobspec.spec import Parallelism
from rigpilot.engine.workers.data import (
    Document,
    ShardedBatches,
    build_dataset,
    eval_batches,
    mask_for_mlm,
    pack,
    read_dataset,
    read_documents,
    render_chat,
    tokenize_document,
)
from rigpilot.engine.workers.parallel_dims import ParallelDims
from rigpilot.engine.workers.train import lr_lambda

from support.paths import REPO

TINY_LLAMA = REPO / "examples" / "models" / "tiny-llama"
SHAKESPEARE = REPO / "examples" / "data" / "shakespeare.txt"


# --- parallel dims --------------------------------------------------------------------------------


def test_parallel_dims_rejects_a_layout_that_does_not_fill_the_world() -> None:
    with pytest.raises(UserError, match=r"tp 4 × pp 1 = 8\) must multiply to the number of ranks \(4\)") as e:
        ParallelDims.from_layout(Parallelism(dp_shard=2, tp=4), world_size=4)
    assert e.value.reason == "bad_layout" and (e.value.fields["product"], e.value.fields["ranks"]) == (8, 4)


def test_coordinates_follow_the_mesh_order_with_tp_innermost() -> None:
    dims = ParallelDims.from_layout(Parallelism(pp=2, dp_replicate=1, dp_shard=2, tp=2), world_size=8)
    grid = torch.arange(8).view(dims.shape)  # init_device_mesh lays ranks out row-major like this
    for rank in range(8):
        c = dims.coordinate(rank)
        assert grid[c["pp"], c["dp_replicate"], c["dp_shard"], c["tp"]] == rank
    assert [dims.dp_rank(r) for r in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]
    assert dims.dp == 2 and dims.non_dp == 4


# --- data -----------------------------------------------------------------------------------------


def test_jsonl_formats_become_documents(tmp_path: Path) -> None:
    f = tmp_path / "mixed.jsonl"
    rows = [
        {"text": "plain"},
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]},
        {"instruction": "Add.", "input": "1 2", "output": "3"},
    ]
    f.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    docs = read_documents(f)
    assert docs[0] == Document(text="plain")
    assert docs[1].messages == rows[1]["messages"]
    assert docs[2].messages == [{"role": "user", "content": "Add.\n1 2"}, {"role": "assistant", "content": "3"}]


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("", r"dataset .*empty\.jsonl is empty"),
        ('{"text": "ok"}\n{broken\n', r"line 2: not valid JSON"),
        ('{"body": "x"}\n', r"line 1: no 'text' text field, 'messages' list or 'instruction'"),
        ('{"messages": []}\n', r"line 1: 'messages' must be a non-empty list"),
    ],
)
def test_bad_jsonl_gives_one_clear_line(tmp_path: Path, content: str, message: str) -> None:
    f = tmp_path / "empty.jsonl"
    f.write_text(content)
    with pytest.raises(UserError, match=message):
        read_documents(f)


def test_missing_and_unsupported_datasets(tmp_path: Path) -> None:
    with pytest.raises(UserError, match=r"dataset .*nope\.txt not found"):
        read_dataset([str(tmp_path / "nope.txt")], "text")
    (tmp_path / "data.parquet").write_bytes(b"PAR1")
    with pytest.raises(UserError, match=r"unsupported format \.parquet"):
        read_dataset([str(tmp_path / "data.parquet")], "text")
    with pytest.raises(UserError, match="no dataset given"):
        read_dataset([], "text")


class _Tok:
    """The slice of a tokenizer the data code uses: one id per character."""

    eos_token, eos_token_id, sep_token_id, chat_template = "</s>", 1, None, None

    def __call__(self, text: str, add_special_tokens: bool = True, verbose: bool = True) -> dict:
        return {"input_ids": [2 + ord(c) % 250 for c in text]}


def test_chat_falls_back_to_a_plain_template_without_one() -> None:
    text = render_chat([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}], _Tok())
    assert text == "<|user|>\nhi</s>\n<|assistant|>\nyo</s>\n"


CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Name a colour."},
    {"role": "assistant", "content": "Blue."},
    {"role": "user", "content": "Another?"},
    {"role": "assistant", "content": "Green."},
]


@pytest.mark.parametrize("template", ["model", "fallback"])
def test_chat_answers_alone_are_trained_unless_prompts_are_asked_for(template: str) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(TINY_LLAMA) if template == "model" else _Tok()
    doc = Document(messages=CHAT)
    t = tokenize_document(doc, tok, train_on_prompts=False)
    assert len(t.ids) == len(t.trained) and not t.unmaskable
    def decode(ids: list[int]) -> str:
        if template == "model":
            return tok.decode(ids)
        return "".join("</s>" if i == tok.eos_token_id else chr(i - 2) for i in ids)

    # The trained spans are exactly the two answers.
    spans, run = [], []
    for token, trained in zip(t.ids, t.trained, strict=True):
        if trained:
            run.append(token)
        elif run:
            spans.append(run)
            run = []
    spans += [run] if run else []
    # Each answer is trained with its end-of-turn marker (the model must learn where to stop); the last
    # one also with the end-of-sequence token that separates packed documents.
    texts = [decode(span) for span in spans]
    assert [re.sub(r"(\s*</s>)+\s*$", "", t).strip() for t in texts] == ["Blue.", "Green."]
    assert all("</s>" in t for t in texts)
    assert "Name a colour." in decode([i for i, k in zip(t.ids, t.trained, strict=True) if not k])
    everything = tokenize_document(doc, tok, train_on_prompts=True)
    assert everything.ids == t.ids and all(everything.trained)


def test_a_template_that_does_not_render_turn_by_turn_trains_the_whole_chat() -> None:
    class Reordering(_Tok):
        chat_template = "reversed"

        def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=False):
            return "|".join(m["content"] for m in reversed(messages)) + ("|A:" if add_generation_prompt else "")

    t = tokenize_document(Document(messages=CHAT), Reordering(), train_on_prompts=False)
    assert t.unmaskable and all(t.trained)


def test_masked_prompts_become_ignored_labels_and_an_all_prompt_batch_costs_nothing(tmp_path: Path) -> None:
    from rigpilot.engine.workers.train import token_loss

    f = tmp_path / "chat.jsonl"
    f.write_text("\n".join(json.dumps({"messages": CHAT}) for _ in range(40)) + "\n")
    files, docs = read_dataset([str(f)], "text")
    data = build_dataset(files, docs, _Tok(), block_len=33, eval_fraction=0.1, seed=5, train_on_prompts=False)
    assert data.train_trained is not None and data.train_trained.shape == data.train.shape
    assert data.eval_trained is not None and data.eval_trained.shape == data.eval.shape
    assert 0 < data.trained_tokens < data.num_tokens
    whole = build_dataset(files, docs, _Tok(), block_len=33, eval_fraction=0.1, seed=5, train_on_prompts=True)
    assert whole.train_trained is None and torch.equal(whole.train, data.train)  # same blocks, same split

    logits = torch.randn(2, 5, 7, requires_grad=True)
    labels = torch.tensor([[1, -100, 2, -100, 3], [-100] * 5])
    expected = torch.nn.functional.cross_entropy(logits.flatten(0, 1)[labels.flatten() != -100],
                                                 labels.flatten()[labels.flatten() != -100], reduction="sum")  # fmt: skip
    assert torch.allclose(token_loss(logits, labels), expected)  # a sum: train.py divides by the global count
    nothing = token_loss(logits, torch.full((2, 5), -100))
    nothing.backward()
    assert nothing.item() == 0.0 and logits.grad is not None and not logits.grad.any()

    only_prompts = tmp_path / "prompts.jsonl"
    only_prompts.write_text(json.dumps({"messages": [{"role": "user", "content": "hi " * 40}]}) + "\n")
    files, docs = read_dataset([str(only_prompts)], "text")
    with pytest.raises(UserError, match="no assistant answers to train on, only prompts"):
        build_dataset(files, docs, _Tok(), block_len=8, eval_fraction=0.0, seed=0, train_on_prompts=False)


def test_packing_split_and_sharding_are_deterministic_and_disjoint(tmp_path: Path) -> None:
    assert pack(list(range(10)), 4).tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    files, docs = read_dataset([str(SHAKESPEARE)], "text")
    data = build_dataset(files, docs, _Tok(), block_len=33, eval_fraction=0.1, seed=5)
    again = build_dataset(files, docs, _Tok(), block_len=33, eval_fraction=0.1, seed=5)
    assert torch.equal(data.train, again.train) and torch.equal(data.eval, again.eval)
    assert len(data.eval) == round((len(data.train) + len(data.eval)) * 0.1)
    train_rows = {tuple(r) for r in data.train.tolist()}
    assert not train_rows & {tuple(r) for r in data.eval.tolist()}

    # Two data-parallel ranks see disjoint blocks within an epoch; every rank gets the same number of batches.
    ranks = [ShardedBatches(len(data.train), 4, r, 2, seed=5) for r in range(2)]
    seen = [torch.cat([s.next_indices() for _ in range(s.batches_per_epoch)]) for s in ranks]
    assert not set(seen[0].tolist()) & set(seen[1].tolist())
    assert len(seen[0]) == len(seen[1]) == ranks[0].batches_per_epoch * 4

    # The position round-trips through state_dict, across an epoch boundary too.
    a = ShardedBatches(len(data.train), 4, 0, 2, seed=5)
    for _ in range(a.batches_per_epoch + 3):
        a.next_indices()
    b = ShardedBatches(len(data.train), 4, 0, 2, seed=5)
    b.load_state_dict(a.state_dict())
    assert torch.equal(a.next_indices(), b.next_indices())

    per_rank = [list(eval_batches(data.eval, 2, r, 2)) for r in range(2)]
    assert len(per_rank[0]) == len(per_rank[1]) > 0


def test_every_rank_knows_every_replicas_batch_so_the_step_needs_no_count_collective() -> None:
    # The loop counts the global batch's trained tokens from these rows instead of all-reducing them.
    ranks = [ShardedBatches(22, 3, r, 3, seed=7) for r in range(3)]
    whole = ShardedBatches(22, 3, 1, 3, seed=7)
    for _ in range(2 * whole.batches_per_epoch + 1):  # across epoch boundaries
        rows = whole.next_global_indices()
        assert rows.shape == (3, 3)
        assert [rows[r].tolist() for r in range(3)] == [s.next_indices().tolist() for s in ranks]
    assert whole.state_dict() == ranks[1].state_dict()


def test_every_layout_of_a_step_takes_the_same_blocks_in_every_epoch() -> None:
    # 23 blocks, 4 per step: 5 steps an epoch and 3 left over. Whether a step is one batch of 4, two
    # accumulated batches of 2 or four of 1 over 2 ranks, its blocks are the same chunk of the
    # epoch's permutation, also after an epoch boundary (the old per-micro-batch epoch did not).
    def steps(batch_size: int, dp: int, accum: int, count: int) -> list[list[int]]:
        ranks = [ShardedBatches(23, batch_size, r, dp, seed=3, accum=accum) for r in range(dp)]
        return [
            sorted(i for _ in range(accum) for s in ranks for i in s.next_indices().tolist()) for _ in range(count)
        ]

    whole = steps(4, 1, 1, 12)
    assert steps(2, 1, 2, 12) == whole
    assert steps(1, 2, 2, 12) == whole
    assert steps(1, 1, 4, 12) == whole
    epoch0 = torch.randperm(23, generator=torch.Generator().manual_seed(3 * 1_000_003))
    epoch1 = torch.randperm(23, generator=torch.Generator().manual_seed(3 * 1_000_003 + 1))
    assert whole[4] == sorted(epoch0[16:20].tolist()) and whole[5] == sorted(epoch1[:4].tolist())
    with pytest.raises(UserError, match="x 3 accumulated micro-batches"):
        ShardedBatches(5, 1, 0, 2, seed=0, accum=3)
    # A position an older Rigpilot saved inside a step (its epoch ended per micro-batch) starts the next
    # epoch, so steps and epochs line up from then on.
    old = ShardedBatches(23, 2, 0, 1, seed=3, accum=2)
    old.load_state_dict({"epoch": 1, "position": 11})
    old.resumed(None)
    assert old.state_dict() == {"epoch": 2, "position": 0}
    old.load_state_dict({"epoch": 1, "position": 4})
    old.resumed(None)
    assert old.state_dict() == {"epoch": 1, "position": 4}
    # Another layout's position is counted in its own global batches: the resume continues at its block.
    whole = ShardedBatches(23, 1, 0, 1, seed=3, accum=4)
    for _ in range(4 * 6):  # six steps: one epoch of five, and one step into the next
        whole.next_indices()
    split = ShardedBatches(23, 1, 0, 2, seed=3, accum=2)
    split.load_state_dict(whole.state_dict())
    split.resumed(whole.blocks_per_batch)
    assert split.state_dict() == {"epoch": 1, "position": 2}
    def next_step(sampler: ShardedBatches) -> list[int]:
        return sorted(i for _ in range(sampler.accum) for i in sampler.next_global_indices().flatten().tolist())

    assert next_step(split) == next_step(whole)


def test_clipping_stays_on_the_device_and_matches_torch() -> None:
    from rigpilot.engine.workers.train import clip_grad_norm

    torch.manual_seed(0)
    ours = [torch.nn.Parameter(torch.randn(5, 3)), torch.nn.Parameter(torch.randn(4))]
    theirs = copy.deepcopy(ours)
    for p in [*ours, *theirs]:
        p.grad = torch.full_like(p, 2.0)
    norm = clip_grad_norm(ours, 1.0, None)
    assert isinstance(norm, torch.Tensor) and norm.dim() == 0
    assert torch.allclose(norm, torch.nn.utils.clip_grad_norm_(theirs, 1.0))
    for a, b in zip(ours, theirs, strict=True):
        assert torch.allclose(a.grad, b.grad) and not torch.equal(a.grad, torch.full_like(a, 2.0))
    below = [torch.nn.Parameter(torch.zeros(3))]
    below[0].grad = torch.tensor([0.1, 0.2, 0.2])
    clip_grad_norm(below, 1.0, None)
    assert torch.equal(below[0].grad, torch.tensor([0.1, 0.2, 0.2]))  # under the limit: untouched
    broken = [torch.nn.Parameter(torch.zeros(2))]
    broken[0].grad = torch.tensor([float("inf"), 1.0])
    assert not torch.isfinite(clip_grad_norm(broken, 1.0, None))
    assert broken[0].grad[1] == 1.0  # a non-finite norm is reported, not applied


def test_a_window_of_step_sums_lands_as_a_future_outside_a_process_group() -> None:
    from rigpilot.engine.workers.metrics import window_sums_async

    cpu = torch.device("cpu")
    shares = [torch.tensor(2.5, dtype=torch.float64), torch.tensor(1.25, dtype=torch.float64)]
    sums = window_sums_async(shares, False, 0.5, cpu).wait()
    assert (sums.losses, sums.flag, sums.seconds) == ([2.5, 1.25], False, 0.5)
    sums = window_sums_async([None, None], True, 0.0, cpu).wait()
    assert (sums.losses, sums.flag) == ([None, None], True)


def test_eval_batches_are_full_and_cover_every_block_once_whatever_the_split() -> None:
    # A pipeline schedule is built for exactly batch_size sequences: a partial batch used to crash it.
    blocks = torch.arange(3 * 4).reshape(3, 4)
    per_rank = [list(eval_batches(blocks, 8, r, 2)) for r in range(2)]
    assert [len(b) for b in per_rank] == [1, 1]  # the same count on every rank, or the collectives would hang
    assert all(rows.shape == (8, 4) and mask.shape == (8, 4) for b in per_rank for rows, mask in b)
    real = [rows[mask.all(1)] for b in per_rank for rows, mask in b]
    assert torch.equal(torch.cat(real), blocks)  # padding rows carry no trained token
    assert int(sum(mask.sum() for b in per_rank for _, mask in b)) == blocks.numel()

    # A block's own mask (chat prompts) is kept; 7 blocks over 2 ranks x batches of 2: two rounds, one padded row.
    blocks = torch.arange(7 * 4).reshape(7, 4)
    trained = torch.rand(7, 4, generator=torch.Generator().manual_seed(0)) > 0.5
    per_rank = [list(eval_batches(blocks, 2, r, 2, trained)) for r in range(2)]
    assert [len(b) for b in per_rank] == [2, 2]
    # In global order (batch by batch, rank by rank): the blocks with their masks, then one padding row.
    rows = torch.cat([per_rank[r][b][0] for b in range(2) for r in range(2)])
    masks = torch.cat([per_rank[r][b][1] for b in range(2) for r in range(2)])
    assert torch.equal(rows[:7], blocks) and torch.equal(masks[:7], trained) and not masks[7].any()
    assert list(eval_batches(blocks[:0], 2, 0, 2)) == []


def test_too_little_data_says_what_to_change(tmp_path: Path) -> None:
    f = tmp_path / "tiny.txt"
    f.write_text("short")
    files, docs = read_dataset([str(f)], "text")
    with pytest.raises(UserError, match="fewer than one training sequence of 65: lower seq_len"):
        build_dataset(files, docs, _Tok(), block_len=65, eval_fraction=0.0, seed=0)
    with pytest.raises(UserError, match="fewer than one step needs"):
        ShardedBatches(3, 2, 0, 2, seed=0)


def test_mlm_masking_predicts_about_15_percent_and_never_special_tokens() -> None:
    block = torch.randint(10, 100, (8, 64))
    block[:, 0] = 1  # a special token
    g = torch.Generator().manual_seed(0)
    inputs, labels = mask_for_mlm(block, mask_id=5, vocab_size=100, special_ids=[1], generator=g)
    picked = labels != -100
    assert 0.08 < picked.float().mean() < 0.22
    assert not picked[:, 0].any()
    assert torch.equal(labels[picked], block[picked])
    assert (inputs[picked] == 5).float().mean() > 0.6
    assert torch.equal(inputs[~picked], block[~picked])


def test_lr_warms_up_then_decays_by_cosine() -> None:
    f = lr_lambda(warmup_steps=4, max_steps=20)
    warm = [f(s) for s in range(4)]
    assert warm == sorted(warm) and warm[0] > 0 and f(4) == pytest.approx(1.0)
    decay = [f(s) for s in range(4, 21)]
    assert decay == sorted(decay, reverse=True) and decay[-1] == pytest.approx(0.1)


# --- models ---------------------------------------------------------------------------------------


def test_model_sources_fail_with_clear_lines(tmp_path: Path) -> None:
    from rigpilot.engine.workers.model_loading import resolve_source

    with pytest.raises(UserError, match=r"not found"):
        resolve_source(str(tmp_path / "missing"))
    (tmp_path / "m").mkdir()
    with pytest.raises(UserError, match=r"has no config\.json"):
        resolve_source(str(tmp_path / "m"))
    (tmp_path / "m" / "config.json").write_text("{not json")
    with pytest.raises(UserError, match=r"corrupt config\.json"):
        resolve_source(str(tmp_path / "m"))
    src = resolve_source(str(TINY_LLAMA / "config.json"))
    assert src.kind == "config" and not src.has_weights


@pytest.fixture(scope="module")
def tiny_llama() -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.from_pretrained(TINY_LLAMA, initializer_range=0.3)
    return AutoModelForCausalLM.from_config(config).eval()


def test_objective_and_lora_targets_come_from_the_model(tiny_llama: torch.nn.Module) -> None:
    import re

    from rigpilot.engine.workers.model_loading import count_params, default_lora_targets, detect_objective

    assert detect_objective(tiny_llama.config) == "causal"
    pattern = default_lora_targets(tiny_llama)
    matched = {n.rsplit(".", 1)[-1] for n, _ in tiny_llama.named_modules() if re.fullmatch(pattern, n)}
    assert matched == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    assert not re.fullmatch(pattern, "lm_head")
    counts = count_params(tiny_llama)
    assert counts["compute"] == counts["total"] - tiny_llama.get_input_embeddings().weight.numel()


def test_pipeline_stages_compute_what_the_whole_model_does(tiny_llama: torch.nn.Module) -> None:
    from rigpilot.engine.workers.pipeline import DecoderStage, decoder_parts, stage_layer_ranges

    assert stage_layer_ranges(5, 2) == [(0, 3), (3, 5)]
    with pytest.raises(UserError, match="at least 3 layers"):
        stage_layer_ranges(2, 3)
    ids = torch.randint(0, 512, (2, 16))
    with torch.no_grad():
        expected = tiny_llama(input_ids=ids).logits
        stages = [DecoderStage(decoder_parts(copy.deepcopy(tiny_llama), "pp"), i, 2) for i in range(2)]
        got = stages[1](stages[0](ids))
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    # The stages keep the model's own parameter names, so their checkpoints merge into the whole model.
    names = [n for s in stages for n, _ in s.named_parameters()]
    assert sorted(names) == sorted(n for n, _ in tiny_llama.named_parameters())
    assert not {n for n, _ in stages[0].named_parameters()} & {n for n, _ in stages[1].named_parameters()}


@pytest.mark.parametrize("padded", [True, False], ids=["padded", "unpadded"])
def test_a_stage_s_decode_mask_is_the_one_transformers_builds(tiny_llama: torch.nn.Module, padded: bool) -> None:
    """A decode step's mask, built without create_causal_mask, equals what it would build (None included)."""
    from transformers import DynamicCache
    from transformers.masking_utils import create_causal_mask

    from rigpilot.engine.workers.pipeline import DecoderStage, decoder_parts

    stage = DecoderStage(decoder_parts(copy.deepcopy(tiny_llama), "pp"), 1, 2)
    mask = torch.ones(3, 7, dtype=torch.long)
    if padded:
        mask[0, :4] = 0
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    cache = DynamicCache(config=tiny_llama.config)
    with torch.no_grad():
        stage(torch.randn(3, 7, 64), attention_mask=mask, position_ids=positions, past_key_values=cache)
    mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
    hidden, positions = torch.randn(3, 1, 64), positions[:, -1:] + 1
    built = stage._masks(hidden, mask, positions, cache)["full_attention"]
    expected = create_causal_mask(tiny_llama.config, hidden, mask, cache, positions, layer_idx=stage.first_layer)
    assert (built is None) == (expected is None) == (not padded)
    if padded:
        assert torch.equal(built, expected)


def test_pipeline_refuses_non_llama_models() -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    from rigpilot.engine.workers.pipeline import decoder_parts

    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64))
    with pytest.raises(UserError, match="pipeline parallel supports Llama-style decoders"):
        decoder_parts(gpt2, "pipeline parallel")


def test_sampling_is_seeded_and_greedy_is_argmax() -> None:
    from rigpilot.engine.workers.infer import select_tokens

    logits = torch.randn(4, 50)
    g = torch.Generator().manual_seed(3)
    assert torch.equal(select_tokens(logits, 0.0, 1.0, g), logits.argmax(-1))
    a = select_tokens(logits, 0.8, 0.9, torch.Generator().manual_seed(3))
    b = select_tokens(logits, 0.8, 0.9, torch.Generator().manual_seed(3))
    assert torch.equal(a, b)
    # top_p that small keeps only the most likely token.
    assert torch.equal(select_tokens(logits, 1.0, 1e-6, g), logits.argmax(-1))


def test_prefill_computes_the_last_positions_logits_only_and_generates_as_transformers(
    tiny_llama: torch.nn.Module,
) -> None:
    """One rank's Generator: the head sees (batch, 1, hidden) at every step, and greedy text equals generate()'s."""
    from types import SimpleNamespace

    from transformers import AutoTokenizer

    from rigpilot.engine.jobspec.spec import InferSettings
    from rigpilot.engine.workers.infer import Generator

    tok = AutoTokenizer.from_pretrained(TINY_LLAMA)
    tok.padding_side = "left"
    one = SimpleNamespace(mesh=torch.tensor([0]))
    runtime = SimpleNamespace(
        dims=ParallelDims(1, 1, 1, 1, 1), mesh={"pp": one, "tp": one}, pp_rank=0, device=torch.device("cpu")
    )
    settings = InferSettings(max_new_tokens=6, batch_size=3, precision="fp32")
    gen = Generator(runtime, tiny_llama, tok, tiny_llama.config, settings, torch.float32)  # type: ignore[arg-type]
    prompts = ["Shall I compare thee", "O", "Now is the winter of our discontent"]
    heads: list[tuple[int, ...]] = []
    hook = tiny_llama.lm_head.register_forward_hook(lambda m, i, o: heads.append(tuple(o.shape)))
    try:
        tokens = gen.generate(prompts).tokens
    finally:
        hook.remove()
    vocab = tiny_llama.config.vocab_size
    assert heads and all(shape == (3, 1, vocab) for shape in heads), heads  # the prefill's included
    enc = tok(prompts, return_tensors="pt", padding=True)
    with torch.no_grad():
        ref = tiny_llama.generate(**enc, max_new_tokens=6, do_sample=False, pad_token_id=tok.pad_token_id)
    expected = [r[: r.index(tok.eos_token_id) + 1] if tok.eos_token_id in r else r
                for r in ref[:, enc["input_ids"].shape[1] :].tolist()]  # fmt: skip
    assert tokens == expected


def test_a_pipeline_keeps_as_many_micro_batches_in_flight_as_stages() -> None:
    """Batches stay whole (generate()'s own batches) when there are enough; else they are cut into parts."""
    from types import SimpleNamespace

    from rigpilot.engine.jobspec.spec import InferSettings
    from rigpilot.engine.workers.infer import Generator

    def micro_batches(pp: int, prompts: int, batch: int) -> list[tuple[int, list[int]]]:
        mesh = SimpleNamespace(mesh=torch.arange(pp))
        runtime = SimpleNamespace(dims=ParallelDims(pp, 1, 1, 1, pp), mesh={"pp": mesh, "tp": SimpleNamespace(
            mesh=torch.tensor([0]))}, pp_rank=0, device=torch.device("cpu"))  # fmt: skip
        tok = SimpleNamespace(eos_token_id=1, pad_token_id=2)
        gen = Generator(runtime, torch.nn.Identity(), tok, None, InferSettings(), torch.float32)  # type: ignore[arg-type]
        return gen._micro_batches(["p"] * prompts, batch)

    assert micro_batches(1, 5, 2) == [(0, [0, 1]), (1, [2, 3]), (2, [4])]
    assert micro_batches(2, 5, 2) == [(0, [0, 1]), (1, [2, 3]), (2, [4])]
    assert micro_batches(2, 5, 5) == [(0, [0, 1, 2]), (0, [3, 4])]
    assert micro_batches(4, 6, 4) == [(0, [0, 1]), (0, [2, 3]), (1, [4]), (1, [5])]
    assert micro_batches(4, 1, 8) == [(0, [0])]


def test_a_pipeline_runs_one_more_micro_batch_than_stages_when_it_has_whole_ones() -> None:
    from types import SimpleNamespace

    from rigpilot.engine.jobspec.spec import InferSettings
    from rigpilot.engine.workers.infer import Generator

    def in_flight(pp: int, micro_batches: int) -> int:
        mesh = SimpleNamespace(mesh=torch.arange(pp))
        runtime = SimpleNamespace(dims=ParallelDims(pp, 1, 1, 1, pp), mesh={"pp": mesh, "tp": SimpleNamespace(
            mesh=torch.tensor([0]))}, pp_rank=0, device=torch.device("cpu"))  # fmt: skip
        tok = SimpleNamespace(eos_token_id=1, pad_token_id=2)
        gen = Generator(runtime, torch.nn.Identity(), tok, None, InferSettings(), torch.float32)  # type: ignore[arg-type]
        return gen._in_flight(micro_batches)

    assert [in_flight(1, n) for n in (1, 3)] == [1, 1]  # one stage runs batch after batch, as generate()
    assert [in_flight(2, n) for n in (1, 2, 3, 6)] == [1, 2, 3, 3]
    assert [in_flight(4, n) for n in (4, 5, 9)] == [4, 5, 5]


def test_a_pipeline_prefills_in_chunks_that_attend_to_the_cache_before_them() -> None:
    """Pipeline stages take a long prompt in chunks (the mask grows with them); one stage takes it whole."""
    from types import SimpleNamespace

    from rigpilot.engine.jobspec.spec import InferSettings
    from rigpilot.engine.workers.infer import PREFILL_CHUNK, Generator

    def chunks(pp: int, length: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        mesh = SimpleNamespace(mesh=torch.arange(pp))
        runtime = SimpleNamespace(dims=ParallelDims(pp, 1, 1, 1, pp), mesh={"pp": mesh, "tp": SimpleNamespace(
            mesh=torch.tensor([0]))}, pp_rank=0, device=torch.device("cpu"))  # fmt: skip
        tok = SimpleNamespace(eos_token_id=1, pad_token_id=2)
        gen = Generator(runtime, torch.nn.Identity(), tok, None, InferSettings(), torch.float32)  # type: ignore[arg-type]
        ids = torch.arange(2 * length).view(2, length)
        mask = torch.ones_like(ids)
        mask[1, :3] = 0  # left padding
        return gen._prefill_chunks(ids, mask, (mask.cumsum(-1) - 1).clamp(min=0))

    length = 2 * PREFILL_CHUNK + 5
    whole = chunks(1, length)
    assert len(whole) == 1 and whole[0][0].shape == (2, length)
    parts = chunks(2, length)
    assert [c[0].shape[1] for c in parts] == [PREFILL_CHUNK, PREFILL_CHUNK, 5]
    assert [c[1].shape[1] for c in parts] == [PREFILL_CHUNK, 2 * PREFILL_CHUNK, length]  # the keys so far
    assert torch.equal(torch.cat([c[0] for c in parts], dim=1), whole[0][0])
    assert torch.equal(torch.cat([c[2] for c in parts], dim=1), whole[0][2])
    assert torch.equal(parts[-1][1], whole[0][1])
    assert len(chunks(2, PREFILL_CHUNK)) == 1


# --- the entry point's error contract -------------------------------------------------------------


def _run_main(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, error: BaseException) -> int:
    from rigpilot.engine.jobspec.spec import JobSpec
    from rigpilot.engine.workers import __main__ as worker

    JobSpec(id="x", kind="infer").write(tmp_path)
    monkeypatch.setenv("RIGPILOT_METRICS_DIR", str(tmp_path / "metrics"))
    monkeypatch.delenv("RANK", raising=False)

    def fails(spec: JobSpec, job_dir: Path) -> int:
        raise error

    monkeypatch.setattr(worker, "run", fails)
    return worker.main([str(tmp_path)])


def _last_record(tmp_path: Path) -> dict:
    return json.loads((tmp_path / "metrics" / "rank0.jsonl").read_text().splitlines()[-1])


def test_out_of_memory_has_its_own_exit_code_and_report(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    from rigpilot.engine.workers import ERROR_PREFIX, EXIT_OUT_OF_MEMORY

    oom = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB\nmore detail")
    assert _run_main(tmp_path, monkeypatch, oom) == EXIT_OUT_OF_MEMORY
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last == f"{ERROR_PREFIX} out of GPU memory: CUDA out of memory. Tried to allocate 2.00 GiB"
    record = _last_record(tmp_path)
    assert record["kind"] == "error" and record["error"] == "out_of_memory"


def test_a_crash_ends_with_its_first_meaningful_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    from rigpilot.engine.workers import ERROR_PREFIX, EXIT_CRASH

    assert _run_main(tmp_path, monkeypatch, RuntimeError("\n   stage 0 failed\n details")) == EXIT_CRASH
    err = capsys.readouterr().err
    assert "Traceback" in err  # a bug keeps its traceback, above the one line
    assert err.strip().splitlines()[-1] == f"{ERROR_PREFIX} RuntimeError: stage 0 failed"
    assert _last_record(tmp_path)["error"] == "crash"


def test_a_folder_without_job_json_is_a_user_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    from rigpilot.engine.workers import EXIT_USER_ERROR
    from rigpilot.engine.workers.__main__ import main

    monkeypatch.setenv("RIGPILOT_METRICS_DIR", str(tmp_path / "metrics"))
    assert main([str(tmp_path)]) == EXIT_USER_ERROR
    assert capsys.readouterr().err.strip().endswith("job.json not found: not a job folder")


def test_train_settings_are_checked_before_anything_loads() -> None:
    from rigpilot.engine.jobspec.spec import TrainSettings
    from rigpilot.engine.workers.train import validate_settings

    validate_settings(TrainSettings())
    for bad, message in [
        ({"micro_batch": 0}, "out_of_range"),
        ({"eval_fraction": 1.0}, "out_of_range"),
        ({"method": "dora"}, "not_a_choice"),
        ({"activation_checkpointing": "some"}, "not_a_choice"),
        ({"precision": "fp8"}, "not_a_choice"),
        ({"keep_checkpoints": -1}, "out_of_range"),
    ]:
        with pytest.raises(UserError) as caught:
            validate_settings(TrainSettings(**bad))
        assert caught.value.reason == message and caught.value.fields["setting"] == "train." + next(iter(bad))


def test_old_checkpoints_are_pruned_to_the_newest_few(tmp_path: Path) -> None:
    from rigpilot.engine.workers.checkpoint import COMPLETE, latest_checkpoint, prune_checkpoints

    folder = tmp_path / "checkpoints"
    for step in (10, 20, 30, 40):
        (folder / f"step-{step}").mkdir(parents=True)
        (folder / f"step-{step}" / COMPLETE).write_text("{}")
    (folder / "step-25.tmp").mkdir()  # a save a kill interrupted
    (folder / "step-35").mkdir()  # renamed but never declared complete
    (folder / "step-50.tmp").mkdir()  # being written right now by a later save: not ours to touch
    (folder / "notes").mkdir()
    assert prune_checkpoints(folder, 0) == [] and len(list(folder.iterdir())) == 8
    removed = prune_checkpoints(folder, 2)
    assert sorted(p.name for p in removed) == ["step-10", "step-20", "step-25.tmp", "step-35"]
    assert sorted(p.name for p in folder.iterdir()) == ["notes", "step-30", "step-40", "step-50.tmp"]
    assert latest_checkpoint(folder) == folder / "step-40"
    assert prune_checkpoints(tmp_path / "none", 3) == []


def test_ddp_resends_buffers_only_for_models_whose_training_changes_them(tiny_llama: torch.nn.Module) -> None:
    from rigpilot.engine.workers.parallelize import has_trained_buffers

    # Rotary tables are constants, not saved: no per-step broadcast. BatchNorm's statistics are saved state.
    assert any(True for _ in tiny_llama.buffers()) and not has_trained_buffers(tiny_llama)
    assert has_trained_buffers(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2)))
