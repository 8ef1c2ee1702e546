"""The front's HTTP bodies, fuzzed, through its real aiohttp app (aiohttp lives in the vLLM
venv; the cases come from tests/test_fuzz_front.py, made with hypothesis in the main venv).

The app is the front's own (routes, middleware, ``_serve``, ``_parse``, the model's real
tokenizer); only what comes after parsing is a stand-in — no scheduler connection, and a
``_generate`` that answers 200 with what the parser produced — so every answer here is the
parsing layer's. Each case is posted as-is; then ``/health`` and a valid request must still
answer 200. Prints one ``RESULT {json}`` line: per case its status, content type and error
fields.

    .venv-vllm/bin/python tests/vllm_checks/front_fuzz_check.py CASES_JSON MODEL_DIR
"""

import asyncio
import base64
import json
import sys

from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from integrations.vllm.front import Front, FrontConfig

VALID = {"model": "m", "prompt": "Hello there", "max_tokens": 4}


async def main(cases_file: str, model_dir: str) -> None:
    from transformers import AutoTokenizer
    cases = json.loads(open(cases_file).read())
    cfg = FrontConfig(model_name="m", tokenizer=model_dir, scheduler_host="127.0.0.1",
                      scheduler_port=1, engines={"p0.e0": "http://127.0.0.1:1"})
    front = Front(cfg, AutoTokenizer.from_pretrained(model_dir))

    async def no_scheduler(app: web.Application) -> None:
        return None

    async def parsed(request: web.Request, call) -> web.Response:   # after parsing: a stand-in
        return web.json_response({"parsed": True, "prompt_tokens": len(call.ids),
                                  "max_tokens": call.max_tokens})
    front._start = no_scheduler
    front._generate = parsed
    out = []
    async with TestClient(TestServer(front.app())) as http:
        for case in cases:
            r = await http.post(case["path"], data=base64.b64decode(case["body"]),
                                headers={"Content-Type": "application/json"})
            text = await r.text()
            try:
                body = json.loads(text)
            except ValueError:
                body = None
            error = body.get("error") if isinstance(body, dict) else None
            out.append({"status": r.status, "content_type": r.content_type,
                        "error": error if isinstance(error, dict) else None,
                        "parsed": isinstance(body, dict) and body.get("parsed") is True,
                        "text": text[:300]})
        health = (await http.get("/health")).status
        valid = await http.post("/v1/completions", json=VALID)
        after = {"health": health, "valid": valid.status, "valid_body": await valid.json()}
    await front.sched.close()
    print("RESULT " + json.dumps({"cases": out, "after": after}), flush=True)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2]))
