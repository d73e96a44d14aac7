"""Architecture description of a decoder-only model (Llama / Qwen2 families), read from HF config.json."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from trtkv.errors import TrtkvError

SUPPORTED_ARCHITECTURES = ("llama", "qwen2")


@dataclass
class ModelArch:
    architecture: str  # "llama" | "qwen2"
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    head_dim: int = 0
    max_position_embeddings: int = 4096
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2: q/k/v projections carry a bias
    bos_token_id: int | None = None
    eos_token_id: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise TrtkvError(
                f"unsupported architecture {self.architecture!r}; trtkv runs {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if not self.head_dim:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.num_attention_heads % self.num_key_value_heads:
            raise TrtkvError("num_attention_heads must be a multiple of num_key_value_heads")
        if isinstance(self.eos_token_id, int):
            self.eos_token_id = [self.eos_token_id]

    @property
    def gqa_group(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelArch":
        return cls(**{k: v for k, v in d.items() if k in cls.__dataclass_fields__})

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> "ModelArch":
        """Map a transformers ``config.json`` (v4 ``rope_theta``/``rope_scaling`` or v5 ``rope_parameters``)."""
        model_type = cfg.get("model_type", "")
        if model_type not in SUPPORTED_ARCHITECTURES:
            raise TrtkvError(
                f"model_type {model_type!r} is not supported; trtkv runs {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        rope = dict(cfg.get("rope_parameters") or {})
        theta = float(rope.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
        scaling = cfg.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
        eos = cfg.get("eos_token_id")
        return cls(
            architecture=model_type,
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=cfg["num_attention_heads"],
            num_key_value_heads=cfg.get("num_key_value_heads", cfg["num_attention_heads"]),
            vocab_size=cfg["vocab_size"],
            head_dim=cfg.get("head_dim") or 0,
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=theta,
            rope_scaling=scaling,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=model_type == "qwen2" or bool(cfg.get("attention_bias", False)),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_id=[eos] if isinstance(eos, int) else list(eos or []),
        )

    def to_hf_config(self) -> dict[str, Any]:
        """A transformers-loadable config.json for the same architecture (for parity tests and tokenizers)."""
        rope_parameters = {"rope_theta": self.rope_theta, "rope_type": "default"}
        if self.rope_scaling:
            rope_parameters.update(self.rope_scaling)
        cfg = {
            "model_type": self.architecture,
            "architectures": ["LlamaForCausalLM" if self.architecture == "llama" else "Qwen2ForCausalLM"],
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "vocab_size": self.vocab_size,
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_parameters": rope_parameters,
            "tie_word_embeddings": self.tie_word_embeddings,
            "hidden_act": "silu",
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id[0] if len(self.eos_token_id) == 1 else self.eos_token_id,
        }
        if self.architecture == "llama":
            cfg["attention_bias"] = self.attention_bias
        return cfg
