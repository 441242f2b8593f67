"""Reddit TL;DR for SFT, reward modelling, DPO and GRPO: loading, tokenization, collation, sharding.

Rows come from the Hugging Face hub (`trl-lib/tldr`: prompt, completion; `trl-lib/tldr-preference`:
prompt, chosen, rejected) or from local .jsonl/.json/.parquet files with the same columns. A prompt
reads "SUBREDDIT: r/{sub}\n\nTITLE: {title}\n\nPOST: {post}\n\nTL;DR:", a response " {summary}".

Layout of a batch (collate_sft), P = longest prompt, R = longest response in the batch:

    input_ids   [pad pad p0 p1 p2 | r0 r1 END pad]     prompt left-padded, response right-padded
    columns      0   1   2  3  4  | P  ...   P+R-1

Every response starts at column P, so the hidden states at columns P-1 .. P+R-2 predict the response
tokens and the LM head only needs to run there (the head is a large share of GPT-2's FLOPs).
"""

import json
from collections.abc import Callable, Sequence
from pathlib import Path

import tiktoken
import torch

from data.hub import hub_unreachable
from data.tokenizer import END_ID, PAD_ID

SFT_COLUMNS = ("prompt", "completion")
PREF_COLUMNS = ("prompt", "chosen", "rejected")
PROMPT_COLUMNS = ("prompt",)

TLDR = "TL;DR:"
LOCAL_SUFFIXES = (".jsonl", ".json", ".parquet")


class DataError(ValueError):
    """A data file, hub dataset or row that cannot be used; the message names where and why."""

    exit_code = 2  # a script ends in one line `error: ...` with this code (utils/guard.py)


# ----------------------------------------------------------------------------------------------------
# Loading


def load_rows(source: str, split: str, columns: Sequence[str]) -> list[dict[str, str]]:
    """Rows of `source` holding exactly `columns`, each a non-empty str.

    `source` is a local path or a hub dataset name:
    - a .jsonl / .json / .parquet file (then `split` is unused: the file is the split);
    - a directory holding `{split}.jsonl` or `{split}.parquet`;
    - a hub name such as "trl-lib/tldr" (needs network access and the `datasets` package).
    Extra columns are dropped. Anything unusable raises DataError naming the file (or hub name and
    split), the 0-based row index and the column.
    """
    columns = tuple(columns)
    path = Path(source).expanduser()
    if path.exists():
        file = _split_file(path, split) if path.is_dir() else path
        return _read_local(file, columns)
    if path.suffix in LOCAL_SUFFIXES or source.startswith((".", "/", "~")):
        raise DataError(f"{source}: no such file or directory")
    return _read_hub(source, split, columns)


def load_optional_column(source: str, split: str, column: str) -> list | None:
    """The raw values of an optional `column` of `source` (same sources as load_rows, same row order), None for
    rows without it; None altogether when no row has it. Values are not checked here: the caller knows their
    type (e.g. grpo.py's per-row reward sources, a string or a list of names)."""
    path = Path(source).expanduser()
    if path.exists():
        file = _split_file(path, split) if path.is_dir() else path
        if file.suffix == ".parquet":
            import pyarrow.parquet as pq

            if column not in pq.read_schema(file).names:
                return None
            values = pq.read_table(file, columns=[column]).column(column).to_pylist()
        else:
            values = [record.get(column) for record in _read_json_records(file)]
    else:
        import datasets

        ds = datasets.load_dataset(source, split=split)
        if column not in ds.column_names:
            return None
        values = ds[column]
    return values if any(v is not None for v in values) else None


def _split_file(directory: Path, split: str) -> Path:
    candidates = [directory / f"{split}.jsonl", directory / f"{split}.parquet"]
    found = [c for c in candidates if c.is_file()]
    if not found:
        present = sorted(p.name for p in directory.iterdir())[:20]
        raise DataError(
            f"{directory}: no {split}.jsonl or {split}.parquet for split {split!r} (the directory holds {present})"
        )
    if len(found) > 1:
        raise DataError(f"{directory}: both {found[0].name} and {found[1].name} exist; keep one")
    return found[0]


