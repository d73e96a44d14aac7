"""Final-answer extraction and grading with math-verify.

Grading uses math-verify (the grader behind open-r1 and lighteval) so accuracy numbers
are comparable with published R1-distill results. We pick the model's answer ourselves
(last ``\\boxed{}`` after ``</think>``) and let math-verify only decide equivalence;
that keeps "what did the model answer" inspectable and stops math-verify from grabbing
a stray number from the reasoning.
"""
from __future__ import annotations

import logging
import re
import threading

__all__ = ["extract_answer", "reference_answer", "is_correct", "last_boxed"]

log = logging.getLogger(__name__)

# A model answer longer than this is not an answer; parsing it could stall sympy, and
# off the main thread math-verify has no timeout at all.
MAX_ANSWER_CHARS = 1000
VERIFY_TIMEOUT_S = 5


class _DropTimeoutWarning(logging.Filter):
    """math-verify warns once that timeouts are off; off the main thread that is by
    design here (MAX_ANSWER_CHARS bounds the work), so the warning is only noise."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Timeout is disabled" not in record.getMessage()


for _name in ("math_verify.parser", "math_verify.grader"):
    logging.getLogger(_name).addFilter(_DropTimeoutWarning())

_BOXED = re.compile(r"\\(?:boxed|fbox)\s*")
# Thousands groups only ("1,000" but not "1,2"), optional dollar sign and minus.
_NUMBER = re.compile(r"-?\\?\$?\s?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?")


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}``, brace-balanced (``\\boxed{\\frac{1}{\\sqrt{2}}}``)."""
    for m in reversed(list(_BOXED.finditer(text))):
        i = m.end()
        if i < len(text) and text[i] == "{":
            depth = 0
            for j in range(i, len(text)):
                c = text[j]
                if c == "{" and text[j - 1] != "\\":
                    depth += 1
                elif c == "}" and text[j - 1] != "\\":
                    depth -= 1
                    if depth == 0:
                        return text[i + 1:j].strip()
            continue  # unbalanced (truncated output): try an earlier box
        tok = re.match(r"[^\s$]+", text[i:])  # "\boxed 5"
        if tok:
            return tok.group(0)
    return None


def _clean_number(s: str) -> str:
    return re.sub(r"[\s$\\,]", "", s)


def _last_number(text: str) -> str | None:
    hits = list(_NUMBER.finditer(text))
    if not hits:
        return None
    m = hits[-1]
    num = _clean_number(m.group(0))
    # "5-3", "20 - 5": after a number or bracket the minus is an operator, not a sign.
    if num.startswith("-") and re.search(r"[\d)\]]\s*$", text[max(0, m.start() - 64):m.start()]):
        num = num[1:]
    return num


def _gsm8k_fallback(text: str) -> str | None:
    hashes = re.findall(r"####\s*([^\n]*)", text)
    for line in reversed(hashes):
        m = _NUMBER.search(line)
        if m:
            return _clean_number(m.group(0))
    return _last_number(text)


def extract_answer(text: str, task: str) -> str | None:
    """The model's final answer as a string, or None.

    The answer section after the last ``</think>`` is searched first; if it has none
    (output cut after ``</think>``), or there is no ``</think>`` at all, the whole text is.
    Only gsm8k falls back to a bare number: for LaTeX tasks the last number of an
    unfinished trace is noise, not an answer.
    """
    if not text:
        return None
    parts = [text.rsplit("</think>", 1)[1], text] if "</think>" in text else [text]
    for part in parts:
        ans = last_boxed(part)
        if ans is None and task == "gsm8k":
            ans = _gsm8k_fallback(part)
        if ans:
            return ans
    return None


def reference_answer(problem, task: str) -> str:
    """Gradeable gold answer from a ``Problem``, a ``Trace`` or a raw answer string."""
    ans = problem if isinstance(problem, str) else getattr(problem, "answer", None)
    if ans is None:
        ans = getattr(problem, "gt_answer", None)
    if ans is None:
        raise ValueError(f"no reference answer on {problem!r}")
    ans = str(ans).strip()
    if task == "gsm8k":
        if "####" in ans:
            ans = ans.rsplit("####", 1)[1].strip()
        ans = re.sub(r"(?<=\d),(?=\d{3}(?!\d))", "", ans)
    return ans


def _timeouts() -> int | None:
    # math-verify times out via signal.alarm, which raises off the main thread.
    return VERIFY_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None


def is_correct(model_text: str, reference: str, task: str) -> bool:
    """True when the model's final answer is mathematically equal to ``reference``.

    Never raises on bad input or grader trouble (timeouts, sympy errors): a grading
    failure counts as wrong, which is what a benchmark run needs.
    """
    try:
        from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify
        from math_verify.errors import TimeoutException
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("grading needs math-verify: pip install math-verify") from e
    pred = extract_answer(model_text or "", task)
    if not pred or len(pred) > MAX_ANSWER_CHARS or not reference:
        return False
    gold_text = reference_answer(str(reference), task)
    if "\\boxed" not in gold_text:
        gold_text = f"${gold_text}$"
    configs = [LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig()]
    t = _timeouts()
    try:
        gold = parse(gold_text, extraction_config=configs, parsing_timeout=t)
        target = parse(f"\\boxed{{{pred}}}", extraction_config=configs, parsing_timeout=t)
        if not gold or not target:
            return False
        return bool(verify(gold, target, timeout_seconds=t))
    except (Exception, TimeoutException):  # TimeoutException derives from BaseException
        log.debug("grading failed for %r vs %r", pred, reference, exc_info=True)
        return False
