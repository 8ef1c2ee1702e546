"""The front's OpenAI usage object reports the dualpath hit the way OpenAI reports prompt
caching (``prompt_tokens_details.cached_tokens``), in whole responses and in the streamed
``include_usage`` chunk alike, so clients such as AIPerf see the hit without a dualpath field."""

from __future__ import annotations

from integrations.vllm import openai_api as api


def test_the_hit_is_reported_as_cached_prompt_tokens():
    body = api.response("r1", "m", True, "hi", "length", 300, 4, 0, cached_tokens=256)
    assert body["usage"] == {"prompt_tokens": 300, "completion_tokens": 4, "total_tokens": 304,
                             "prompt_tokens_details": {"cached_tokens": 256}}
    last = api.usage_chunk("r1", "m", True, 0, body["usage"])
    assert last["choices"] == [] and last["usage"] == body["usage"]
    assert "prompt_tokens_details" not in api.usage(10, 2)     # no hit known: no claim
