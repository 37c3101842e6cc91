"""Rendering, tool-call parsing and prompt planning with SmolLM2's real tokenizer."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from tracetrain.proxy.chain import ChainNode, plan_prompt
from tracetrain.proxy.partial_json import partial_object
from tracetrain.proxy.render import (
    CUT_CALL_PREFIX,
    RAW_CALL_PREFIX,
    ChatRenderer,
    canonical_message,
    history_hashes,
    parse_forced_call,
    parse_reply,
    unread_call,
)
from tracetrain.proxy.segments import make_segment_encoder


@pytest.fixture(scope="module")
def renderer(smollm2_path: Path) -> ChatRenderer:
    return ChatRenderer(AutoTokenizer.from_pretrained(str(smollm2_path)))


def test_default_system_prompt_of_the_model_is_kept(renderer: ChatRenderer) -> None:
    text = renderer.tokenizer.decode(renderer.render([{"role": "user", "content": "hi"}], None, generation=True))
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert text.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


def test_encode_gives_the_ids_transformers_gives(renderer: ChatRenderer) -> None:
    """The renderer encodes with the Rust tokenizer directly (faster): the ids must be transformers' own,
    special tokens, whitespace runs and multi-byte characters included."""
    rng = random.Random(0)
    pieces = ["<|im_start|>", "<|im_end|>", "\n", " ", "  x", "héllo", "日本語", "'s", "<tool_call>", '{"a": 1}',
              "\t", "🙂", "ab", "12345"]
    texts = ["".join(rng.choice(pieces) for _ in range(rng.randint(0, 30))) for _ in range(500)]
    assert renderer._backend is not None
    for text in texts:
        assert renderer.encode(text) == list(renderer.tokenizer.encode(text, add_special_tokens=False)), text


def test_encoding_by_words_gives_the_ids_of_encoding_whole(renderer: ChatRenderer) -> None:
    """New user messages are encoded word by word, words remembered across messages (proxy/segments.py):
    prose, code, numbers, contractions, accents and odd spacing all give the whole text's ids, twice."""
    assert renderer._segments is not None and renderer._segments.by_words
    rng = random.Random(1)
    words = ["the", "The", "THE", "agent's", "don't", "12", "345678", "x2", "naïve", "café", "日本", "🙂", "a.b",
             "foo_bar", "(call)", '"quoted"', "end.", "line\n", "\n", "\t", "", "--", "I'll", "we've", "Straße"]
    texts = [" ".join(rng.choice(words) for _ in range(rng.randint(1, 60))) for _ in range(400)]
    for _ in range(2):
        for text in texts:
            prompt = renderer.render_text([{"role": "user", "content": text}], None, generation=True)
            assert renderer.encode(prompt) == list(renderer.tokenizer.encode(prompt, add_special_tokens=False)), text


def test_encoding_numbers_digit_by_digit_gives_the_ids_of_encoding_whole(renderer: ChatRenderer) -> None:
    """SmolLM2 has no token holding a digit with anything else, so numbers are cut out of words and encoded
    digit by digit (proxy/segments.py): numbers next to letters, signs, other numbers, every kind of
    whitespace and non-ASCII digits all give the whole text's ids."""
    assert renderer._segments is not None and renderer._segments.by_digits
    rng = random.Random(2)
    parts = ["trace", "48213", "7", "0", "00", " ", "  ", "\t", "\t\t", "\n", "\n\n", "\u00a0", "\u2003", "\x1c",
             "x", "ID", "-", ".", ",", "_", "'s", "²", "٣", "日", "🙂", "v", "e", "(", "%", "$", "#"]
    texts = ["".join(rng.choice(parts) for _ in range(rng.randint(1, 40))) for _ in range(3000)]
    for _ in range(2):
        for text in texts:
            assert renderer.encode(text) == list(renderer.tokenizer.encode(text, add_special_tokens=False)), text