def _read_local(file: Path, columns: tuple[str, ...]) -> list[dict[str, str]]:
    where = str(file)
    if file.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq  # lazy: only parquet users need pyarrow
        except ImportError as e:
            raise DataError(f"{where}: reading parquet needs pyarrow (pip install pyarrow)") from e
        try:
            found = pq.read_schema(file).names
            _check_columns(found, columns, where, "file columns")
            table = pq.read_table(file, columns=list(columns))
        except DataError:
            raise
        except Exception as e:
            raise DataError(f"{where}: cannot read parquet file: {type(e).__name__}: {e}") from e
        records = table.to_pylist()
        return _validate(records, columns, where)
    if file.suffix in (".jsonl", ".json"):
        records = _read_json_records(file)
        if not records:
            raise DataError(f"{where}: no rows")
        _check_columns(list(records[0]), columns, where, "columns of row 0")
        return _validate(records, columns, where)
    raise DataError(f"{where}: unsupported file type {file.suffix!r}; use one of {LOCAL_SUFFIXES}")


def _read_json_records(file: Path) -> list[dict]:
    """A JSON array of objects, or one JSON object per line (the format of both .json and .jsonl)."""
    where = str(file)
    try:
        raw = file.read_bytes()
        text = raw.decode("utf-8")
    except OSError as e:
        raise DataError(f"{where}: cannot read it ({type(e).__name__}: {e})") from None
    except UnicodeDecodeError as e:  # named by its row (non-blank lines before it) and line, as a JSON error is
        lines = raw[: e.start].split(b"\n")
        row = sum(1 for line in lines[:-1] if line.strip())
        raise DataError(
            f"{where}: row {row} (line {len(lines)}) is not UTF-8 text (byte 0x{raw[e.start]:02x} at column "
            f"{len(lines[-1]) + 1}); save the file as UTF-8"
        ) from None
    if text.lstrip().startswith("["):
        try:
            records = json.loads(text)
        except json.JSONDecodeError as e:
            raise DataError(f"{where}: invalid JSON: {e}") from e
        for i, record in enumerate(records):
            if not isinstance(record, dict):
                raise DataError(f"{where}: row {i}: not a JSON object ({type(record).__name__})")
        return records
    records = []
    for line_no, line in enumerate(text.splitlines(), start=1):
        if not line.strip():  # tolerate blank lines (e.g. a trailing one); they are not rows
            continue
        i = len(records)
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{where}: row {i} (line {line_no}): invalid JSON: {e}") from e
        if not isinstance(record, dict):
            raise DataError(f"{where}: row {i} (line {line_no}): not a JSON object ({type(record).__name__})")
        records.append(record)
    return records


def _read_hub(name: str, split: str, columns: tuple[str, ...]) -> list[dict[str, str]]:
    where = f"hub dataset {name!r} split {split!r}"
    offline = hub_unreachable()
    if offline:  # fail now rather than after ~25 s of retries
        raise DataError(
            f"could not load {where}: no network ({offline}) and {name!r} is not a local path. Pass a local "
            f".jsonl/.json/.parquet file or a directory holding {split}.jsonl or {split}.parquet, with columns "
            f"{list(columns)} (or set HF_HUB_OFFLINE=1 to read a copy in the Hugging Face cache)."
        )
    try:
        import datasets  # lazy: heavy import, and only hub users need it

        ds = datasets.load_dataset(name, split=split)
    except Exception as e:
        raise DataError(
            f"could not load {where} (and {name!r} is not a local path): {type(e).__name__}: {e}\n"
            f"Without network access pass a local source instead: a .jsonl/.json/.parquet file or a "
            f"directory holding {split}.jsonl or {split}.parquet, with columns {list(columns)}."
        ) from e
    _check_columns(list(ds.column_names), columns, where, "dataset columns")
    records = ds.select_columns(list(columns)).to_list()
    return _validate(records, columns, where)


def _check_columns(found: list[str], columns: tuple[str, ...], where: str, what: str) -> None:
    missing = [c for c in columns if c not in found]
    if missing:
        raise DataError(f"{where}: missing column(s) {missing}: expected {list(columns)}, {what}: {list(found)}")


