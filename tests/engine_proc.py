"""An engine in its own process for tests/test_engine_ipc.py, through ``SyncEngineClient``.

    python -m tests.engine_proc prefill SOCK ENGINE_ID SPEC_JSON OUT.npz [--claim RID]
    python -m tests.engine_proc decode  SOCK ENGINE_ID SPEC_JSON OUT.npz [--claim RID]
    python -m tests.engine_proc hold    SOCK ENGINE_ID SPEC_JSON -     [--claim RID]

``prefill``: one request; per layer it copies the hit KV it was given, writes the new tokens'
KV (the emulator's pattern) and puts the layer, then finishes with first token 11; the hit it
saw and what it wrote go to OUT.npz. ``decode``: one request; copies the full prompt KV, writes
back every generated block the rules allow (pattern of its key), finishes; the prompt KV goes
to OUT.npz. ``hold``: takes a prefill request, loads layer 0, prints ``holding`` and sleeps
(the test kills it with SIGKILL). Errors are printed as ``error CODE message`` and exit 3.
"""

from __future__ import annotations

import argparse
import sys
import time

import msgspec
import numpy as np

from common.errors import DualpathError
from common.kv import KVSpec
from services.engine_api.remote import SyncEngineClient
from tools.engine_sim.kv_pattern import fill_tokens, layer_pattern


def _get(c: SyncEngineClient, role: str, claim: str | None):
    if claim:
        return (c.claim_prefill if role == "prefill" else c.claim_decode)(claim, 10.0)
    got = (c.next_prefill if role == "prefill" else c.next_decode)(10.0)
    if got is None:
        raise SystemExit("no request within 10 s")
    return got


def prefill(c: SyncEngineClient, spec: KVSpec, out: str, claim: str | None) -> None:
    h = _get(c, "prefill", claim)
    info, saved = h.info, {}
    for layer in range(spec.num_layers):
        saved[f"seen{layer}"] = h.layer(layer, 10.0).copy()
        fill_tokens(h.output(layer), spec, info.block_keys, info.tail_key, layer,
                    h.hit_tokens, info.prompt_tokens)
        saved[f"written{layer}"] = h.output(layer).copy()
        h.put_layer(layer)
    h.finish(11)
    np.savez(out, hit=np.array(h.hit_tokens), **saved)


def decode(c: SyncEngineClient, spec: KVSpec, out: str, claim: str | None) -> None:
    d = _get(c, "decode", claim)
    info = d.info
    saved = {f"prompt{layer}": d.layer(layer).copy() for layer in range(spec.num_layers)}
    d.took_kv()
    d.second_token()
    out_ids = [d.first_token_id, 12, 13]
    known = list(info.tail_token_ids or ()) + out_ids[:-1]
    bt = spec.block_tokens
    for j in range(len(known) // bt):
        blk = d.new_block(known[j * bt:(j + 1) * bt])
        for layer in range(spec.num_layers):
            layer_pattern(blk.key, layer, spec.layer_block_bytes, blk.view[layer])
        d.put_block(blk)
    d.finish(out_ids)
    np.savez(out, first=np.array(d.first_token_id), **saved)


def hold(c: SyncEngineClient, spec: KVSpec, out: str, claim: str | None) -> None:
    h = _get(c, "prefill", claim)
    h.layer(0, 10.0)
    print("holding", h.request_id, flush=True)
    time.sleep(600)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("what", choices=("prefill", "decode", "hold"))
    p.add_argument("sock")
    p.add_argument("engine_id")
    p.add_argument("spec")
    p.add_argument("out")
    p.add_argument("--claim", default=None)
    a = p.parse_args()
    spec = msgspec.json.decode(a.spec, type=KVSpec)
    role = "decode" if a.what == "decode" else "prefill"
    try:
        c = SyncEngineClient.connect(a.sock, engine_id=a.engine_id, role=role, kv_spec=spec)
        print("attached", c.node_id, flush=True)
        {"prefill": prefill, "decode": decode, "hold": hold}[a.what](c, spec, a.out, a.claim)
        c.close()
    except DualpathError as e:
        print("error", e.code.value, e.message, flush=True)
        return 3
    print("done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
