"""Loading GPT-2 weights from the Hugging Face hub or a local folder, and exporting Hugging Face folders.

Hugging Face GPT-2 stores attention and MLP weights as Conv1D, shape (in, out); ours are nn.Linear, shape
(out, in), so those four matrices are transposed both ways. The released `gpt2` checkpoints name the body's
keys without the `transformer.` prefix; folders written by `save_pretrained` have it. Both are accepted.

Model kinds: a folder written here names its kind in config.json ("model_kind": "policy" or "reward_model"; a reward
model also its "reward_pooling", and its gain and bias in reward_normalization.json). A folder without that key is
a reward model when transformers' architecture is GPT2ForSequenceClassification and a policy otherwise (the hub's
gpt2 and any save_pretrained GPT2LMHeadModel). Scripts check every model's kind with model_config(..., kind=) before
anything is built: a policy given as a reward model would get a random head, a reward model given as a policy
would lose its head silently.
"""

import json
import math
import os
import shutil
from pathlib import Path

import torch
import torch.nn as nn

from data.hub import hub_unreachable
from model.gpt2 import PRESETS, GPT2LMHeadModel, GPTConfig
from model.heads import POOLINGS, RewardModel
from model.lora import lora_scalings, merged_state_dict

CONV1D_SUFFIXES = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
HUB_NAMES = ("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl")
KINDS = ("policy", "reward_model")
NORMALIZATION = "reward_normalization.json"


class ModelLoadError(RuntimeError):
    """A model name, folder or weights file that cannot be loaded; the message names it and what was expected."""

    exit_code = 2  # a script ends in one line `error: ...` with this code (utils/guard.py)


def config_from_hf(hf: dict) -> GPTConfig:
    return GPTConfig(
        vocab_size=hf["vocab_size"],
        n_positions=hf["n_positions"],
        n_layer=hf["n_layer"],
        n_head=hf["n_head"],
        n_embd=hf["n_embd"],
        layer_norm_epsilon=hf.get("layer_norm_epsilon", 1e-5),
    )


def config_to_hf(cfg: GPTConfig, architecture: str) -> dict:
    return {
        "architectures": [architecture],
        "model_type": "gpt2",
        "activation_function": "gelu_new",
        "vocab_size": cfg.vocab_size,
        "n_positions": cfg.n_positions,
        "n_ctx": cfg.n_positions,
        "n_layer": cfg.n_layer,
        "n_head": cfg.n_head,
        "n_embd": cfg.n_embd,
        "n_inner": None,
        "layer_norm_epsilon": cfg.layer_norm_epsilon,
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
        "bos_token_id": 50256,
        "eos_token_id": 50256,
        "pad_token_id": 50256,
        "tie_word_embeddings": True,
        "torch_dtype": "float32",
    }


def _resolve_files(name_or_path: str) -> tuple[Path, Path | None]:
    """(config.json, weights file or None) from a local folder or the hub."""
    path = Path(name_or_path)
    if path.is_dir():
        cfg = path / "config.json"
        if not cfg.is_file():
            raise ModelLoadError(f"model folder {path} has no config.json (expected a Hugging Face-format folder)")
        for w in ("model.safetensors", "pytorch_model.bin"):
            if (path / w).is_file():
                return cfg, path / w
        return cfg, None
    if path.exists():
        raise ModelLoadError(
            f"model path {path} is a file; expected a Hugging Face-format folder (config.json and weights)"
        )
    if os.sep in name_or_path or name_or_path.startswith("."):
        raise ModelLoadError(f"model folder {name_or_path} does not exist (expected a Hugging Face-format folder)")
    # No network: read the local Hugging Face cache only, at once, instead of ~25 s of retries.
    offline = hub_unreachable()
    try:
        from huggingface_hub import hf_hub_download

        cfg = Path(hf_hub_download(name_or_path, "config.json", local_files_only=offline is not None))
        return cfg, Path(hf_hub_download(name_or_path, "model.safetensors", local_files_only=offline is not None))
    except Exception as e:  # no network, unknown repo, ...
        why = (
            f"no network: {offline}, and it is not in the local Hugging Face cache"
            if offline
            else f"{type(e).__name__}: {e}"
        )
        raise ModelLoadError(
            f"could not load model '{name_or_path}' from the Hugging Face hub ({why}). "
            f"Pass a local Hugging Face-format folder instead, or a preset with --random_init "
            f"({', '.join(PRESETS)})."
        ) from None