def _validate(records: list[dict], columns: tuple[str, ...], where: str) -> list[dict[str, str]]:
    if not records:
        raise DataError(f"{where}: no rows")
    rows = []
    for i, record in enumerate(records):
        for c in columns:
            if c not in record:
                raise DataError(f"{where}: row {i}: missing column {c!r} (row has columns {list(record)})")
            value = record[c]
            if not isinstance(value, str):
                raise DataError(f"{where}: row {i}: column {c!r} is {type(value).__name__}, expected a str")
            if not value.strip():
                raise DataError(f"{where}: row {i}: column {c!r} is empty or only whitespace")
        rows.append({c: record[c] for c in columns})
    return rows


# ----------------------------------------------------------------------------------------------------
# Tokenization


def _split_prompt(prompt: str) -> tuple[str, str, str]:
    """(header, body, suffix) with header + body + suffix == prompt.

    header: up to and including "POST:" (the post's leading space goes to the body, so its first word
    keeps the " word" token it has in the full encoding); suffix: the whitespace before the final
    "TL;DR:" plus the rest. Without "POST:" the header is everything before the first "\n\n" (the
    first paragraph), or empty when there is none.
    """
    end = len(prompt.rstrip())
    if not prompt[:end].endswith(TLDR):
        raise DataError(f"prompt does not end with {TLDR!r} (it ends with {prompt[-20:]!r})")
    suffix_start = len(prompt[: end - len(TLDR)].rstrip())
    marker = "\n\nPOST:"
    i = prompt.find(marker, 0, suffix_start)
    if i >= 0:
        header_end = i + len(marker)
    elif prompt.startswith("POST:"):
        header_end = len("POST:")
    else:
        j = prompt.find("\n\n", 0, suffix_start)
        header_end = max(j, 0)
    header_end = min(header_end, suffix_start)
    return prompt[:header_end], prompt[header_end:suffix_start], prompt[suffix_start:]


def _fit_prompt(tok: tiktoken.Encoding, prompt: str, ids: list[int], max_len: int) -> list[int]:
    """`ids` (the encoding of `prompt`) if it fits in max_len, else the post cut at its end."""
    header, body, suffix = _split_prompt(prompt)  # checks the TL;DR: ending even when it fits
    if len(ids) <= max_len:
        return ids
    # Encoding the three parts separately can differ from the full encoding by a token at the two
    # boundaries; that only matters for rows we truncate anyway, and the result always fits.
    header_ids = tok.encode_ordinary(header)
    suffix_ids = tok.encode_ordinary(suffix)
    budget = max_len - len(header_ids) - len(suffix_ids)
    if budget < 0:
        raise DataError(
            f"prompt of {len(ids)} tokens cannot be truncated to max_prompt_len={max_len}: its header "
            f"({len(header_ids)} tokens) and {TLDR!r} suffix ({len(suffix_ids)} tokens) alone exceed it"
        )
    # Keep the *start* of the post and cut its end, as OpenAI's summarize-from-feedback does.
    return header_ids + tok.encode_ordinary(body)[:budget] + suffix_ids


def encode_prompt(tok: tiktoken.Encoding, prompt: str, max_len: int) -> list[int]:
    """Token ids of a TL;DR prompt, at most max_len of them.

    A prompt that fits is encoded exactly. A longer one loses the end of its post only: the header
    (subreddit, title, "POST:") and the "\n\nTL;DR:" suffix always survive. Raises DataError when the
    prompt does not end with "TL;DR:" or when header and suffix alone exceed max_len.
    """
    return _fit_prompt(tok, prompt, tok.encode_ordinary(prompt), max_len)


def _clean_response(text: str) -> str:
    # END_ID is "\n": a newline inside the text would read as an early end of the response, so
    # newlines become spaces and the final END_ID is the only one. Trailing whitespace is dropped so
    # the end token follows the last word; the leading space (" summary" after "TL;DR:") is kept.
    return text.replace("\n", " ").rstrip()


