"""Fuzzing the front's HTTP bodies (issue 26, item 6): ``/v1/completions`` and
``/v1/chat/completions`` of ``integrations/vllm/front.py``.

Hypothesis makes the bodies here (derandomized: the same cases every run): bytes that are not
JSON or not UTF-8, JSON of any shape, OpenAI bodies whose known fields carry wrong types, huge
numbers, odd unicode (lone surrogates, NUL, bidi controls, emoji), missing fields, chat
``messages`` of any shape, valid bodies mutated byte-wise, values nested past the recursion
limit and a body over the front's 4 MiB limit. They are posted to the front's real aiohttp app
with the model's real tokenizer in the vLLM venv (aiohttp lives there:
tests/vllm_checks/front_fuzz_check.py); only what follows parsing is a stand-in.

Asserted: every answer is a 200 (parsed) or a 4xx whose body is OpenAI's error shape
(``invalid_request_error`` with a code) — never a 5xx, never another shape; afterwards the
front still answers ``/health`` and a valid request.
"""

from __future__ import annotations

import base64
import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.test_fuzz_decoders import FIELD_VALUES, HTTP_BODIES, JSON, json_text
from tests.vllm_env import require_vllm, run_check

pytestmark = [pytest.mark.vllm, pytest.mark.vllm_light, pytest.mark.reliability]

EXAMPLES = 300
PATHS = ("/v1/completions", "/v1/chat/completions")
MESSAGES = st.lists(st.fixed_dictionaries(
    {}, optional={"role": st.sampled_from(["user", "system", "assistant", "tool", "", "🙂"])
                  | JSON, "content": st.text(max_size=60) | JSON, "name": FIELD_VALUES}),
    max_size=4) | JSON
BODIES = st.one_of(
    HTTP_BODIES,
    MESSAGES.map(lambda m: json_text({"model": "m", "messages": m})),
    st.tuples(st.integers(-(10**20), 10**20), FIELD_VALUES).map(
        lambda t: json_text({"model": "m", "prompt": "hi", "max_tokens": t[0], "stop": t[1]})),
    st.lists(st.integers(-(2**70), 2**70), max_size=8).map(
        lambda ids: json_text({"model": "m", "prompt": ids})),
)


def cases() -> list[dict[str, Any]]:
    """The fuzzed requests, the same every run (derandomized), plus fixed edge cases."""
    out: list[dict[str, Any]] = []

    @settings(derandomize=True, max_examples=EXAMPLES, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(path=st.sampled_from(PATHS), body=BODIES)
    def collect(path: str, body: bytes) -> None:
        out.append({"path": path, "body": base64.b64encode(body).decode()})
    collect()
    over_limit = b'{"model": "m", "prompt": "' + b"a" * (5 << 20) + b'"}'
    for path in PATHS:
        for body in (b"", b"null", b"[]", b"{}", over_limit,
                     b'{"model": "m", "messages": [' + b"[" * 200_000 + b"]" * 200_000 + b"]}"):
            out.append({"path": path, "body": base64.b64encode(body).decode()})
    return out


def test_front_answers_every_fuzzed_body_with_a_typed_4xx_or_parses_it(tmp_path, reliability):
    python, model = require_vllm()
    sent = cases()
    path = tmp_path / "cases.json"
    path.write_text(json.dumps(sent))
    got = run_check(python, str(path), str(model), script="front_fuzz_check.py", timeout=600)
    answers = got["cases"]
    assert len(answers) == len(sent)
    statuses: dict[int, int] = {}
    for case, answer in zip(sent, answers, strict=True):
        status = answer["status"]
        statuses[status] = statuses.get(status, 0) + 1
        what = (case["path"], base64.b64decode(case["body"])[:200], answer)
        if status == 200:
            assert answer["parsed"], what
            continue
        assert 400 <= status < 500, what
        assert answer["content_type"] == "application/json", what
        error = answer["error"]
        assert error and error["type"] == "invalid_request_error", what
        assert isinstance(error["code"], str) and error["code"], what
        assert isinstance(error["message"], str), what
    assert got["after"]["health"] == 200 and got["after"]["valid"] == 200, got["after"]
    assert statuses.get(200, 0) > 0 and sum(v for k, v in statuses.items() if k != 200) > 0
    reliability.record(
        "input", "front HTTP bodies: not JSON / not UTF-8, JSON of any shape, wrong field "
        "types, huge numbers, odd unicode, chat messages of any shape, mutated bodies, nesting "
        "past the recursion limit, a body over 4 MiB",
        f"statuses {dict(sorted(statuses.items()))}: every non-200 an OpenAI-shaped 4xx; "
        "front still serving", examples=len(sent))
