"""Search tasks: the prompt, the value of a proposed block, and the grader of the final answer.

* ``game24``: puzzles generated and solved in the repo (``game24.py``). A block's value comes from an exact
  arithmetic verifier: 1 for a valid step that leaves a solvable set (or a correct final expression),
  0.4 for a valid step into an unsolvable set, 0 for anything else. The grader checks the final
  expression exactly against the puzzle's numbers.
* ``gsm8k`` / ``math500``: a block's value is the model's own confidence in it (the mean probability of its
  sampled tokens; no evaluation prompt, no reference answer inside the search). A block that ends the text
  (EOS) or states a boxed / "the answer is" answer is a leaf; the best leaf's answer is graded by trtkv's
  answer checker against the reference (outside the search).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from trtkv.errors import TrtkvError
from trtkv.search import game24

SEARCH_TASKS = ("game24", "gsm8k", "math500")

GAME24_PROMPT = ("Make 24 from {numbers} with + - * /, each number once. One step per line like "
                 "'13 - 9 = 4 (left: 4 4 10)', then 'Answer: (expression) = 24'.")
MATH_SUFFIX = "\nSolve it step by step, one step per line, and end with 'The answer is N.'"


@dataclass(frozen=True)
class SearchProblem:
    id: str
    prompt: str
    data: Any  # game24: the numbers; math: the eval Problem

    @classmethod
    def from_text(cls, task: str, text: str) -> "SearchProblem":
        """A problem typed by a user: game24 "4 9 10 13"; math: the question (no reference answer)."""
        if task == "game24":
            try:
                nums = tuple(sorted(int(x) for x in text.replace(",", " ").split()))
            except ValueError:
                nums = ()
            if len(nums) != 4:
                raise TrtkvError(f"a game24 problem is four integers such as '4 9 10 13', got {text!r}")
            return cls(f"g24-{'-'.join(map(str, nums))}", GAME24_PROMPT.format(numbers=" ".join(map(str, nums))),
                       nums)
        from trtkv.eval.datasets import Problem

        return cls("user", text + MATH_SUFFIX, Problem("user", text, "", "user"))


@dataclass
class Scored:
    value: float  # in [0, 1]
    state: Any  # what the children verify against (game24: the numbers left)
    answer: str | None = None  # set when the block states a final answer (a leaf)


class SearchTask:
    name = ""

    def problems(self, limit: int | None, data: str | None, seed: int) -> list[SearchProblem]:
        raise NotImplementedError

    def root_state(self, problem: SearchProblem) -> Any:
        return None

    def score(self, problem: SearchProblem, parent_state: Any, text: str, probs: list[float],
              terminal: bool) -> Scored:
        raise NotImplementedError

    def grade(self, problem: SearchProblem, answer: str | None) -> bool:
        raise NotImplementedError

    def solved(self, problem: SearchProblem, scored: Scored) -> bool:
        """May the search stop here (a verified solution, without the reference)?"""
        return False


class Game24Task(SearchTask):
    name = "game24"

    def problems(self, limit, data, seed):
        if data is not None:
            raise TrtkvError("game24 puzzles are generated (no data file); drop --data")
        puzzles = game24.generate_puzzles(20 if limit is None else limit, seed)
        return [SearchProblem(f"g24-{'-'.join(map(str, p))}", GAME24_PROMPT.format(numbers=" ".join(map(str, p))), p)
                for p in puzzles]

    def root_state(self, problem):
        return tuple(sorted(Fraction(n) for n in problem.data))

    def score(self, problem, parent_state, text, probs, terminal):
        expr = game24.answer_expression(text)
        if expr is not None:
            ok = game24.check_expression(expr, problem.data)
            return Scored(1.0 if ok else 0.0, parent_state, expr)
        left = game24.apply_step(parent_state, text)
        if left is None:
            return Scored(0.0, parent_state, "" if terminal else None)
        return Scored(1.0 if game24.solvable(left) else 0.4, left, "" if terminal else None)

    def grade(self, problem, answer):
        return game24.check_expression(answer, problem.data)

    def solved(self, problem, scored):
        return scored.answer is not None and game24.check_expression(scored.answer, problem.data)


class MathTask(SearchTask):
    def __init__(self, name: str):
        self.name = name

    def problems(self, limit, data, seed):
        from trtkv.eval.datasets import DataFileNotFoundError, load_problems

        try:
            probs = load_problems(self.name, data, limit)
        except DataFileNotFoundError as e:
            raise TrtkvError(str(e)) from None
        return [SearchProblem(p.id, p.question + MATH_SUFFIX, p) for p in probs]

    def score(self, problem, parent_state, text, probs, terminal):
        from trtkv.eval.answers import extract_answer

        value = sum(probs) / len(probs) if probs else 0.0
        low = text.lower()
        if terminal or "\\boxed" in text or "answer is" in low:
            path = (parent_state or "") + text
            m = re.findall(r"answer is\s*:?\s*\$?([^\n$]+?)\$?\s*(?:\.\s|\.?$|\n)", path, re.IGNORECASE)
            return Scored(value, path, extract_answer(path, self.name) or (m[-1].strip() if m else ""))
        return Scored(value, (parent_state or "") + text)

    def grade(self, problem, answer):
        from trtkv.eval.answers import is_correct, reference_answer

        if not answer:
            return False
        return is_correct(f"The answer is \\boxed{{{answer}}}", reference_answer(problem.data, self.name), self.name)


def get_task(name: str) -> SearchTask:
    if name == "game24":
        return Game24Task()
    if name in ("gsm8k", "math500"):
        return MathTask(name)
    raise TrtkvError(f"unknown search task {name!r}; choose one of {', '.join(SEARCH_TASKS)}")
