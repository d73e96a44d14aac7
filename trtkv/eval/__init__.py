"""Offline evaluation building blocks for ``trtkv eval``: data, grading, fidelity."""
from .answers import extract_answer, is_correct, last_boxed, reference_answer
from .datasets import (
    ENV_VAR,
    DataFileNotFoundError,
    Problem,
    Trace,
    load_problems,
    load_task,
    load_traces,
    resolve_data_file,
)
from .fidelity import FidelityAccumulator, kl_divergence, top1_agreement, topk_attention_recall

__all__ = [
    "ENV_VAR", "DataFileNotFoundError", "Problem", "Trace", "load_problems", "load_task",
    "load_traces", "resolve_data_file", "extract_answer", "is_correct", "last_boxed",
    "reference_answer", "FidelityAccumulator", "kl_divergence", "top1_agreement",
    "topk_attention_recall",
]
