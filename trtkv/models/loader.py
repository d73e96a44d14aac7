"""Load a safetensors checkpoint (or random weights of a registry shape) into trtkv's decoder."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from trtkv.errors import TrtkvError
from trtkv.models.config import ModelArch
from trtkv.models.decoder import DecoderModel

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def parse_dtype(name: str) -> torch.dtype:
    try:
        return DTYPES[name]
    except KeyError:
        raise TrtkvError(f"unknown dtype {name!r}; choose one of {', '.join(DTYPES)}") from None


def weight_files(ckpt: Path) -> list[Path]:
    files = sorted(ckpt.glob("*.safetensors"))
    if not files:
        raise TrtkvError(f"no .safetensors weights in {ckpt}")
    return files


def read_arch(ckpt: Path) -> ModelArch:
    cfg = ckpt / "config.json"
    if not cfg.is_file():
        raise TrtkvError(f"{ckpt} has no config.json")
    return ModelArch.from_hf_config(json.loads(cfg.read_text()))


def load_weights(model: DecoderModel, files: list[Path], dtype: torch.dtype, device: str) -> DecoderModel:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    expected = dict(model.state_dict())
    if model.arch.tie_word_embeddings:
        expected.pop("lm_head.weight", None)
    seen = set()
    params = dict(model.named_parameters(remove_duplicate=False))
    for f in files:
        try:
            sd = load_file(str(f))
        except (SafetensorError, OSError) as e:
            raise TrtkvError(f"corrupt weights file {f}: {e}") from None
        for name, t in sd.items():
            if name not in params:
                continue  # e.g. rotary inv_freq buffers in old checkpoints
            with torch.no_grad():
                params[name].copy_(t.to(torch.float32))
            seen.add(name)
    missing = [k for k in expected if k not in seen]
    if missing:
        raise TrtkvError(f"weights are missing {len(missing)} tensors (first: {missing[0]}); "
                         "is this the right checkpoint?")
    return model.to(device=device, dtype=dtype).eval()


def build_model(arch: ModelArch, dtype: torch.dtype, device: str, files: list[Path] | None, seed: int = 0):
    if files is None:  # synthetic: random weights of the right shape (for speed and memory work only)
        # On a GPU they are drawn there (an 8B model's draw takes about a minute on CPU cores), so a seed
        # gives different weights on CPU and on CUDA; on CPU they are what they always were.
        on_gpu = torch.device(device).type == "cuda"
        with torch.device(device if on_gpu else "cpu"):
            model = DecoderModel(arch)
        g = torch.Generator(device=device if on_gpu else "cpu").manual_seed(seed)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.fill_(1.0)
                else:
                    p.normal_(0.0, 0.02, generator=g)
        return model.to(device=device, dtype=dtype).eval().fuse_projections()
    return load_weights(DecoderModel(arch), files, dtype, device).fuse_projections()


def sha256_files(files: list[Path]) -> str:
    h = hashlib.sha256()
    for f in sorted(files):
        with open(f, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 22), b""):
                h.update(chunk)
    return h.hexdigest()