def _read_weights(file: Path) -> dict[str, torch.Tensor]:
    try:
        if file.suffix == ".safetensors":
            from safetensors.torch import load_file

            return load_file(str(file))
        return torch.load(file, map_location="cpu", weights_only=True)
    except Exception as e:  # truncated or not a weights file
        raise ModelLoadError(f"cannot read weights file {file} ({type(e).__name__}: {e})") from None


def hf_to_ours(hf_sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Rename a Hugging Face GPT-2 state dict to our names (body under `transformer.`)."""
    out = {}
    for k, v in hf_sd.items():
        if k.endswith(".attn.bias") or k.endswith(".attn.masked_bias"):
            continue  # causal-mask buffers of old checkpoints
        if not (k.startswith("transformer.") or k.startswith("lm_head.") or k.startswith("score.")):
            k = "transformer." + k
        if k.endswith(CONV1D_SUFFIXES):
            v = v.t()
        out[k] = v.contiguous()
    return out


def _config_json(cfg_file: Path) -> dict:
    try:
        return json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"{cfg_file} is not a GPT-2 config.json (JSONDecodeError: {e})") from None


def load_config(name_or_path: str) -> GPTConfig:
    cfg_file, _ = _resolve_files(name_or_path)
    hf = _config_json(cfg_file)
    try:
        return config_from_hf(hf)
    except (KeyError, TypeError) as e:
        raise ModelLoadError(f"{cfg_file} is not a GPT-2 config.json ({type(e).__name__}: {e})") from None


def model_kind(name_or_path: str, cfg_file: Path | None = None) -> str:
    """ "policy" or "reward_model": the model's config.json "model_kind", else its architecture (see the module
    docstring). `cfg_file`: its config.json where _resolve_files found it (a hub model's, in the Hugging Face cache);
    by default the folder's own, and a name without one is a policy. Reads no weights."""
    cfg_file = cfg_file or Path(name_or_path) / "config.json"
    if not cfg_file.is_file():
        return "policy"
    hf = _config_json(cfg_file)
    kind = hf.get("model_kind") or (
        "reward_model" if "GPT2ForSequenceClassification" in (hf.get("architectures") or []) else "policy"
    )
    if kind not in KINDS:
        raise ModelLoadError(f"{cfg_file}: model_kind {kind!r}, expected one of {', '.join(KINDS)}")
    return kind


def check_kind(
    name_or_path: str, kind: str, option: str, normalized: bool = True, cfg_file: Path | None = None
) -> None:
    """ModelLoadError, naming `option`, unless the model is of `kind` (model_kind); a reward model must also hold its
    normalisation (reward_normalization.json with a finite gain and bias) when `normalized`."""
    got = model_kind(name_or_path, cfg_file)
    what = {
        "policy": "a policy (a GPT-2 language model)",
        "reward_model": "a reward model (a GPT-2 with a scalar head)",
    }
    if got != kind:
        hint = (
            "give reward_model.py's export (its hf/ folder)"
            if kind == "reward_model"
            else "give a policy: an sft.py, dpo.py or grpo.py export (hf/), a hub name or a Hugging Face GPT-2 folder"
        )
        raise ModelLoadError(f"{option} {name_or_path} is {what[got]}, not {what[kind]}; {hint}")
    if kind == "reward_model" and normalized:
        norm = Path(name_or_path) / NORMALIZATION
        try:
            d = json.loads(norm.read_text())
            if not all(isinstance(d.get(k), (int, float)) and math.isfinite(d[k]) for k in ("gain", "bias")):
                raise ValueError("expected finite numbers 'gain' and 'bias'")
        except (OSError, ValueError) as e:
            why = "is missing" if isinstance(e, FileNotFoundError) else f"cannot be read ({type(e).__name__}: {e})"
            raise ModelLoadError(
                f"{option} {name_or_path} is a reward model whose {NORMALIZATION} {why}: without its gain and bias "
                f"its rewards are on no known scale; give the folder reward_model.py exported (it writes the file "
                f"after fitting them)"
            ) from None


def model_config(
    name_or_path: str, random_init: bool = False, kind: str = "", option: str = "--model", normalized: bool = True
) -> GPTConfig:
    """The GPTConfig that build_policy / build_reward_model would build, without reading any weights: scripts call
    it first, so a wrong model name or folder fails before data is tokenized or anything is put on a GPU. With
    `kind` ("policy" or "reward_model") a loaded model must be of that kind (check_kind; `option` names it in the
    error, and any error about the folder); a random preset is whatever is built from it. Each option that names a
    model declares its kind beside it (utils/config.py option(..., model=KIND)); every script checks each of its own
    here before building anything."""
    if random_init:
        if name_or_path not in PRESETS:
            raise ModelLoadError(f"--random_init needs a preset name ({', '.join(PRESETS)}), got '{name_or_path}'")
        return PRESETS[name_or_path]
    try:
        cfg_file, weights = _resolve_files(name_or_path)
        if weights is None:
            raise ModelLoadError(f"model folder {name_or_path} has no model.safetensors or pytorch_model.bin")
    except ModelLoadError as e:  # the option that named the folder comes first
        raise ModelLoadError(f"{option}: {e}") from None
    if kind:
        check_kind(name_or_path, kind, option, normalized, cfg_file)
    return load_config(name_or_path)


def _load_into(model: nn.Module, name_or_path: str, strict_head: bool) -> None:
    _, weights = _resolve_files(name_or_path)
    if weights is None:
        raise ModelLoadError(f"model folder {name_or_path} has no model.safetensors or pytorch_model.bin")
    sd = hf_to_ours(_read_weights(weights))
    own = model.state_dict()
    for k, v in list(sd.items()):
        if k not in own:
            sd.pop(k)  # e.g. lm_head.weight when building a reward model from a policy
            continue
        if own[k].shape != v.shape:
            raise ModelLoadError(
                f"{name_or_path}: weight {k} has shape {tuple(v.shape)}, expected {tuple(own[k].shape)}"
            )
    missing = [k for k in own if k not in sd and k != "lm_head.weight"]
    if not strict_head:
        missing = [k for k in missing if not k.startswith("score.") and k not in ("gain", "bias")]
    if missing:
        raise ModelLoadError(f"{name_or_path}: missing weights {missing[:5]}{'...' if len(missing) > 5 else ''}")
    model.load_state_dict(sd, strict=False)


def build_policy(name_or_path: str, random_init: bool = False) -> GPT2LMHeadModel:
    """A GPT-2 language model: pretrained from the hub or a local folder, or a random preset."""
    if random_init:
        if name_or_path not in PRESETS:
            raise ModelLoadError(f"--random_init needs a preset name ({', '.join(PRESETS)}), got '{name_or_path}'")
        return GPT2LMHeadModel(PRESETS[name_or_path])
    model = GPT2LMHeadModel(load_config(name_or_path))
    _load_into(model, name_or_path, strict_head=True)
    return model


def build_reward_model(
    name_or_path: str, random_init: bool = False, pooling: str = "", new_head: bool = False
) -> RewardModel:
    """A reward model: from a reward-model folder (its head, gain/bias and pooling) or, with `new_head` (reward_model.py
    starting from a policy), a policy folder with a new head; `pooling` as resolve_pooling takes it. A policy folder
    without `new_head` is a ModelLoadError: its head would be random, and every score it gives meaningless."""
    pooling = resolve_pooling(name_or_path, pooling, random_init)
    if random_init:
        if name_or_path not in PRESETS:
            raise ModelLoadError(f"--random_init needs a preset name ({', '.join(PRESETS)}), got '{name_or_path}'")
        return RewardModel(PRESETS[name_or_path], pooling)
    if not new_head and model_kind(name_or_path, _resolve_files(name_or_path)[0]) != "reward_model":
        raise ModelLoadError(
            f"{name_or_path} is a policy (a GPT-2 language model), not a reward model: its scalar head would be "
            f"random; give reward_model.py's export (its hf/ folder)"
        )
    model = RewardModel(load_config(name_or_path), pooling)
    _load_into(model, name_or_path, strict_head=False)
    norm = Path(name_or_path) / NORMALIZATION
    if norm.is_file():
        d = json.loads(norm.read_text())
        model.gain.fill_(d["gain"])
        model.bias.fill_(d["bias"])
    return model


def resolve_pooling(name_or_path: str, pooling: str = "", random_init: bool = False) -> str:
    """The pooling (model.heads.POOLINGS) of the reward model build_reward_model builds: `pooling`, or when it is
    empty a reward-model folder's own (its config.json's "reward_pooling"; "last" for a GPT2ForSequenceClassification
    folder without one), else "last". A reward-model folder saved with another pooling than `pooling` is an error:
    its head was trained to be read its own way. Reads no weights (scripts call it before loading anything)."""
    if pooling and pooling not in POOLINGS:
        raise ModelLoadError(f"reward pooling must be one of {', '.join(POOLINGS)}, got '{pooling}'")
    cfg_file = Path(name_or_path) / "config.json"
    saved = ""
    if not random_init and cfg_file.is_file():
        hf = _config_json(cfg_file)
        saved = hf.get(
            "reward_pooling", "last" if "GPT2ForSequenceClassification" in hf.get("architectures", []) else ""
        )
        if saved and saved not in POOLINGS:
            raise ModelLoadError(f"{cfg_file}: reward_pooling {saved!r}, expected one of {', '.join(POOLINGS)}")
    if pooling and saved and pooling != saved:
        raise ModelLoadError(f"{name_or_path} is a reward model with pooling '{saved}', not '{pooling}'")
    return pooling or saved or "last"


def save_hf(
    state_dict: dict[str, torch.Tensor],
    cfg: GPTConfig,
    folder: str | Path,
    extra_files: dict | None = None,
    reward_pooling: str = "last",
) -> None:
    """Write a folder that transformers' GPT2LMHeadModel (or GPT2ForSequenceClassification, when the state
    dict has a `score` head) loads with from_pretrained; a reward model's config.json also names its
    `reward_pooling` (model.heads.RewardModel). Written to a temporary folder and renamed, so a crash leaves
    either the old export or the new one."""
    from safetensors.torch import save_file

    folder = Path(folder)
    is_reward = "score.weight" in state_dict
    out = {}
    for k, v in state_dict.items():
        if k in ("lm_head.weight", "gain", "bias"):
            continue  # lm_head is tied to wte; gain/bias go to reward_normalization.json
        v = v.detach().to("cpu", torch.float32)
        if k.endswith(CONV1D_SUFFIXES):
            v = v.t()
        out[k] = v.contiguous()
    hf_cfg = config_to_hf(cfg, "GPT2ForSequenceClassification" if is_reward else "GPT2LMHeadModel")
    hf_cfg["model_kind"] = "reward_model" if is_reward else "policy"
    if is_reward:
        hf_cfg["num_labels"] = 1
        hf_cfg["id2label"] = {"0": "LABEL_0"}
        hf_cfg["label2id"] = {"LABEL_0": 0}
        hf_cfg["reward_pooling"] = reward_pooling
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(out, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    (tmp / "config.json").write_text(json.dumps(hf_cfg, indent=2))
    if is_reward:
        gain = float(state_dict.get("gain", torch.ones(())))
        bias = float(state_dict.get("bias", torch.zeros(())))
        (tmp / NORMALIZATION).write_text(json.dumps({"gain": gain, "bias": bias}))
    for name, content in (extra_files or {}).items():
        (tmp / name).write_text(content)
    if folder.exists():
        old = folder.with_name(folder.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        folder.rename(old)
        tmp.rename(folder)
        shutil.rmtree(old)
    else:
        tmp.rename(folder)


def save_export(
    model: nn.Module,
    state_dict: dict[str, torch.Tensor],
    cfg: GPTConfig,
    folder: str | Path,
    extra_files: dict | None = None,
) -> None:
    """Write `model`'s full state dict as a Hugging Face-format folder, LoRA adapters merged into their base
    weights (a plain GPT-2 that `transformers` loads). With utils.fsdp.export_model under FSDP."""
    save_hf(
        merged_state_dict(state_dict, lora_scalings(model)), cfg, folder, extra_files, getattr(model, "pooling", "last")
    )


def freeze(model: nn.Module) -> nn.Module:
    """No parameter of `model` takes gradients, and it runs in eval mode (a frozen reference or reward model)."""
    for p in model.parameters():
        p.requires_grad_(False)
    return model.eval()
