"""Which tokens a checkpoint's probe scores (engines/probe.py `probe_token_ids`), on real tokenizers."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.setup_steps import TORCH_MISSING

pytest.importorskip("transformers", reason=TORCH_MISSING)

from transformers import AutoTokenizer  # noqa: E402

from bench.gpu_check import write_word_tokenizer  # noqa: E402
from tracetrain.engines.probe import PROBE_LENGTH, PROBE_POSITIONS, PROBE_TEXT, probe_token_ids  # noqa: E402


def test_a_tokenizer_that_knows_the_text_scores_the_text(smollm2_path: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(str(smollm2_path))
    assert probe_token_ids(tokenizer) == tokenizer.encode(PROBE_TEXT, add_special_tokens=False)


def test_a_word_vocabulary_that_does_not_know_it_scores_a_fixed_draw_of_its_words(tmp_path: Path) -> None:
    """The bench's 64-word tokenizer maps the probe's text to `<unk>` throughout: one token, scored over and
    over, that the policy never emits. The probe draws ordinary words instead, the same ones every time."""
    write_word_tokenizer(tmp_path, 64)
    tokenizer = AutoTokenizer.from_pretrained(str(tmp_path))
    assert set(tokenizer.encode(PROBE_TEXT, add_special_tokens=False)) == {tokenizer.unk_token_id}
    ids = probe_token_ids(tokenizer)
    assert len(ids) == PROBE_LENGTH and len(set(ids)) >= PROBE_POSITIONS
    assert not set(ids) & set(tokenizer.all_special_ids) and max(ids) < 64
    assert ids == probe_token_ids(AutoTokenizer.from_pretrained(str(tmp_path)))