def encode_response(tok: tiktoken.Encoding, text: str, max_len: int) -> list[int]:
    """Token ids of a response: newlines -> spaces, rstrip, encode, keep the first max_len-1 tokens,
    append END_ID ("\n", 198). The result holds exactly one END_ID, the last token."""
    if max_len < 1:
        raise ValueError(f"max_len must be >= 1 (room for END_ID), got {max_len}")
    cleaned = _clean_response(text)
    if not cleaned:
        raise DataError("response is empty after replacing newlines and stripping")
    return tok.encode_ordinary(cleaned)[: max_len - 1] + [END_ID]


def _column(rows: Sequence[dict[str, str]], column: str, name: str) -> list[str]:
    values = []
    for i, row in enumerate(rows):
        if column not in row:
            raise DataError(f"{name}: row {i}: missing column {column!r}")
        values.append(row[column])
    return values


def _encode_prompts(tok: tiktoken.Encoding, texts: list[str], max_len: int, name: str) -> list[list[int]]:
    # One threaded batch call for all rows (long texts: tiktoken releases the GIL while encoding),
    # then the rows that are too long get truncated.
    all_ids = tok.encode_ordinary_batch(texts)
    out = []
    for i, (text, ids) in enumerate(zip(texts, all_ids, strict=True)):
        try:
            out.append(_fit_prompt(tok, text, ids, max_len))
        except DataError as e:
            raise DataError(f"{name}: row {i}: column 'prompt': {e}") from e
    return out


def _encode_responses(
    tok: tiktoken.Encoding, texts: list[str], max_len: int, name: str, column: str
) -> list[list[int]]:
    if max_len < 1:
        raise ValueError(f"max_response_len must be >= 1 (room for END_ID), got {max_len}")
    cleaned = [_clean_response(t) for t in texts]
    for i, text in enumerate(cleaned):
        if not text:
            raise DataError(f"{name}: row {i}: column {column!r} is empty after stripping")
    # A plain loop: for short texts encode_ordinary_batch's thread pool costs more than it saves.
    return [tok.encode_ordinary(text)[: max_len - 1] + [END_ID] for text in cleaned]


class PromptDataset:
    """Prompts only, for RL: `.prompts` token ids (truncated to max_prompt_len), `.texts` the raw
    prompt strings."""

    def __init__(
        self,
        rows: Sequence[dict[str, str]],
        tok: tiktoken.Encoding,
        max_prompt_len: int,
        name: str = "prompts",
    ):
        self.name = name
        self.texts: list[str] = _column(rows, "prompt", name)
        self.prompts: list[list[int]] = _encode_prompts(tok, self.texts, max_prompt_len, name)

    def __len__(self) -> int:
        return len(self.prompts)


class SFTDataset:
    """Pre-tokenized (prompt, completion) rows: `.prompts`, `.responses` (each ending with END_ID)."""

    def __init__(
        self,
        rows: Sequence[dict[str, str]],
        tok: tiktoken.Encoding,
        max_prompt_len: int,
        max_response_len: int,
        name: str = "sft",
    ):
        self.name = name
        self.prompts: list[list[int]] = _encode_prompts(tok, _column(rows, "prompt", name), max_prompt_len, name)
        self.responses: list[list[int]] = _encode_responses(
            tok, _column(rows, "completion", name), max_response_len, name, "completion"
        )

    def __len__(self) -> int:
        return len(self.prompts)

    def lengths(self) -> list[int]:
        """Tokens per row (prompt + response), the width a row needs in a micro-batch."""
        return [len(p) + len(r) for p, r in zip(self.prompts, self.responses, strict=True)]

    def collate(self, index: list[int]) -> dict:
        """collate_sft's batch of rows `index` (a ShardedLoader's collate), with each row's example index (SFT's
        prompt-loss draw is keyed by it)."""
        return collate_sft([self.prompts[i] for i in index], [self.responses[i] for i in index], example=index)