def test_numbers_stay_whole_where_the_vocabulary_merges_digits() -> None:
    """A byte-level BPE trained here on numbers learns tokens such as `12`: a digit is no wall there, so its
    encoder keeps numbers inside words, and still gives the whole text's ids."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    corpus = [f"item {n} costs {n * 12} and {n % 7}x{n % 13}" for n in range(2000)]
    backend.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=600, special_tokens=["<s>"],
                                                            initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    assert any(len(t) > 1 and any(c.isdigit() for c in t) for t in backend.get_vocab())  # the premise
    encoder = make_segment_encoder(backend, ["<s>item 12 costs 144"])
    assert encoder is not None and encoder.by_words and not encoder.by_digits
    for text in ["<s>item 1234 costs 14808 and 2x12", "trace48213 see 48213, 1,000 a\t\t4"]:
        assert encoder.encode(text) == backend.encode(text, add_special_tokens=False).ids


def test_encoding_by_pieces_is_refused_where_it_would_change_the_ids() -> None:
    """A Metaspace pre-tokenizer that marks only the start of the text encodes `hi` after a special token
    unmarked, but alone marked: such a tokenizer gets no piece cache (the renderer encodes whole texts)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, "<s>": 1, "hi": 2, "\u2581hi": 3, "\u2581there": 4}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    backend.add_special_tokens(["<s>"])
    assert backend.encode("<s>hi there", add_special_tokens=False).ids != [1, 3, 4]  # the premise
    assert make_segment_encoder(backend, ["<s>hi there"]) is None
    encoder = make_segment_encoder(backend, ["hi there"])  # no special token inside: no difference
    assert encoder is not None and not encoder.by_words  # not byte-level: words are not encoded alone


def test_remembered_pieces_give_the_same_ids_again(renderer: ChatRenderer) -> None:
    system = {"role": "system", "content": "You are a careful agent. " * 40}
    texts = [renderer.render_text([system, {"role": "user", "content": f"question {i}"}], None, generation=True)
             for i in range(3)]
    assert renderer._segments is not None
    for _ in range(2):  # the second round is served from remembered pieces
        for text in texts:
            assert renderer.encode(text) == list(renderer.tokenizer.encode(text, add_special_tokens=False))


