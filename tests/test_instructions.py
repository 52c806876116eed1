"""Instruction tasks: loading (cl500 name, folder, file), errors, validation split, answer-only encoding
with left truncation, and the mixing sampler with exact resume (offline)."""
import csv
import json

import pytest
import torch
from tiny_lm import tiny_tokenizer

from forgetless.data import instructions
from forgetless.data.instructions import (CL500_ENV, Example, InstructionSampler, encode, load_task, prompt_ids,
                                          text_ids, validation_split)
from forgetless.errors import ForgetlessError


@pytest.fixture(autouse=True)
def datasets_cache(tmp_path_factory, monkeypatch):
    """Files read by `datasets` leave their Arrow cache in a temporary folder, not the user's."""
    import datasets
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path_factory.mktemp("hf-datasets"))


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


def records(n, answer=lambda i: f"answer {i}", start=0):
    return [{"prompt": f"Question {i}: what is {i} plus one?\nAnswer:", "answer": answer(i)} for i in range(start, start + n)]


def write_json(path, data):
    path.write_text(json.dumps(data))
    return path


# ---- loading ---------------------------------------------------------------------------------
def test_cl500_task_by_name_matches_its_files():
    task = load_task("dbpedia")
    folder = instructions.cl500_root() / "dbpedia"
    train, test = (json.loads((folder / f"{p}.json").read_text()) for p in ("train", "test"))
    assert task.name == "dbpedia" and len(task.train) == len(train) == 500 and len(task.test) == len(test) == 100
    assert task.train[7] == Example(train[7]["prompt"], train[7]["answer"])
    assert task.test[-1] == Example(test[-1]["prompt"], test[-1]["answer"])
    assert task.labels == json.loads((folder / "labels.json").read_text()) and len(task.labels) == 14
    assert load_task("Lima").labels is None


def test_cl500_root_from_env_else_repository(tmp_path, monkeypatch):
    (tmp_path / "mini").mkdir()
    write_json(tmp_path / "mini" / "train.json", records(6))
    (tmp_path / "mini" / "test.jsonl").write_text("\n".join(json.dumps(r) for r in records(2, start=6)))
    monkeypatch.setenv(CL500_ENV, str(tmp_path))
    task = load_task("mini")
    assert (len(task.train), len(task.test), task.test[1].answer) == (6, 2, "answer 7")
    with pytest.raises(ForgetlessError, match=r"no cl500 task 'dbpedia' in .*; valid: mini$"):
        load_task("dbpedia")
    monkeypatch.setenv(CL500_ENV, str(tmp_path / "absent"))
    with pytest.raises(ForgetlessError, match=f"{CL500_ENV} points to .*absent, which is not a folder"):
        load_task("mini")
    monkeypatch.delenv(CL500_ENV)
    assert len(load_task("agnews").labels) == 4  # found beside the repository
    monkeypatch.setattr(instructions, "REPO_CL500", tmp_path / "nowhere")
    with pytest.raises(ForgetlessError) as e:
        load_task("agnews")
    assert f"set {CL500_ENV}" in str(e.value) and "\n" not in str(e.value)


