"""The demo's held-out sums are disjoint from everything a training episode can draw, by construction."""

from __future__ import annotations

import random
import re

import pytest

from tracetrain.demo import arithmetic


def _pair(question: str) -> frozenset[int]:
    a, b = map(int, re.findall(r"\d+", question))
    return frozenset((a, b))


def test_the_split_covers_every_unordered_pair_exactly_once() -> None:
    parts = [set(map(frozenset, part)) for part in (arithmetic.TRAIN, arithmetic.VALIDATION, arithmetic.TEST)]
    everything = {frozenset((a, b)) for a in arithmetic.OPERANDS for b in arithmetic.OPERANDS}
    assert sum(map(len, parts)) == len(everything) == 465
    assert set().union(*parts) == everything
    assert [len(p) for p in parts] == [305, 64, 96]


@pytest.mark.parametrize("seed", [0, 1, 2, 12345])
def test_training_episodes_never_ask_a_held_out_sum_in_either_order(seed: int) -> None:
    rng = random.Random(seed)
    drawn = [arithmetic.make_problem(rng) for _ in range(20_000)]  # far more than a demo run draws
    trained = {_pair(question) for question, _, _ in drawn}
    held = {_pair(q) for q, _ in arithmetic.held_out(len(arithmetic.TEST))}
    validation = {_pair(q) for q, _ in arithmetic.held_out(len(arithmetic.VALIDATION), "validation")}
    assert not trained & held
    assert not trained & validation
    assert trained == set(map(frozenset, arithmetic.TRAIN))  # every training pair does come up
    assert {q for q, _, _ in drawn} & {f"What is {b} + {a}?" for a, b in arithmetic.TRAIN if a != b}  # both orders


def test_held_out_sets_are_fixed_and_answers_are_right() -> None:
    first, again = arithmetic.held_out(64), arithmetic.held_out(64)
    assert first == again
    assert arithmetic.held_out(96)[:64] == first
    for question, answer in first:
        a, b = map(int, re.findall(r"\d+", question))
        assert a + b == answer
    with pytest.raises(ValueError, match="96 problems"):
        arithmetic.held_out(97)


def test_the_worked_examples_are_not_held_out() -> None:
    shown = {_pair(q) for q, _ in arithmetic.EXAMPLES}
    assert shown <= set(map(frozenset, arithmetic.TRAIN))
