"""KV model: specs, presets, Full/Layer Block views, chained keys, Mooncake mapping."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from common.config import KVConfig
from common.errors import InvalidArgument, KVSpecMismatch
from common.kv import (KEY_HEX_LEN, PRESETS, ROOT_KEY, KVSpec, block_keys_from_mooncake,
                       block_keys_from_tokens, full_block_view, layer_block, request_kv_view,
                       spec_from_config, validate_key, validate_keys)


def test_preset_sizes_match_the_paper():
    assert PRESETS["qwen2.5-32b"].layer_block_bytes == 256 * 1024
    assert PRESETS["qwen2.5-32b"].full_block_bytes == 16 * 1024 * 1024
    assert PRESETS["deepseek-v3.2"].layer_block_bytes == 41_984          # ≈ 42 KB
    assert PRESETS["deepseek-v3.2"].full_block_bytes == 61 * 41_984      # ≈ 2.6 MB
    assert PRESETS["ds-27b"].num_layers == 30


def test_fingerprint_depends_on_layout_not_name():
    a = KVSpec("a", 4, 256)
    assert a.fingerprint() == KVSpec("b", 4, 256).fingerprint()
    assert a.fingerprint() != KVSpec("a", 5, 256).fingerprint()
    a.check_compatible(a.fingerprint())
    a.check_compatible("")  # frontends move no KV
    with pytest.raises(KVSpecMismatch, match="4 layers"):
        a.check_compatible(KVSpec("a", 5, 256).fingerprint(), peer="gateway")


def test_spec_rejects_nonpositive_fields():
    with pytest.raises(InvalidArgument, match="num_layers"):
        KVSpec("x", 0, 256)


def test_spec_from_config_overrides_and_unknown_preset():
    spec = spec_from_config(KVConfig(preset="deepseek-v3.2", block_tokens=32))
    assert spec.num_layers == 61 and spec.block_tokens == 32
    with pytest.raises(InvalidArgument, match="unknown KV preset"):
        spec_from_config(KVConfig(preset="gpt-9"))


def test_layer_block_is_a_view_of_the_full_block():
    spec = PRESETS["test-small"]
    buf = np.arange(spec.full_block_bytes, dtype=np.uint64).astype(np.uint8)
    full = full_block_view(buf, spec)
    assert full.shape == (4, 64, 256)
    lb = layer_block(full, 2)
    assert lb.shape == (1, 64, 256)
    assert np.shares_memory(lb, buf)
    lb[0, 0, 0] = 77
    assert buf[2 * spec.layer_block_bytes] == 77
    with pytest.raises(InvalidArgument):
        layer_block(full, 4)


def test_request_view_keeps_each_layer_contiguous():
    spec = PRESETS["test-small"]
    tokens = 3 * 64 + 5
    buf = np.zeros(spec.bytes_per_token * tokens + 100, np.uint8)
    kv = request_kv_view(buf, spec, tokens)
    assert kv.shape == (4, tokens, 256)
    assert kv[1].flags["C_CONTIGUOUS"] and np.shares_memory(kv, buf)
    with pytest.raises(InvalidArgument):
        request_kv_view(buf[:10], spec, tokens)


def test_chained_keys_share_prefixes_and_differ_after_divergence():
    a = list(range(64 * 3 + 10))
    b = a[:64 * 2] + [9] + a[64 * 2 + 1:]
    ka, kb = block_keys_from_tokens(a), block_keys_from_tokens(b)
    assert len(ka) == 3                       # the partial tail gets no key
    assert ka[:2] == kb[:2] and ka[2] != kb[2]
    assert all(len(k) == KEY_HEX_LEN for k in ka)
    # a key depends on the whole prefix, not only its own block
    c = [1] + a[1:]
    assert block_keys_from_tokens(c)[1] != ka[1]


@pytest.mark.parametrize("bad", ["", "ab", "G" * KEY_HEX_LEN, "A" * KEY_HEX_LEN, "../" + "a" * 29,
                                 "a" * 31 + "/", "a" * 33, 5, None, b"a" * 32, "a" * 31 + "\x00"])
def test_malformed_keys_are_rejected(bad):
    with pytest.raises(InvalidArgument):
        validate_key(bad)


def test_validate_keys_limit():
    keys = block_keys_from_tokens(list(range(64 * 4)))
    assert validate_keys(keys) == keys
    with pytest.raises(InvalidArgument, match="too many"):
        validate_keys(keys, max_keys=3)


def test_bad_token_ids_are_rejected():
    with pytest.raises(InvalidArgument):
        block_keys_from_tokens([-1] * 64)
    with pytest.raises(InvalidArgument):
        block_keys_from_tokens([[1, 2]])


def test_mooncake_mapping_expands_512_token_blocks():
    keys = block_keys_from_mooncake([0, 1, 2], input_length=1100)
    assert len(keys) == 1100 // 64          # 17 full 64-token blocks
    same_prefix = block_keys_from_mooncake([0, 1, 7], input_length=1100)
    assert same_prefix[:16] == keys[:16] and same_prefix[16] != keys[16]
    other = block_keys_from_mooncake([5, 1, 2], input_length=1100)
    assert other[0] != keys[0] and other[8] != keys[8]   # chained: later blocks differ too
    with pytest.raises(InvalidArgument):
        block_keys_from_mooncake([0], input_length=1100)
    with pytest.raises(InvalidArgument):
        block_keys_from_mooncake([0, -3, 1], input_length=1100)


@given(st.lists(st.integers(0, 2**32 - 1), max_size=400))
def test_keys_are_deterministic_and_well_formed(tokens):
    keys = block_keys_from_tokens(tokens)
    assert keys == block_keys_from_tokens(tokens)
    assert len(keys) == len(tokens) // 64
    for k in keys:
        assert validate_key(k) == k and k != ROOT_KEY