class PreferenceDataset:
    """Pre-tokenized (prompt, chosen, rejected) rows: `.prompts`, `.chosen`, `.rejected`."""

    def __init__(
        self,
        rows: Sequence[dict[str, str]],
        tok: tiktoken.Encoding,
        max_prompt_len: int,
        max_response_len: int,
        name: str = "preference",
    ):
        self.name = name
        self.prompts: list[list[int]] = _encode_prompts(tok, _column(rows, "prompt", name), max_prompt_len, name)
        self.chosen: list[list[int]] = _encode_responses(
            tok, _column(rows, "chosen", name), max_response_len, name, "chosen"
        )
        self.rejected: list[list[int]] = _encode_responses(
            tok, _column(rows, "rejected", name), max_response_len, name, "rejected"
        )

    def __len__(self) -> int:
        return len(self.prompts)

    def lengths(self) -> list[int]:
        """Tokens per pair as a micro-batch lays it out: the prompt and the longer of its two responses."""
        return [len(p) + max(len(c), len(r)) for p, c, r in zip(self.prompts, self.chosen, self.rejected, strict=True)]


# ----------------------------------------------------------------------------------------------------
# Collation


def pad_prompts(prompts: Sequence[list[int]], pad_id: int = PAD_ID) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad to the longest prompt: (prompt_ids (B, P) long, prompt_mask (B, P) bool).

    Left padding puts every prompt's last token in column P-1, so generation appends all rows at the
    same column.
    """
    if len(prompts) == 0:
        raise ValueError("pad_prompts: empty batch")
    lengths = [len(p) for p in prompts]
    if min(lengths) == 0:
        raise ValueError(f"pad_prompts: row {lengths.index(0)} is an empty prompt")
    B, P = len(prompts), max(lengths)
    prompt_ids = torch.full((B, P), pad_id, dtype=torch.long)  # (B, P)
    prompt_mask = torch.zeros((B, P), dtype=torch.bool)  # (B, P)
    for i, p in enumerate(prompts):
        prompt_ids[i, P - len(p) :] = torch.tensor(p, dtype=torch.long)
        prompt_mask[i, P - len(p) :] = True
    return prompt_ids, prompt_mask


def collate_sft(
    prompts: Sequence[list[int]],
    responses: Sequence[list[int]],
    pad_id: int = PAD_ID,
    example: Sequence[int] | None = None,
) -> dict:
    """One batch of prompt + response rows (see the module docstring for the layout).

    Returns input_ids (B, P+R) long, attention_mask (B, P+R) bool (True on real tokens),
    position_ids (B, P+R) long, response_ids (B, R) long, response_mask (B, R) bool and
    prompt_len = P (int): response token j of every row sits at column P + j; with `example`, also example (B,)
    long, each row's index in its dataset.
    """
    if len(prompts) != len(responses):
        raise ValueError(f"collate_sft: {len(prompts)} prompts but {len(responses)} responses")
    prompt_ids, prompt_mask = pad_prompts(prompts, pad_id)  # (B, P)
    lengths = [len(r) for r in responses]
    if min(lengths) == 0:
        raise ValueError(f"collate_sft: row {lengths.index(0)} is an empty response")
    B, R = len(responses), max(lengths)
    response_ids = torch.full((B, R), pad_id, dtype=torch.long)  # (B, R)
    response_mask = torch.zeros((B, R), dtype=torch.bool)  # (B, R)
    for i, r in enumerate(responses):
        response_ids[i, : len(r)] = torch.tensor(r, dtype=torch.long)
        response_mask[i, : len(r)] = True
    # GPT-2 has learned absolute positions: a left-padded row must still see position 0 at its first real token, or
    # its logits differ from the same row unpadded (prompt_response_rows counts positions over real tokens only)
    batch = prompt_response_rows(prompt_ids, prompt_mask, response_ids, response_mask)
    if example is not None:
        batch["example"] = torch.tensor(example, dtype=torch.long)
    return batch


def eval_slice(n: int, rank: int, world: int, lengths: Sequence[int] | None = None) -> list[int]:
    """This rank's rows of an n-row evaluation set (rank, rank + world, ...), padded with -1 up to ceil(n / world).
    With `lengths`, the rows are dealt out longest first (a stable sort), so consecutive rows of a slice, cut into
    micro-batches, have similar lengths and little padding; every rank's batch i holds rows of similar length.

    Every rank then runs the same number of forward passes over the same number of micro-batches: under FSDP each
    forward all-gathers parameters and the evaluation ends in an all-reduce, so a rank with one batch fewer would
    leave the others waiting in a collective for ever. Padding rows (-1) are real rows computed with weight 0."""
    order = sorted(range(n), key=lambda i: -lengths[i]) if lengths is not None else range(n)
    mine = list(order[rank::world])
    return mine + [-1] * (-(-n // world) - len(mine))


def shortest(rows: Sequence[int], lengths: Sequence[int]) -> int:
    """The shortest of `rows` (eval_slice's, -1 entries skipped; 0 when there is none): what a padding row computes,
    so it widens no micro-batch."""
    return min((i for i in rows if i >= 0), key=lambda i: lengths[i], default=0)


def validation_batches(val: SFTDataset, rank: int, world: int, micro_batch_size: int, by_length: bool) -> list[dict]:
    """This rank's micro-batches of a disjoint slice of the validation rows, in a fixed order (longest first with
    `by_length`: less padding, the same loss up to float summation order). Every rank gets the same number of
    batches (eval_slice): a rank short of rows fills its last batch with copies of its shortest row whose response
    mask is all False, so they count for no token and no loss, whatever the number of rows."""
    lengths = val.lengths()
    index = eval_slice(len(val), rank, world, lengths if by_length else None)
    filler = shortest(index, lengths)
    batches = []
    for start in range(0, len(index), micro_batch_size):
        rows = index[start : start + micro_batch_size]
        computed = [i if i >= 0 else filler for i in rows]
        batch = collate_sft([val.prompts[i] for i in computed], [val.responses[i] for i in computed])
        batch["response_mask"] &= torch.tensor([i >= 0 for i in rows])[:, None]  # (B, R): padding rows weigh 0
        batches.append(batch)
    return batches


def real_rows(batch: dict) -> int:
    """Rows of a validation batch that are not padding (validation_batches)."""
    return int(batch["response_mask"].any(1).sum())


def prompt_response_rows(
    prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, response_ids: torch.Tensor, response_mask: torch.Tensor
) -> dict:
    """collate_sft's layout from tensors: prompts (n, P) left-padded, responses (n, R) right-padded (as the sampler
    leaves them).

    Columns that are padding in every row are dropped first (leading prompt columns, trailing response columns),
    so a micro-batch is only as wide as its own longest prompt and response. Position ids count real tokens
    from 0 (GPT-2's positions are absolute, so left padding must not shift them)."""
    first = int(prompt_mask.any(0).long().argmax())  # first column where some prompt has a real token
    width = int(response_mask.any(0).sum())  # right padding: columns with some real response token
    prompt_ids, prompt_mask = prompt_ids[:, first:], prompt_mask[:, first:]
    response_ids, response_mask = response_ids[:, :width], response_mask[:, :width]
    input_ids = torch.cat([prompt_ids, response_ids], dim=1)  # (n, P'+R')
    attention_mask = torch.cat([prompt_mask, response_mask], dim=1)  # (n, P'+R')
    # pads get position 0: they are masked out of attention and losses, and 0 is always a valid position index
    position_ids = (attention_mask.long().cumsum(dim=1) - 1) * attention_mask  # (n, P'+R')
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "position_ids": position_ids,
        "response_ids": response_ids,
        "response_mask": response_mask,
        "prompt_len": prompt_ids.shape[1],
    }


