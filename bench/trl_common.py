"""What the TRL side-by-sides (bench/trl_grpo.py, bench/trl_stages.py) share: whether TRL is installed, a stand-in
tokenizer that keeps our token ids through TRL's text round trips, the TRL child process's environment and settings.
Nothing here imports trl, datasets, transformers or tokenizers at module level: the benchmarks must import without.
"""

import importlib.metadata
import importlib.util
import os

from bench.common import ROOT
from model.sampler import EOS_ID
from utils import host

CHAR_BASE = 0x20000  # plane 2: 50,256 code points, none of them whitespace or newline
TRL_MODULES = ("trl", "datasets", "accelerate")


def trl_available(what: str = "TRL GRPOTrainer step") -> tuple[bool, str]:
    """(installed, why not): trl, datasets and accelerate, found with importlib.util.find_spec (nothing imported)."""
    missing = [m for m in TRL_MODULES if importlib.util.find_spec(m) is None]
    if missing:
        return False, f"{', '.join(missing)} not installed (pip install trl) -- {what} not measured"
    return True, ""


def char_tokenizer(eos_id: int = EOS_ID):
    """A transformers tokenizer with one character per GPT-2 id, so that TRL's text round trips keep token ids.
    Its end-of-sequence token is `eos_id` (what TRL's trainers append to a completion that does not end with it);
    padding is "<|endoftext|>" (50256) on the left."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {chr(CHAR_BASE + i): i for i in range(EOS_ID)}
    vocab["<|endoftext|>"] = EOS_ID
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(["<|endoftext|>"])
    eos = "<|endoftext|>" if eos_id == EOS_ID else chr(CHAR_BASE + eos_id)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos, pad_token="<|endoftext|>", padding_side="left")


def ids_to_text(ids: list[int]) -> str:
    return "".join(chr(CHAR_BASE + i) for i in ids)


def version(module: str) -> str:
    try:
        return importlib.metadata.version(module)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def child_env() -> dict[str, str]:
    """The environment of a TRL child process: offline, quiet, no tracker, the project on PYTHONPATH, and without the
    allocator setting this process put in its own environment (utils/host.py's huge pages, which PyTorch in the child
    would read too): TRL runs as its users run it."""
    env = {
        **{k: v for k, v in os.environ.items() if k not in host.SET_HERE},
        "TRL_EXPERIMENTAL_SILENCE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "HF_HUB_OFFLINE": "1",
        "WANDB_MODE": "disabled",
    }
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    return env


def trainer_basics(device) -> dict:
    """The TRL trainer settings every side-by-side shares: no weight decay, clipping at 1.0 as ours, no warm-up, no
    gradient checkpointing (ours is off), the device, a log line per step (read by the step callbacks), nothing
    saved or reported, no progress bar or loader workers, seed 1."""
    return dict(
        weight_decay=0.0,
        max_grad_norm=1.0,
        warmup_steps=0,
        gradient_checkpointing=False,
        use_cpu=device.type == "cpu",
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
        seed=1,
    )
