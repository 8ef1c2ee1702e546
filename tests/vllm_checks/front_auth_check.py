"""The front's API key over real HTTP (aiohttp lives only in the vLLM venv).

Builds the front's app with a stand-in tokenizer and no scheduler connection (nothing here
reaches the scheduler: the key is checked before a handler runs) and checks, with and without
``--api-key`` / ``--api-key-file``: ``/health`` and ``/metrics`` stay open; ``/v1/*`` without a
key, with a wrong key or another scheme is a 401 in OpenAI's error shape (``invalid_api_key``)
that never echoes what was sent; the right Bearer key passes. Prints one ``RESULT {json}`` line.

    .venv-vllm/bin/python tests/vllm_checks/front_auth_check.py KEY_FILE
"""

import asyncio
import json
import sys

from aiohttp.test_utils import TestClient, TestServer

from integrations.vllm.front import Front, FrontConfig

KEY = "sk-dualpath-test-0123456789"


async def statuses(cfg: FrontConfig) -> dict:
    front = Front(cfg, tokenizer=None)

    async def no_scheduler(app):
        return None
    front._start = no_scheduler               # the key check needs no scheduler
    out = {}
    async with TestClient(TestServer(front.app())) as http:
        for name, method, path, headers in [
                ("health", "GET", "/health", {}),
                ("metrics", "GET", "/metrics", {}),
                ("models_none", "GET", "/v1/models", {}),
                ("models_wrong", "GET", "/v1/models", {"Authorization": "Bearer sk-wrong"}),
                ("models_basic", "GET", "/v1/models", {"Authorization": f"Basic {KEY}"}),
                ("models_ok", "GET", "/v1/models", {"Authorization": f"Bearer {KEY}"}),
                ("completions_none", "POST", "/v1/completions", {}),
                ("chat_wrong", "POST", "/v1/chat/completions",
                 {"Authorization": "Bearer sk-wrong"})]:
            r = await http.request(method, path, headers=headers, data=b"{}")
            text = await r.text()
            body = json.loads(text) if r.content_type == "application/json" else None
            out[name] = {"status": r.status,
                         "code": (body or {}).get("error", {}).get("code"),
                         "type": (body or {}).get("error", {}).get("type"),
                         "echoes": "sk-wrong" in text}
    await front.sched.close()
    return out


async def main(key_file: str) -> None:
    base = {"model_name": "m", "tokenizer": "t", "scheduler_host": "127.0.0.1",
            "scheduler_port": 1, "engines": {"p0.e0": "http://127.0.0.1:1"}}
    result = {"open": await statuses(FrontConfig(**base)),
              "key": await statuses(FrontConfig(**base, api_key=KEY)),
              "key_file": await statuses(FrontConfig(**base, api_key_file=key_file))}
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1]))