def decode_responses(
    tok: tiktoken.Encoding, response_ids: torch.Tensor, response_mask: torch.Tensor, has_end: torch.Tensor
) -> list[str]:
    """Response texts as generated: up to and including the first end token; a stop at EOS reads as "\n"."""
    texts = []
    for ids, mask, ended in zip(response_ids.tolist(), response_mask.tolist(), has_end.tolist(), strict=True):
        ids = [t for t, m in zip(ids, mask, strict=True) if m]
        if ended and ids[-1] != END_ID:
            ids = ids[:-1] + [END_ID]
        texts.append(tok.decode(ids))
    return texts


def collate_pairs(
    prompts: Sequence[list[int]],
    chosen: Sequence[list[int]],
    rejected: Sequence[list[int]],
    pad_id: int = PAD_ID,
) -> dict:
    """collate_sft over 2B rows: chosen rows 0..B-1, then rejected rows B..2B-1 (row i and row B+i
    share prompt i), so one forward pass scores both sides; plus "n_pairs": B."""
    if not len(prompts) == len(chosen) == len(rejected):
        raise ValueError(f"collate_pairs: {len(prompts)} prompts, {len(chosen)} chosen, {len(rejected)} rejected")
    batch = collate_sft(list(prompts) * 2, list(chosen) + list(rejected), pad_id)
    batch["n_pairs"] = len(prompts)
    return batch


