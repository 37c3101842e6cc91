"""The multi-turn demo (tracetrain.demo.tool_agent): held-out sets disjoint from training by construction, and
how an episode is scored."""

from __future__ import annotations

import random

import pytest

pytest.importorskip("langchain_openai", reason="the langchain extra: bash scripts/setup.sh")

from langchain_core.messages import HumanMessage, ToolMessage  # noqa: E402

from tracetrain.demo import arithmetic, tool_agent  # noqa: E402


@pytest.mark.parametrize("count", sorted(tool_agent.SPLITS))
def test_no_held_out_set_is_asked_in_training_in_any_order(count: int) -> None:
    train, validation, test = tool_agent.SPLITS[count]
    as_sets = [{tuple(sorted(p)) for p in part} for part in (train, validation, test)]
    assert not (as_sets[0] & as_sets[1]) and not (as_sets[0] & as_sets[2]) and not (as_sets[1] & as_sets[2])
    rng = random.Random(0)
    for _ in range(500):
        operands, group = tool_agent.make_problem(rng, count)
        assert len(operands) == count and tuple(sorted(operands)) in as_sets[0]
        assert group == "tools-" + "-".join(map(str, operands))
    for split, held in (("validation", as_sets[1]), ("test", as_sets[2])):
        problems = tool_agent.held_out(len(held), count, split)
        assert {tuple(sorted(p)) for p in problems} == held and problems == tool_agent.held_out(len(held), count, split)


def test_two_operands_are_the_arithmetic_demos_split() -> None:
    assert tool_agent.SPLITS[2] == (list(arithmetic.TRAIN), list(arithmetic.VALIDATION), list(arithmetic.TEST))
    assert [len(part) for part in tool_agent.SPLITS[3]][1:] == [64, 96]


def test_correct_is_the_first_number_of_the_answer() -> None:
    assert tool_agent.correct("44", 44) == 1.0
    assert tool_agent.correct("The total is 44.", 44) == 1.0
    assert tool_agent.correct("12 + 32 = 44", 44) == 0.0
    assert tool_agent.correct("", 44) == 0.0


def test_partial_reward_pays_in_full_only_a_bare_total() -> None:
    partial = tool_agent.REWARDS["partial"]
    assert partial("44", 44) == 1.0
    assert partial("<tool_response>\n44", 44) == 0.5  # right, but wrapped in the template's markup
    assert 0.0 < partial("40", 44) < 0.5 and partial("", 44) == 0.0


def test_the_tool_turns_reached_the_total_when_the_last_result_is_it() -> None:
    asked = [HumanMessage("Add up 12, 7 and 25.")]
    results = [ToolMessage(str(n), tool_call_id=str(i)) for i, n in enumerate((19, 44, 44, 45))]
    assert tool_agent.tools_reached([*asked, *results[:2]], 44)
    assert not tool_agent.tools_reached([*asked, *results[2:]], 44)  # right once, then wrong
    assert not tool_agent.tools_reached(asked, 44)  # no tool ran: a cut call
