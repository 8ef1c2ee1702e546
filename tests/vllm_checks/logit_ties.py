"""Why the real-engine equality tests serve the model in float32 (docs/vllm.md).

Plain vLLM, one instance, over the tests' 6-turn conversation (1,250 -> 1,530 tokens): prefix
caching on vs off, greedy, top-2 logprobs. Prints per turn whether the outputs agree and the
smallest top-2 gap of the reference: in bf16 it is exactly 0.0 at some turns (the logits tie,
so argmax is decided by the last bit of the computation), in fp32 it is not.

    .venv-vllm/bin/python tests/vllm_checks/logit_ties.py MODEL_DIR bfloat16|float32

Not part of the suite (a measurement, ~1 min per dtype); it runs in the vLLM venv.
"""

import os
import sys

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def conversation(model: str, dtype: str, caching: bool, prompts=None, turns: int = 6):
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=model, dtype=dtype, enforce_eager=True, max_model_len=2048,
              enable_prefix_caching=caching, max_num_batched_tokens=2048)
    sp = SamplingParams(temperature=0.0, max_tokens=16, logprobs=2)
    text = " ".join(f"Observation {i}: ls src/{i} shows {i * 3} files; grep finds TODO in "
                    f"item_{i}.py line {i * 11}." for i in range(160))
    ids = llm.get_tokenizer().encode(text)
    outs, seen = [], []
    prompt, cur = ids[:1250], 1250
    for t in range(turns):
        if prompts is not None:
            prompt = prompts[t]
        o = llm.generate([TokensPrompt(prompt_token_ids=prompt)], sp, use_tqdm=False)[0].outputs[0]
        gaps = []
        for lp in o.logprobs:
            v = sorted((x.logprob for x in lp.values()), reverse=True)
            gaps.append(v[0] - v[1] if len(v) > 1 else float("inf"))
        outs.append((list(o.token_ids), gaps))
        seen.append(list(prompt))
        prompt = prompt + list(o.token_ids) + ids[cur:cur + 40]
        cur += 40
    return outs, seen


if __name__ == "__main__":
    model, dtype = sys.argv[1], sys.argv[2]
    on, prompts = conversation(model, dtype, True)
    off, _ = conversation(model, dtype, False, prompts=prompts)
    for t, ((a, _), (b, gaps)) in enumerate(zip(on, off)):
        print(f"RESULT {dtype} turn {t} prompt {len(prompts[t])}: equal={a == b} "
              f"min_top2_gap={min(gaps):.4f}", flush=True)
