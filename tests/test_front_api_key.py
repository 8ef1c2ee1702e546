"""The front's API key (``--api-key`` / ``--api-key-file``; docs/security.md, "front").

The pure part (key loading, the Bearer check, OpenAI's 401 shape) runs here; the HTTP part
(``/v1/*`` guarded, ``/health`` and ``/metrics`` open) runs the front's real aiohttp app in the
vLLM venv, where aiohttp lives (tests/vllm_checks/front_auth_check.py).
"""

from __future__ import annotations

import pytest

from integrations.vllm import openai_api as api
from tests.vllm_env import run_check, skip_or_fail
from tools.vllm_engines import VLLM_PYTHON

KEY = b"sk-dualpath-test-0123456789"


def test_bearer_key_is_required_and_compared_exactly():
    api.check_api_key(None, None)                         # no key configured: open
    api.check_api_key("Bearer anything", None)
    api.check_api_key("Bearer " + KEY.decode(), KEY)
    api.check_api_key("bearer  " + KEY.decode() + " ", KEY)    # scheme is case-insensitive
    for header in (None, "", "Bearer", "Bearer sk-wrong", "Bearer " + KEY.decode()[:-1],
                   "Bearer " + KEY.decode() + "x", "Basic " + KEY.decode(), KEY.decode()):
        with pytest.raises(api.HttpError) as e:
            api.check_api_key(header, KEY)
        assert (e.value.status, e.value.code) == (401, "invalid_api_key"), header
        assert "sk-wrong" not in str(e.value) and KEY.decode() not in str(e.value)
    body = api.error_body(401, "no API key provided", "invalid_api_key")
    assert body == {"error": {"message": "no API key provided", "type": "invalid_request_error",
                              "code": "invalid_api_key"}}


def test_the_comparison_is_constant_time(monkeypatch):
    seen = []
    real = api.hmac.compare_digest

    def spy(a, b):
        seen.append((a, b))
        return real(a, b)
    monkeypatch.setattr(api.hmac, "compare_digest", spy)
    with pytest.raises(api.HttpError):
        api.check_api_key("Bearer sk-wrong", KEY)
    assert seen == [(b"sk-wrong", KEY)]


def test_key_from_flag_or_file_and_misconfiguration_is_refused(tmp_path):
    assert api.load_api_key("", "") is None
    assert api.load_api_key("k1", "") == b"k1"
    path = tmp_path / "key"
    path.write_text(KEY.decode() + "\n")
    assert api.load_api_key("", str(path)) == KEY          # trailing newline stripped
    with pytest.raises(ValueError, match="only one of --api-key and --api-key-file"):
        api.load_api_key("k1", str(path))
    with pytest.raises(ValueError, match="--api-key-file .* cannot be read"):
        api.load_api_key("", str(tmp_path / "missing"))
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ValueError, match="--api-key-file .* is empty"):
        api.load_api_key("", str(tmp_path / "empty"))


@pytest.mark.vllm
@pytest.mark.vllm_light
def test_front_http_guards_v1_and_leaves_health_open(tmp_path):
    if not VLLM_PYTHON.exists():
        skip_or_fail(f"{VLLM_PYTHON} missing (the front's aiohttp lives there)")
    key_file = tmp_path / "key"
    key_file.write_text(KEY.decode() + "\n")
    got = run_check(VLLM_PYTHON, str(key_file), script="front_auth_check.py", timeout=300)
    for name, r in got["open"].items():                   # no key: everything answers
        assert r["status"] != 401, (name, r)
    for mode in ("key", "key_file"):
        res = got[mode]
        assert res["health"]["status"] == 200 and res["metrics"]["status"] == 200, res
        assert res["models_ok"]["status"] == 200, res
        for name in ("models_none", "models_wrong", "models_basic", "completions_none",
                     "chat_wrong"):
            assert res[name] == {"status": 401, "code": "invalid_api_key",
                                 "type": "invalid_request_error", "echoes": False}, (mode, name)
