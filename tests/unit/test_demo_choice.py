"""The rule that chooses the demo's settings on the validation split (bench/demo_choice.py)."""

from __future__ import annotations

import pytest

from bench.demo_choice import curve_figures, decide, grid_points


def test_the_grid_is_every_combination_in_grid_order() -> None:
    assert grid_points(["advantage=rloo,grpo", "lr=1e-4,2e-4"]) == [
        ["advantage=rloo", "lr=1e-4"], ["advantage=rloo", "lr=2e-4"],
        ["advantage=grpo", "lr=1e-4"], ["advantage=grpo", "lr=2e-4"]]
    with pytest.raises(SystemExit, match="KEY=V1,V2"):
        grid_points(["lr"])


def test_a_curve_is_read_in_version_order_not_key_order() -> None:
    # "10" sorts before "2" as text: the last version is 10, not 2
    assert curve_figures({"0": 0.3, "2": 0.6, "10": 0.5}) == {"last": 0.5, "best": 0.6,
                                                               "end_below_best": pytest.approx(0.1),
                                                               "largest_fall": pytest.approx(0.1)}


def test_a_dip_that_recovers_still_counts_as_a_fall() -> None:
    figures = curve_figures({"0": 0.3, "2": 0.55, "4": 0.45, "6": 0.58})
    assert figures["end_below_best"] == 0.0 and figures["largest_fall"] == pytest.approx(0.10)


def test_a_combination_that_falls_back_loses_to_one_that_holds_even_with_a_higher_mean() -> None:
    # "falls" ends near its best on both seeds, but dipped 0.08 on the way: it does not hold
    falls = [{"last": 0.60, "best": 0.60, "largest_fall": 0.08}, {"last": 0.62, "best": 0.63, "largest_fall": 0.01}]
    holds = [{"last": 0.55, "best": 0.57, "largest_fall": 0.02}, {"last": 0.50, "best": 0.50, "largest_fall": 0.0}]
    assert decide({"falls": falls, "holds": holds}) == ("holds", True)
    # when nothing holds, the highest mean wins and the rule says it did not hold
    assert decide({"falls": falls, "lower": [{"last": 0.1, "best": 0.5, "largest_fall": 0.4}]}) == ("falls", False)
