"""The two-policy demo's task: held-out pairs never asked in training, and a reward that reads which
option a reply names."""

from __future__ import annotations

import itertools
import random

import pytest

from tracetrain.demo import choices


def test_the_split_covers_every_pair_once_and_leaves_the_examples_out() -> None:
    parts = [set(map(frozenset, part)) for part in (choices.TRAIN, choices.VALIDATION, choices.TEST)]
    everything = {frozenset(p) for words in choices.CATEGORIES.values() for p in itertools.combinations(words, 2)}
    shown = {frozenset(options) for options, _ in choices.EXAMPLES}
    assert not shown & everything  # the worked examples' words are in no category
    assert sum(map(len, parts)) == len(everything) == 270
    assert set().union(*parts) == everything
    assert [len(p) for p in parts] == [158, 48, 64]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_training_never_asks_a_held_out_pair_and_asks_both_orders(seed: int) -> None:
    rng = random.Random(seed)
    drawn = [choices.make_problem(rng) for _ in range(20_000)]
    asked = {frozenset(options) for options in drawn}
    assert not asked & {frozenset(p) for p in choices.held_out(len(choices.TEST))}
    assert not asked & {frozenset(p) for p in choices.held_out(len(choices.VALIDATION), "validation")}
    assert asked == set(map(frozenset, choices.TRAIN))
    assert set(drawn) & {(b, a) for a, b in drawn}  # the same pair comes up either way round


def test_held_out_questions_are_fixed() -> None:
    assert choices.held_out(32) == choices.held_out(64)[:32]
    with pytest.raises(ValueError, match="64 pairs"):
        choices.held_out(65)


@pytest.mark.parametrize(("reply", "named"), [
    ("apples", "first"), ("Apple.", "first"), ("  pears!", "second"), ("pear", "second"),
    ("apples and pears", "other"), ("bananas", "other"), ("", "other"),
])
def test_a_reply_names_one_option_or_neither(reply: str, named: str) -> None:
    assert choices.named(reply, "apples", "pears") == named
    assert choices.score(reply, "apples", "pears", "first") == (named == "first")
    assert choices.score(reply, "apples", "pears", "second") == (named == "second")


def test_the_same_reply_earns_opposite_rewards_on_the_two_policies() -> None:
    for first, second in choices.held_out(16):
        rewards = [choices.score(first, first, second, prefer) for prefer in ("first", "second")]
        assert rewards == [1.0, 0.0]
