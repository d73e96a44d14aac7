"""Game of 24: puzzle generation, an exact solver, the step verifier and the answer grader (no download).

Four numbers in 1..13 must be combined with + - * / (each number used exactly once) into 24. Arithmetic is
exact (fractions). A search step is a line ``a op b = c (left: x y z)``; the last line is
``Answer: <expression> = 24``.
"""
from __future__ import annotations

import ast
import random
import re
from collections import Counter
from fractions import Fraction
from functools import lru_cache

TARGET = Fraction(24)
_OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b,
        "/": lambda a, b: a / b if b != 0 else None}


@lru_cache(maxsize=100_000)
def _solve(nums: tuple[Fraction, ...]) -> str | None:
    """An expression over ``nums`` equal to 24, or None. Exhaustive over pairs and operations."""
    if len(nums) == 1:
        return _fmt(nums[0]) if nums[0] == TARGET else None
    return _search([(n, _fmt(n)) for n in nums])


def _search(items: list[tuple[Fraction, str]]) -> str | None:
    if len(items) == 1:
        return items[0][1] if items[0][0] == TARGET else None
    for i in range(len(items)):
        for j in range(len(items)):
            if i == j:
                continue
            (a, ea), (b, eb) = items[i], items[j]
            rest = [items[k] for k in range(len(items)) if k not in (i, j)]
            for op, fn in _OPS.items():
                if op in "+*" and i > j:
                    continue  # commutative: one order is enough
                c = fn(a, b)
                if c is None:
                    continue
                found = _search(rest + [(c, f"({ea} {op} {eb})")])
                if found:
                    return found
    return None


def _fmt(x: Fraction) -> str:
    return str(x.numerator) if x.denominator == 1 else f"{x.numerator}/{x.denominator}"


def solve(numbers) -> str | None:
    """An expression reaching 24 from ``numbers`` (each used once), or None when unsolvable."""
    return _solve(tuple(sorted(Fraction(n) for n in numbers)))


def solvable(numbers) -> bool:
    return solve(numbers) is not None


def generate_puzzles(count: int, seed: int = 0) -> list[tuple[int, int, int, int]]:
    """``count`` distinct solvable puzzles (sorted 4-tuples), reproducible from ``seed``."""
    rng = random.Random(seed)
    seen: set[tuple[int, ...]] = set()
    out = []
    while len(out) < count:
        p = tuple(sorted(rng.randint(1, 13) for _ in range(4)))
        if p not in seen and solvable(p):
            seen.add(p)
            out.append(p)
    return out


_STEP = re.compile(r"(-?\d+(?:/\d+)?)\s*([-+*/x×÷])\s*(-?\d+(?:/\d+)?)\s*=\s*(-?\d+(?:/\d+)?)")
_ANSWER = re.compile(r"answer\s*:\s*(.+?)(?:=\s*24\s*)?$", re.IGNORECASE)


def parse_step(line: str) -> tuple[Fraction, str, Fraction, Fraction] | None:
    m = _STEP.search(line)
    if not m:
        return None
    op = {"x": "*", "×": "*", "÷": "/"}.get(m.group(2), m.group(2))
    return Fraction(m.group(1)), op, Fraction(m.group(3)), Fraction(m.group(4))


def apply_step(remaining: tuple[Fraction, ...], line: str) -> tuple[Fraction, ...] | None:
    """The numbers left after a proposed step, or None when the step is not exact arithmetic on two of
    the remaining numbers."""
    step = parse_step(line)
    if step is None:
        return None
    a, op, b, c = step
    left = Counter(remaining)
    for x in (a, b):
        if left[x] <= 0:
            return None
        left[x] -= 1
    if _OPS[op](a, b) != c:
        return None
    return tuple(sorted(list(left.elements()) + [c]))


def answer_expression(text: str) -> str | None:
    for line in reversed(text.strip().splitlines()):
        m = _ANSWER.search(line.strip())
        if m:
            return m.group(1).strip()
    return None


def check_expression(expr: str | None, numbers) -> bool:
    """Exact grader: ``expr`` uses exactly ``numbers`` (as a multiset), only + - * / and parentheses, and
    evaluates to exactly 24."""
    if not expr:
        return False
    expr = expr.replace("×", "*").replace("x", "*").replace("÷", "/")
    if "=" in expr:
        expr = expr.split("=")[0]
    try:
        tree = ast.parse(expr.strip(), mode="eval")
    except SyntaxError:
        return False
    used: list[Fraction] = []

    def ev(node) -> Fraction:
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, int) and not isinstance(node.value, bool):
            used.append(Fraction(node.value))
            return Fraction(node.value)
        if isinstance(node, ast.BinOp) and type(node.op) in (ast.Add, ast.Sub, ast.Mult, ast.Div):
            a, b = ev(node.left), ev(node.right)
            if isinstance(node.op, ast.Add):
                return a + b
            if isinstance(node.op, ast.Sub):
                return a - b
            if isinstance(node.op, ast.Mult):
                return a * b
            if b == 0:
                raise ZeroDivisionError
            return a / b
        raise ValueError("not an arithmetic expression")

    try:
        value = ev(tree)
    except (ValueError, ZeroDivisionError, RecursionError):
        return False
    return value == TARGET and Counter(used) == Counter(Fraction(n) for n in numbers)
