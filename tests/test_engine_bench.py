"""``bench engine``'s turns, the parts that need no vLLM: the timed later turn is turn 1's
prompt, its output and 200 new tokens (a real later turn), C tokens in all; every repeat
its own text (bench/engine_bench.py)."""

from __future__ import annotations

import pytest

from bench.engine_bench import GEN, NEW, prompts


def test_a_later_turn_is_the_first_prompt_its_output_and_new_tokens():
    text = list(range(10_000))
    first, new = prompts(text, 4096, offset=22)
    assert len(first) + GEN + len(new) == 4096 and len(new) == NEW
    assert first[0] == 22 and new[0] == first[-1] + 1       # the text goes on after turn 1
    other, _ = prompts(text, 4096, offset=39)
    assert other[:64] != first[:64]                          # another session's first block


def test_a_text_too_short_for_the_context_is_refused():
    with pytest.raises(ValueError, match="too short"):
        prompts(list(range(3000)), 4096, offset=0)