def test_folder_of_csv_files_keeps_answers_as_text(tmp_path):
    for part, rows in {"train": [("2 + 2 =", "4"), ("capital of Namibia?", "NA")], "test": [("a, b", "07")]}.items():
        with open(tmp_path / f"{part}.csv", "w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(["id", "prompt", "answer"])
            writer.writerows([(i, p, a) for i, (p, a) in enumerate(rows)])
    task = load_task(tmp_path)
    assert task.name == tmp_path.name and task.labels is None
    assert task.train == [Example("2 + 2 =", "4"), Example("capital of Namibia?", "NA")]
    assert task.test == [Example("a, b", "07")]


@pytest.mark.parametrize("suffix", [".json", ".jsonl"])
def test_single_file_splits_off_a_deterministic_test_part(tmp_path, suffix):
    data = records(40)
    path = tmp_path / f"qa{suffix}"
    path.write_text(json.dumps(data) if suffix == ".json" else "\n".join(json.dumps(r) for r in data))
    task, again = load_task(path), load_task(str(path))
    assert task.name == "qa" and (len(task.train), len(task.test)) == (36, 4) and task == again
    train, test = {ex.answer for ex in task.train}, {ex.answer for ex in task.test}
    assert train | test == {r["answer"] for r in data} and not train & test
    assert [ex.answer for ex in task.test] != [r["answer"] for r in data[-4:]]  # picked by permutation, not the tail


def test_closed_answer_sets_become_labels_and_open_ones_do_not():
    """FOMC and C-STANCE have no labels.json but answer A / B / C: scored by label likelihood; NumGLUE's
    numbers and Lima's free text stay exact match / generation."""
    assert load_task("FOMC").labels == ["A", "B", "C"] and load_task("C-STANCE").labels == ["A", "B", "C"]
    assert load_task("NumGLUE-ds").labels is None and load_task("Lima").labels is None
    science = load_task("ScienceQA")  # letter, then the reasoning: scored by the letter's line
    assert science.labels is None and science.first_line and not load_task("FOMC").first_line
    assert not any(load_task(t).first_line for t in ("NumGLUE-ds", "Lima", "Py150"))


def test_first_line_scoring_needs_a_closed_set_of_first_lines(tmp_path):
    letter = lambda i: "AB"[i % 2] + f"\nbecause of reason {i}"  # noqa: E731
    write_json(tmp_path / "train.json", records(10, letter))
    write_json(tmp_path / "test.json", records(4, letter, start=100))
    assert load_task(tmp_path).first_line
    write_json(tmp_path / "test.json", records(4, lambda i: f"C\nbecause of {i}", start=100))  # an unseen letter
    assert not load_task(tmp_path).first_line
    write_json(tmp_path / "train.json", records(30, lambda i: f"line {i}\nmore"))  # 30 distinct first lines
    assert not load_task(tmp_path).first_line


def test_test_prompts_seen_in_training_are_left_out(tmp_path, capsys):
    write_json(tmp_path / "train.json", records(30))
    write_json(tmp_path / "test.json", records(4, start=28))           # 28 and 29 were trained on
    task = load_task(tmp_path)
    assert [ex.prompt for ex in task.test] == [r["prompt"] for r in records(2, start=30)]
    assert "2 of 4 test prompts are also training prompts" in capsys.readouterr().err
    assert len(load_task("NumGLUE-ds").test) == 94                      # cl500 ships 6 of its 100 in train.json
    write_json(tmp_path / "test.json", records(3, start=5))
    with pytest.raises(ForgetlessError, match="every test prompt is also a training prompt"):
        load_task(tmp_path)


def test_missing_fields_name_the_fields_found(tmp_path):
    path = write_json(tmp_path / "alpaca.json", [{"instruction": "say hi", "output": "hi"}] * 3)
    with pytest.raises(ForgetlessError) as e:
        load_task(path)
    message = str(e.value)
    assert "no prompt or answer field" in message and "instruction, output" in message and "\n" not in message
    half = write_json(tmp_path / "half.json", [{"prompt": "say hi", "reply": "hi"}] * 3)
    with pytest.raises(ForgetlessError, match=r"no answer field \(its fields: prompt, reply\)"):
        load_task(half)
    (tmp_path / "broken.json").write_text("[{\"prompt\": ")
    with pytest.raises(ForgetlessError, match="cannot read .*broken.json"):
        load_task(tmp_path / "broken.json")


def test_labels_must_cover_the_test_answers(tmp_path):
    sentiment = lambda i: ["positive", "negative", "neutral"][i % 3]  # noqa: E731
    write_json(tmp_path / "train.json", records(9, sentiment))
    write_json(tmp_path / "test.json", records(6, sentiment, start=100))
    write_json(tmp_path / "labels.json", ["positive", "negative", "neutral"])
    assert load_task(tmp_path).labels == ["positive", "negative", "neutral"]
    write_json(tmp_path / "labels.json", ["positive", "negative"])
    with pytest.raises(ForgetlessError, match="test answer 'neutral' is not in .*labels.json \\(2 labels\\)"):
        load_task(tmp_path)
    write_json(tmp_path / "labels.json", {"positive": 1})
    with pytest.raises(ForgetlessError, match="must be a JSON list of label strings"):
        load_task(tmp_path)


def test_validation_split_is_seeded_and_disjoint():
    task = load_task("agnews")
    train, val = validation_split(task, 0.1, seed=3)
    assert (len(train), len(val)) == (450, 50) and (train, val) == validation_split(task, 0.1, seed=3)
    assert sorted(train + val, key=task.train.index) == task.train and not set(train) & set(val)
    assert validation_split(task, 0.1, seed=4)[1] != val
    with pytest.raises(ForgetlessError, match=r"must be in \(0, 1\)"):
        validation_split(task, 1.0)


# ---- encoding --------------------------------------------------------------------------------
def test_encode_targets_the_answer_and_eos_only(tok):
    examples = [Example("Title: Dave Bickler\nAnswer:", "Artist"), Example("Is it raining?\nAnswer:", "no, it is dry")]
    enc = encode(examples, tok, max_len=64)
    assert len(enc) == 2 and enc.truncated == 0 and enc.pad_id == tok.pad_id
    for ex, x, y in zip(examples, enc.x, enc.y):
        prompt, answer = prompt_ids(tok, ex.prompt), text_ids(tok, ex.answer) + [tok.eos_id]
        assert prompt[0] == tok.bos_id and x.tolist() + [y[-1].item()] == prompt + answer
        assert y.tolist() == [-100] * (len(prompt) - 1) + answer
        assert tok.decode(y[y != -100].tolist()) == ex.answer  # eos decodes to nothing


def test_long_prompts_lose_their_beginning_and_are_counted(tok, capsys):
    long = Example("Text: " + " ".join(f"word{i}" for i in range(80)) + "\nAnswer:", "Album")
    short = Example("Title: X\nAnswer:", "Film")
    enc = encode([long, short, long], tok, max_len=40)
    warning = capsys.readouterr().err.strip()
    assert enc.truncated == 2 and enc.answers_cut == 0
    assert warning.count("\n") == 0 and "2 of 3 prompts were cut from the left" in warning and "max_len 40" in warning
    x, y = enc.x[0], enc.y[0]
    prompt, answer = prompt_ids(tok, long.prompt), text_ids(tok, long.answer) + [tok.eos_id]
    kept = len(x) + 1 - len(answer)
    assert len(x) == 40 and x[0].item() == tok.bos_id                      # full context, bos kept
    assert x[1:kept].tolist() == prompt[-(kept - 1):]                       # the end of the prompt
    assert x[kept:].tolist() + [y[-1].item()] == answer                     # the whole answer
    assert (y != -100).sum().item() == len(answer)
    whole = prompt_ids(tok, short.prompt)
    assert len(enc.x[1]) < 40 and enc.x[1].tolist()[:len(whole)] == whole
    encode([short], tok, max_len=40)
    assert capsys.readouterr().err == ""
    question = prompt_ids(tok, "Q:")
    cut = encode([Example("Q:", " ".join(["yes"] * 60))], tok, max_len=10)  # a short prompt stays whole
    assert cut.answers_cut == 1 and cut.truncated == 0 and len(cut.x[0]) == 10
    assert cut.x[0].tolist()[:len(question)] == question and (cut.y[0] != -100).sum().item() == 11 - len(question)
    assert "0 of 1 prompts were cut from the left to fit max_len 10; 1 answers lost their end" in capsys.readouterr().err
    both = encode([Example(long.prompt, " ".join(["yes"] * 60))], tok, max_len=40)  # long prompt, long answer
    assert both.truncated == 1 and both.answers_cut == 1 and len(both.x[0]) == 40
    assert (both.y[0] != -100).sum().item() == 41 - 41 // 2                 # the prompt keeps half the row
    assert both.x[0].tolist()[1:41 // 2] == prompt[-(41 // 2 - 1):]         # bos, then the prompt's end


# ---- sampling --------------------------------------------------------------------------------
def test_sampler_pads_right_and_mixes_the_other_set(tok):
    main = encode([Example(f"Question {i}?" + " more" * i, f"a{i}") for i in range(12)], tok, max_len=64)
    other = encode([Example(f"Tell me a story {i}:", "Once upon a time " * (i + 1)) for i in range(5)], tok, max_len=64)
    sampler = InstructionSampler(main, batch_size=8, seed=0, other=other, p=0.3)
    rows, shares = {"main": {(tuple(x.tolist()), tuple(y.tolist())) for x, y in zip(main.x, main.y)},
                    "other": {(tuple(x.tolist()), tuple(y.tolist())) for x, y in zip(other.x, other.y)}}, []
    for _ in range(300):
        batch = sampler.next()
        assert batch.x.shape == batch.y.shape and batch.x.shape[0] == 8
        for x, y, o in zip(batch.x, batch.y, batch.from_other.tolist()):
            n = int((y != -100).nonzero().max()) + 1            # the row's length: its eos is its last target
            assert (x[n:] == tok.pad_id).all() and (y[n:] == -100).all()
            assert (tuple(x[:n].tolist()), tuple(y[:n].tolist())) in rows["other" if o else "main"]
        lengths = [int((y != -100).nonzero().max()) + 1 for y in batch.y]
        assert batch.x.shape[1] == max(lengths)                  # padded to the longest row only
        shares.append(batch.from_other.float().mean().item())
    assert sum(shares) / len(shares) == pytest.approx(0.3, abs=0.02)  # 2.4 rows of 8: stochastic rounding
    assert {round(s * 8) for s in shares} == {2, 3}
    alone = InstructionSampler(main, batch_size=4, seed=0)
    assert not alone.next().from_other.any()
    with pytest.raises(ForgetlessError, match="needs another corpus"):
        InstructionSampler(main, batch_size=4, seed=0, p=0.5)


def test_sampler_resumes_exactly(tok):
    main = encode([Example(f"Question {i}?" + " more" * i, f"a{i}") for i in range(12)], tok, max_len=64)
    other = encode([Example(f"Story {i}:", "once " * (i + 1)) for i in range(5)], tok, max_len=64)
    sampler = InstructionSampler(main, batch_size=5, seed=7, other=other, p=0.3)
    for _ in range(3):
        sampler.next()
    state = sampler.get_state().clone()
    expected = [sampler.next() for _ in range(4)]
    fresh = InstructionSampler(main, batch_size=5, seed=123, other=other, p=0.3)
    first = fresh.next()
    fresh.set_state(state)
    for want in expected:
        got = fresh.next()
        assert torch.equal(got.x, want.x) and torch.equal(got.y, want.y)
        assert torch.equal(got.from_other, want.from_other)
    assert not torch.equal(first.x, expected[0].x) or not torch.equal(first.from_other, expected[0].from_other)


def rows_of(batch) -> list[tuple]:
    """(x without padding, from other) of every row of a batch: its length is where its targets end."""
    ends = [int((y != -100).nonzero().max()) + 1 for y in batch.y]
    return [(tuple(x[:n].tolist()), o) for x, n, o in zip(batch.x, ends, batch.from_other.tolist())]


def test_grouped_sampler_regroups_the_same_rows_by_length(tok):
    main = encode([Example(f"Question {i}?" + " more" * (7 * i % 23), f"a{i}") for i in range(40)], tok, max_len=64)
    other = encode([Example(f"Story {i}:", "once " * (i + 1)) for i in range(5)], tok, max_len=64)
    plain = InstructionSampler(main, batch_size=4, seed=3, other=other, p=0.3)
    grouped = InstructionSampler(main, batch_size=4, seed=3, other=other, p=0.3, group=5)
    want, got = [plain.next() for _ in range(5)], [grouped.next() for _ in range(5)]
    assert sorted(r for b in got for r in rows_of(b)) == sorted(r for b in want for r in rows_of(b))  # same rows, mix
    assert [b.x.shape[1] for b in got] != [b.x.shape[1] for b in want]
    assert sorted(int(b.from_other.sum()) for b in got) == sorted(int(b.from_other.sum()) for b in want)
    got += [grouped.next() for _ in range(55)]
    want += [plain.next() for _ in range(55)]
    assert all(b.x.shape == (4, max(len(x) for x, _ in rows_of(b))) for b in got)   # each padded to its longest row
    share = {name: sum(len(r) for b in batches for r, _ in rows_of(b)) / sum(b.x.numel() for b in batches)
             for name, batches in (("plain", want), ("grouped", got))}
    assert share["grouped"] > share["plain"] + 0.1  # rows of 5-27 tokens: far less padding
    assert sum(b.from_other.float().mean().item() for b in got) / 60 == pytest.approx(0.3, abs=0.04)
    assert torch.equal(InstructionSampler(main, 4, 3, group=1).next().x, InstructionSampler(main, 4, 3).next().x)


@pytest.mark.parametrize("served", [0, 2, 5, 7])
def test_grouped_sampler_resumes_exactly_within_a_group(tok, served):
    main = encode([Example(f"Question {i}?" + " more" * (5 * i % 17), f"a{i}") for i in range(30)], tok, max_len=64)
    other = encode([Example(f"Story {i}:", "once " * (i + 1)) for i in range(5)], tok, max_len=64)
    sampler = InstructionSampler(main, batch_size=3, seed=11, other=other, p=0.4, group=5)
    for _ in range(served):
        sampler.next()
    state = sampler.get_state().clone()
    expected = [sampler.next() for _ in range(8)]
    fresh = InstructionSampler(main, batch_size=3, seed=99, other=other, p=0.4, group=5)
    fresh.next()
    fresh.set_state(state)
    for want in expected:
        got = fresh.next()
        assert torch.equal(got.x, want.x) and torch.equal(got.y, want.y)
        assert torch.equal(got.from_other, want.from_other)


def test_group_by_length_is_refused_where_rows_are_windows():
    from forgetless.continual import protocols
    from forgetless.continual.protocol import Request, choose
    from forgetless.presets import build_config
    cfg = build_config("smoke", {"adapt": {"group_by_length": 8}})
    with pytest.raises(ForgetlessError, match="adapt.group_by_length acts on instruction rows only; the two-domain"):
        choose(protocols(), Request("two-domain", cfg, "smoke"))
    with pytest.raises(ForgetlessError, match="adapt.group_by_length must not be negative"):
        build_config("smoke", {"adapt": {"group_by_length": -1}})
