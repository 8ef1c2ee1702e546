"""The official ``openai`` Python client against the dualpath front (run in .venv-vllm).

``python openai_client_check.py FRONT_URL MODEL_NAME`` — completions and chat, streamed and
not, ``finish_reason``, ``usage`` (``stream_options.include_usage`` too), a stop sequence,
a seeded sample, UTF-8 text, and an unsupported field refused with a typed 400. Prints one
``RESULT {json}`` line; any mismatch is an AssertionError (exit status 1).
"""

from __future__ import annotations

import json
import sys

import openai

PROMPT = ("Observation 1: ls src shows 3 files; grep finds TODO in item_1.py line 11. "
          "Observation 2: the build is green. Next step:")


def streamed_text(stream, chat: bool) -> tuple[str, list[str | None], dict | None, list[str]]:
    """Concatenated text, every choice's finish_reason, the usage chunk, chat roles seen."""
    text, reasons, usage, roles = "", [], None, []
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage.model_dump()
        for choice in chunk.choices:
            if chat:
                text += choice.delta.content or ""
                if choice.delta.role:
                    roles.append(choice.delta.role)
            else:
                text += choice.text or ""
            reasons.append(choice.finish_reason)
    return text, reasons, usage, roles


def same_counts(streamed: dict | None, whole: dict) -> bool:
    """The token counts agree; each reports its own dualpath hit as OpenAI's
    ``prompt_tokens_details.cached_tokens`` (the second request of a prompt hits what the first
    stored, so the two hits may differ), at most the prompt."""
    keys = ("prompt_tokens", "completion_tokens", "total_tokens")
    if streamed is None or any(streamed[k] != whole[k] for k in keys):
        return False
    return all(0 <= u["prompt_tokens_details"]["cached_tokens"] <= u["prompt_tokens"]
               for u in (streamed, whole))


def completions(client: openai.OpenAI, model: str) -> dict:
    full = client.completions.create(model=model, prompt=PROMPT, max_tokens=24)
    assert full.choices[0].finish_reason in ("length", "stop"), full
    assert full.usage.completion_tokens >= 1 and full.usage.prompt_tokens > 10, full.usage
    stream = client.completions.create(model=model, prompt=PROMPT, max_tokens=24, stream=True,
                                       stream_options={"include_usage": True})
    text, reasons, usage, _ = streamed_text(stream, chat=False)
    assert text == full.choices[0].text, (text, full.choices[0].text)
    assert reasons[-1] == full.choices[0].finish_reason and all(r is None for r in reasons[:-1])
    assert same_counts(usage, full.usage.model_dump()), (usage, full.usage)
    return {"text": full.choices[0].text, "usage": usage}


def chat(client: openai.OpenAI, model: str) -> dict:
    messages = [{"role": "user", "content": "Name three colours, please. Café, naïve, 東京."}]
    full = client.chat.completions.create(model=model, messages=messages, max_tokens=24)
    content = full.choices[0].message.content
    assert full.choices[0].message.role == "assistant" and content, full
    stream = client.chat.completions.create(model=model, messages=messages, max_tokens=24,
                                            stream=True, stream_options={"include_usage": True})
    text, reasons, usage, roles = streamed_text(stream, chat=True)
    assert text == content and "\ufffd" not in text, (text, content)
    assert roles == ["assistant"] and reasons[-1] == full.choices[0].finish_reason
    assert same_counts(usage, full.usage.model_dump()), (usage, full.usage)
    return {"content": content, "usage": usage}


def stop_sequence(client: openai.OpenAI, model: str, text: str) -> dict:
    """Stop at a word the unconstrained greedy output contains: the text ends before it."""
    words = [w for w in text.split() if len(w) >= 3]
    assert words, text
    stop = words[len(words) // 2]
    got = client.completions.create(model=model, prompt=PROMPT, max_tokens=24, stop=[stop])
    out = got.choices[0]
    assert out.finish_reason == "stop" and stop not in out.text, (stop, out)
    assert text.startswith(out.text), (out.text, text)
    return {"stop": stop, "text": out.text}


def seeded(client: openai.OpenAI, model: str) -> dict:
    a, b = (client.completions.create(model=model, prompt=PROMPT, max_tokens=12,
                                      temperature=0.9, seed=7).choices[0].text for _ in range(2))
    assert a == b, (a, b)
    return {"text": a}


def refused(client: openai.OpenAI, model: str) -> dict:
    try:
        client.completions.create(model=model, prompt=PROMPT, max_tokens=4, n=2)
    except openai.BadRequestError as e:
        assert e.status_code == 400 and e.code == "unsupported_parameter", e
        return {"n=2": e.code}
    raise AssertionError("n=2 was accepted")


def main(url: str, model: str) -> None:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=600)
    comp = completions(client, model)
    result = {"completions": comp, "chat": chat(client, model),
              "stop": stop_sequence(client, model, comp["text"]),
              "seeded": seeded(client, model), "refused": refused(client, model)}
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