# ----------------------------------------------------------------------------------------------------
# Sharding and iteration


def length_sorted(rows: Sequence[int], lengths: Sequence[int], size: int) -> list[list[int]]:
    """`rows` (example indices) sorted by length, longest first (ties keep their order: a stable sort), and cut into
    groups of `size`.

    A micro-batch is as wide as its longest row, so rows of similar length together leave little padding to compute.
    The loss of an optimizer step is a sum over its rows divided by global counts (utils/optim.py), so which rows
    share a micro-batch, and which rank computes it, changes the gradient only by the order of float summation."""
    if len(rows) % size:
        raise ValueError(f"{len(rows)} rows do not divide into groups of {size}")
    ordered = sorted(rows, key=lambda i: -lengths[i])
    return [ordered[s : s + size] for s in range(0, len(ordered), size)]


class ShardedLoader:
    """Infinite, resumable, sharded batches of example indices, each passed through `collate`.

    Epoch e shuffles all examples with torch.Generator().manual_seed(seed + e) and drops the tail so
    the rest divides into global batches of world_size * batch_size. Rank r takes the *contiguous*
    slice [r * batch_size, (r + 1) * batch_size) of each global batch, so the global batch is the
    concatenation of the rank slices in rank order: one process with batch_size 2B sees exactly the
    rows, in the same order, that ranks 0 and 1 see with batch_size B.

    The loader is its own iterator: iter(loader) continues from its current position, and
    state_dict() gives the position of the next batch, so load_state_dict() resumes exactly.

    `next_step(accum)` takes the next `accum` global batches as one optimizer step's micro-batches. With `lengths` (a
    length per example), the step's rows of every rank are sorted by length together and dealt out (length_sorted):
    micro-batch j of rank r holds sorted rows [(j * world + r) * batch_size, ...), so every micro-batch, on every
    rank, holds rows of similar length. The step's rows are the same; which rank computes which row changes.
    """

    def __init__(
        self,
        n_examples: int,
        batch_size: int,
        rank: int,
        world_size: int,
        seed: int,
        collate: Callable[[list[int]], dict],
        lengths: Sequence[int] | None = None,
    ):
        if lengths is not None and len(lengths) != n_examples:
            raise ValueError(f"{len(lengths)} lengths for {n_examples} examples")
        if batch_size < 1 or world_size < 1:
            raise ValueError(f"batch_size ({batch_size}) and world_size ({world_size}) must be >= 1")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside [0, world_size={world_size})")
        global_batch = world_size * batch_size
        if n_examples < global_batch:
            raise DataError(
                f"{n_examples} examples cannot fill one global batch of world_size {world_size} x "
                f"batch_size {batch_size} = {global_batch}; use more rows or a smaller batch"
            )
        self.n_examples = n_examples
        self.batch_size = batch_size
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
        self.collate = collate
        self.lengths = lengths
        self.epoch = 0
        self.batch_in_epoch = 0
        self._perm_epoch: int | None = None
        self._perm: torch.Tensor | None = None

    @property
    def batches_per_epoch(self) -> int:
        return self.n_examples // (self.world_size * self.batch_size)

    def _permutation(self, epoch: int) -> torch.Tensor:
        if self._perm_epoch != epoch:  # cache: one randperm per epoch, not per batch
            generator = torch.Generator().manual_seed(self.seed + epoch)
            self._perm = torch.randperm(self.n_examples, generator=generator)  # (n_examples,)
            self._perm_epoch = epoch
        return self._perm

    def batch_indices(self, epoch: int, batch_in_epoch: int) -> list[int]:
        """This rank's example indices for batch `batch_in_epoch` of epoch `epoch`."""
        if not 0 <= batch_in_epoch < self.batches_per_epoch:
            raise ValueError(f"batch {batch_in_epoch} outside [0, {self.batches_per_epoch})")
        global_batch = self.world_size * self.batch_size
        start = batch_in_epoch * global_batch + self.rank * self.batch_size
        return self._permutation(epoch)[start : start + self.batch_size].tolist()

    def __iter__(self) -> "ShardedLoader":
        return self

    def _advance(self) -> tuple[int, int]:
        """The position of the next batch, (epoch, batch in epoch); the loader then points past it. Advancing before
        the batch is built means state_dict() taken after receiving a batch points at the next."""
        position = self.epoch, self.batch_in_epoch
        self.batch_in_epoch += 1
        if self.batch_in_epoch == self.batches_per_epoch:
            self.epoch, self.batch_in_epoch = self.epoch + 1, 0
        return position

    def __next__(self) -> dict:
        return self.collate(self.batch_indices(*self._advance()))

    def step_batches(self, positions: Sequence[tuple[int, int]]) -> list[dict]:
        """This rank's micro-batches of the optimizer step made of the global batches at `positions` ((epoch, batch in
        epoch) each): its own slice of each, or with `lengths` the step's rows of every rank dealt out by length."""
        if self.lengths is None:
            return [self.collate(self.batch_indices(e, b)) for e, b in positions]
        global_batch = self.world_size * self.batch_size
        rows = []
        for epoch, batch in positions:
            self.batch_indices(epoch, batch)  # checks the position
            rows += self._permutation(epoch)[batch * global_batch : (batch + 1) * global_batch].tolist()
        groups = length_sorted(rows, self.lengths, self.batch_size)  # len(positions) * world groups
        return [self.collate(groups[j * self.world_size + self.rank]) for j in range(len(positions))]

    def next_step(self, accum: int) -> list[dict]:
        """The next `accum` global batches as one optimizer step's micro-batches (continuing into the next epoch where
        the step runs past this one's end)."""
        return self.step_batches([self._advance() for _ in range(accum)])

    def state_dict(self) -> dict[str, int]:
        return {
            "epoch": self.epoch,
            "batch_in_epoch": self.batch_in_epoch,
            "n_examples": self.n_examples,
            "global_batch": self.world_size * self.batch_size,
        }

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue from `state`. A state saved with another global batch (world size x batch size) is converted
        through the number of examples already taken in its epoch, which must be a whole number of this loader's
        global batches; the order is then the same but the epoch's dropped tail may differ. A state from another
        number of examples (other data) is refused."""
        epoch, batch_in_epoch = int(state["epoch"]), int(state["batch_in_epoch"])
        global_batch = self.world_size * self.batch_size
        if "n_examples" in state and int(state["n_examples"]) != self.n_examples:
            raise ValueError(
                f"the saved data position is for {state['n_examples']} examples, but this data has {self.n_examples}"
            )
        if "global_batch" in state and int(state["global_batch"]) != global_batch:
            taken = batch_in_epoch * int(state["global_batch"])
            if taken % global_batch:
                raise ValueError(
                    f"the saved data position ({taken} examples into epoch {epoch}, in global batches of "
                    f"{state['global_batch']}) is not a whole number of this run's global batches of {global_batch}"
                )
            batch_in_epoch = taken // global_batch
        if epoch < 0 or not 0 <= batch_in_epoch < self.batches_per_epoch:
            raise ValueError(
                f"loader state {state} is outside epochs >= 0 and batches [0, {self.batches_per_epoch}) of this loader"
            )
        self.epoch, self.batch_in_epoch = epoch, batch_in_epoch
