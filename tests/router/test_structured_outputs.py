"""vLLM's structured-output fields read into SamplingParams.response_format, without a network (the stack tests in
tests/router/http/test_chat.py run them through constrained decoding)."""

import re

import pytest

from router.openai_body import BodyError, sampling_params
from router.structured_outputs import choice_pattern


@pytest.mark.parametrize("text", ["a.b (c)", "x-y|z", "[0-9]+", "#&~^$", "plain words", "back\\slash"])
def test_a_choice_pattern_matches_its_text_alone(text):
    assert re.fullmatch(choice_pattern(text), text)
    assert not re.fullmatch(choice_pattern(text), text + "x")


def test_vllm_options_at_their_defaults_change_nothing_and_are_accepted():
    spec = {"choice": ["a", "b"], "disable_any_whitespace": False, "disable_fallback": False,
            "whitespace_pattern": None, "grammar": None, "structural_tag": None}
    assert sampling_params({"structured_outputs": spec}).response_format.regex == "(?:a|b)"
    with pytest.raises(BodyError, match="disable_fallback is not supported"):
        sampling_params({"structured_outputs": {"choice": ["a"], "disable_fallback": True}})