def test_canonical_messages_ignore_spelling_differences() -> None:
    sdk = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a":1, "b": 2}'}}]}
    langchain = {"role": "assistant", "content": "", "tool_calls": [
        {"id": "other", "type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}]}
    assert canonical_message(sdk) == canonical_message(langchain)
    parts = {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
    assert canonical_message(parts)["content"] == "ab"


def test_history_hashes_depend_on_tools_and_order() -> None:
    a, b = {"role": "user", "content": "a"}, {"role": "user", "content": "b"}
    assert history_hashes(None, [a, b])[2] != history_hashes(None, [b, a])[2]
    assert history_hashes(None, [a])[1] != history_hashes([{"name": "t"}], [a])[1]
    assert history_hashes(None, [a, b])[1] == history_hashes(None, [a])[1]


@pytest.mark.parametrize(
    ("text", "content", "names"),
    [
        ('<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>', "", ["add"]),
        ('Let me add.\n<tool_call>{"name": "add", "arguments": {}}</tool_call>\n'
         '<tool_call>{"name": "mul", "arguments": {}}</tool_call>', "Let me add.", ["add", "mul"]),
        ('<tool_call>{"name": broken</tool_call>', '<tool_call>{"name": broken</tool_call>', []),
        ("plain answer", "plain answer", []),
    ],
)
def test_parse_reply(text: str, content: str, names: list[str]) -> None:
    parsed_content, calls = parse_reply(text, tools_enabled=True)
    assert parsed_content == content
    assert [c["function"]["name"] for c in calls] == names
    for call in calls:
        json.loads(call["function"]["arguments"])
        assert call["id"].startswith("call_")


def test_tool_calls_are_text_when_tools_are_off() -> None:
    text = '<tool_call>{"name": "add", "arguments": {}}</tool_call>'
    assert parse_reply(text, tools_enabled=False) == (text, [])


def _sampled(renderer: ChatRenderer, text: str, *, ended: bool) -> list[int]:
    ids = list(renderer.tokenizer.encode(text, add_special_tokens=False))
    return [*ids, renderer.turn_end_id] if ended else ids


@pytest.mark.parametrize("ended", [True, False])
def test_extending_a_call_reuses_its_exact_tokens(renderer: ChatRenderer, ended: bool) -> None:
    first = [canonical_message({"role": "user", "content": "hi"})]
    prompt = renderer.render(first, None, generation=True)
    sampled = _sampled(renderer, "Hello there", ended=ended)
    parent = ChainNode("c1", prompt + sampled, message_count=2)
    messages: list[dict[str, Any]] = [*first, {"role": "assistant", "content": "Hello there"},
                                      {"role": "user", "content": "more"}]
    plan = plan_prompt(renderer, messages=messages, tools=None, parent=parent, session_has_calls=True)
    assert plan.link == "extend" and plan.prefix_len == len(prompt + sampled)
    assert plan.prompt_ids[: plan.prefix_len] == prompt + sampled
    # Whether or not the model emitted <|im_end|>, the chain closes the turn as the template would.
    assert plan.prompt_ids == renderer.render(messages, None, generation=True)


def test_sampled_tokens_win_over_retokenization(renderer: ChatRenderer) -> None:
    """The model's own split of a word is kept even where the tokenizer would merge differently."""
    first = [canonical_message({"role": "user", "content": "hi"})]
    prompt = renderer.render(first, None, generation=True)
    odd_split = [*renderer.tokenizer.encode("Hel", add_special_tokens=False),
                 *renderer.tokenizer.encode("lo", add_special_tokens=False), renderer.turn_end_id]
    assert renderer.tokenizer.decode(odd_split[:-1]) == "Hello"
    parent = ChainNode("c1", prompt + odd_split, message_count=2)
    messages = [*first, {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "x"}]
    plan = plan_prompt(renderer, messages=messages, tools=None, parent=parent, session_has_calls=True)
    assert plan.link == "extend"
    assert plan.prompt_ids[: len(prompt) + len(odd_split)] == prompt + odd_split
    assert plan.prompt_ids != renderer.render(messages, None, generation=True)


def test_a_template_that_rewrites_history_is_detected(smollm2_path: Path) -> None:
    # Like reasoning templates that drop earlier assistant turns' content once the chat moves on.
    template = ("{% for m in messages %}{% if m.role == 'assistant' and not loop.last %}"
                "<|im_start|>assistant\n<|im_end|>\n{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}"
                "<|im_end|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    renderer = ChatRenderer(AutoTokenizer.from_pretrained(str(smollm2_path)), template=template)
    first = [{"role": "user", "content": "hi"}]
    prompt = renderer.render(first, None, generation=True)
    parent = ChainNode("c1", prompt + _sampled(renderer, "Hello", ended=True), message_count=2)
    messages = [*first, {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "x"}]
    plan = plan_prompt(renderer, messages=messages, tools=None, parent=parent, session_has_calls=True)
    assert plan.link == "template_mismatch" and plan.prefix_len == 0
    assert plan.prompt_ids == renderer.render(messages, None, generation=True)


def test_a_second_child_is_a_branch(renderer: ChatRenderer) -> None:
    first = [{"role": "user", "content": "hi"}]
    parent = ChainNode("c1", renderer.render(first, None, generation=True) + _sampled(renderer, "Yo", ended=True),
                       message_count=2, has_child=True)
    messages = [*first, {"role": "assistant", "content": "Yo"}, {"role": "user", "content": "again"}]
    assert plan_prompt(renderer, messages=messages, tools=None, parent=parent, session_has_calls=True).link == "branch"
    assert plan_prompt(renderer, messages=messages, tools=None, parent=None, session_has_calls=False).link == "start"


def test_a_forced_call_is_parsed_whole_even_with_markup_in_its_arguments() -> None:
    call = parse_forced_call('{"name":"search","arguments":{"query":"a </tool_call> b"}}')
    assert call["function"] == {"name": "search", "arguments": '{"query": "a </tool_call> b"}'}
    cut = parse_forced_call('{"name":"search","arguments":{"query":"cut sho', cut=True)
    assert cut["id"].startswith(CUT_CALL_PREFIX)
    assert cut["function"] == {"name": "search", "arguments": '{"query":"cut sho'}
    # Ended in its name (a stop string): still the forced call, with no name, as written.
    unread = parse_forced_call('{"na')
    assert unread["id"].startswith(RAW_CALL_PREFIX) and unread["function"] == {"name": "", "arguments": '{"na'}


@pytest.mark.parametrize(("text", "content", "name", "arguments"), [
    ('Let me.\n<tool_call>\n{"name": "lookup", "arguments": {"q": "ab', "Let me.", "lookup", '{"q": "ab'),
    ('<tool_call>\n{"name": "loo', "", "lookup", ""),  # the one tool whose name starts so
    ('<tool_call>\n{"na', "", "", ""),  # two tools could be meant
    ('<tool_call>{"name": "add", "arguments": {}}</tool_call><tool_call>{"name": "add", "arg', "", "add", ""),
])
def test_a_call_cut_by_the_token_limit_is_a_call_as_far_as_generated(text: str, content: str, name: str,
                                                                       arguments: str) -> None:
    parsed, calls = parse_reply(text, tools_enabled=True, cut=True, names=("lookup", "add"))
    assert parsed == content
    assert calls[-1]["id"].startswith(CUT_CALL_PREFIX)
    assert calls[-1]["function"] == {"name": name, "arguments": arguments}


def test_a_call_whose_json_is_whole_when_the_limit_cut_its_closing_tag_is_whole() -> None:
    (call,) = parse_reply('<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_', tools_enabled=True,
                          cut=True)[1]
    assert not unread_call(call["id"]) and call["function"]["arguments"] == '{"a": 1}'


def test_a_whole_call_with_arguments_that_are_not_json_keeps_them_as_written() -> None:
    (call,) = parse_reply('<tool_call>{"name": "add", "arguments": {"a": 1,}}</tool_call>', tools_enabled=True)[1]
    assert call["id"].startswith(RAW_CALL_PREFIX) and call["function"]["arguments"] == '{"a": 1,}'


WHOLE_ADD = '<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>'


@pytest.mark.parametrize(("text", "arguments"), [
    (WHOLE_ADD + "\n<tool_call>\nno idea\n</tool_call>", "no idea"),
    (WHOLE_ADD + "\n<tool_call>{name: add}</tool_call>", "{name: add}"),
    (WHOLE_ADD + '\n<tool_call>\n{"na', '{"na'),  # the model ended its turn in it
    (WHOLE_ADD + "\n<tool_call>\nno idea</tool_", "no idea"),
    ("<tool_call>\nno idea\n</tool_call>" + WHOLE_ADD, "no idea"),
])
def test_a_block_that_names_no_tool_beside_a_call_is_a_call_too(text: str, arguments: str) -> None:
    content, calls = parse_reply(text, tools_enabled=True, names=("lookup", "add"))
    (unread,) = [c for c in calls if c["function"]["name"] != "add"]
    assert content == "" and len(calls) == 2
    assert unread["id"].startswith(RAW_CALL_PREFIX) and unread["function"] == {"name": "", "arguments": arguments}


@pytest.mark.parametrize("end", ["<", "<tool", "<tool_call", " <tool_c"])
def test_text_cut_inside_the_opener_ends_before_it(end: str) -> None:
    assert parse_reply("It is.\n" + end, tools_enabled=True, cut=True) == ("It is.", [])
    # Not cut, or with tools off, the text is the model's own.
    assert parse_reply("It is.\n" + end, tools_enabled=True) == ("It is.\n" + end, [])
    assert parse_reply("It is.\n" + end, tools_enabled=False, cut=True) == ("It is.\n" + end, [])


@pytest.mark.parametrize(("arguments", "value"), [
    ('{"item": "[Item-11', {"item": "[Item-11"}),
    ('{"a": "x", "b', {"a": "x"}),
    ('{"a": tr', {}),
    ('{"a": "x\\', {"a": "x"}),
    ('{"a": "\\u00', {"a": ""}),
    ('{"a": [1, {"b": "c', {"a": [1, {"b": "c"}]}),
    ('{"a": 1,}', {"a": 1}),
    ("", {}),
    ("[1, 2]", {"value": [1, 2]}),
])
def test_partial_object_reads_what_it_can(arguments: str, value: dict[str, Any]) -> None:
    assert partial_object(arguments) == value


def test_every_echo_of_an_unread_call_hashes_like_the_reply() -> None:
    """As given, repaired, dropped, or as the Anthropic SDK's object: the same state; another call is not."""
    reply = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_cut_1", "type": "function", "function": {"name": "lookup", "arguments": '{"q": "ab'}}]}
    question = {"role": "user", "content": "q"}

    def state(arguments: str, call_id: str = "call_cut_1", content: str | None = None) -> str:
        echo = {"role": "assistant", "content": content, "tool_calls": [
            {"id": call_id, "type": "function", "function": {"name": "lookup", "arguments": arguments}}]}
        return history_hashes(None, [canonical_message(question), canonical_message(echo)])[-1]

    same = state('{"q": "ab')
    assert same == state('{"q": "ab"}') == state("{}") == state("") == state('{"q": "ab'.replace("ab", "cd"))
    assert same == history_hashes(None, [canonical_message(question), canonical_message(reply)])[-1]
    assert same != state('{"q": "ab', call_id="call_cut_2") != state('{"q": "ab', call_id="call_2")
    assert same != state('{"q": "ab', content="text")


def test_tool_calls_on_a_message_that_cannot_make_them_are_not_read() -> None:
    """Messages keep unknown fields, so a user or tool message may carry a `tool_calls` of any shape (a fuzzer
    sent ints, which once raised a 500): only an assistant's validated calls reach the model."""
    for role in ("user", "system", "tool", "function"):
        message = {"role": role, "content": "hi", "tool_calls": [5, {"function": 3}, "x"]}
        assert "tool_calls" not in canonical_message(message)
    reply = canonical_message({"role": "assistant", "content": None,
                               "tool_calls": [{"id": "c1", "function": {"name": "add", "arguments": '{"a": 1}'}}]})
    assert reply["tool_calls"] == [{"name": "add", "arguments": '{"a": 1}'}]
