from __future__ import annotations

import hashlib
import json
import os
import struct
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from tandem.kvblocks.keys import KEY_BYTES, ROOT, Namespace, block_hash, block_hashes, key_from_hex, key_hex

NS = Namespace(model="tandem-test-model", dtype="bfloat16", page_size=4, num_layers=2, kv_heads=1, head_dim=8)
REPO = Path(__file__).resolve().parents[4]


def by_the_formula(tokens: list[int]) -> list[bytes]:
    """The documented derivation, written out independently of the module."""
    fields = [1, "tandem-test-model", "bfloat16", 4, 2, 1, 8]
    ns = hashlib.blake2b(json.dumps(fields, separators=(",", ":")).encode(), digest_size=16).digest()
    prev, out = bytes(16), []
    for i in range(0, len(tokens) // 4 * 4, 4):
        prev = hashlib.blake2b(ns + prev + struct.pack("<4i", *tokens[i:i + 4]), digest_size=16).digest()
        out.append(prev)
    return out


def test_keys_follow_the_documented_formula_and_a_pinned_vector():
    tokens = [1, 2, 3, 4, 5, 6, 7, 8, 9]  # two full pages; the ninth token is a partial page
    keys = block_hashes(NS, tokens)
    assert keys == by_the_formula(tokens)
    # Pinned: a change here orphans every block on every disk; bump KEY_VERSION deliberately.
    assert NS.hex == "81be77ba1b0a2a94297b60e727d85262"
    assert [k.hex() for k in keys] == ["1e1c252931bd0b053a103d2be0cb87e5", "d98161df266e2fea60bfe7aa539dbea8"]
    assert all(len(k) == KEY_BYTES for k in keys)


def test_keys_do_not_depend_on_the_interpreters_hash_seed():
    code = ("from tandem.kvblocks.keys import Namespace, block_hashes\n"
            "ns = Namespace('tandem-test-model', 'bfloat16', 4, 2, 1, 8)\n"
            "print(','.join(k.hex() for k in block_hashes(ns, list(range(100, 112)))))")
    expected = ",".join(k.hex() for k in block_hashes(NS, list(range(100, 112))))
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, check=True)
        assert out.stdout.strip() == expected


def test_a_key_names_its_page_and_everything_before_it():
    a = block_hashes(NS, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12])
    b = block_hashes(NS, [1, 2, 3, 4, 5, 6, 7, 0, 9, 10, 11, 12])
    assert a[0] == b[0] and a[1] != b[1] and a[2] != b[2]  # page 2 is equal but its prefix is not
    assert block_hashes(NS, [9, 2, 3, 4])[0] != a[0]
    assert block_hashes(NS, [1, 2, 3]) == []  # no full page, no key


def test_the_chain_continues_from_a_parent():
    tokens = list(range(20))
    whole = block_hashes(NS, tokens)
    head = block_hashes(NS, tokens[:8])
    assert head + block_hashes(NS, tokens[8:], parent=head[-1]) == whole
    assert block_hashes(NS, tokens[:4], parent=ROOT) == whole[:1]
    assert block_hash(NS, whole[0], tokens[4:8]) == whole[1]


@pytest.mark.parametrize("change", [{"dtype": "float32"}, {"page_size": 2}, {"model": "another-model"},
                                    {"num_layers": 3}, {"kv_heads": 2}, {"head_dim": 16}])
def test_a_different_model_or_layout_gives_different_keys(change):
    other = replace(NS, **change)
    assert other.digest != NS.digest
    tokens = list(range(8))
    assert set(block_hashes(other, tokens)).isdisjoint(block_hashes(NS, tokens))


def test_equal_namespaces_agree():
    assert Namespace("tandem-test-model", "bfloat16", 4, 2, 1, 8).digest == NS.digest
    assert NS.block_bytes(2) == 2 * 2 * 4 * 1 * 8 * 2


def test_bad_inputs_are_caller_errors():
    with pytest.raises(ValueError, match="int32"):
        block_hashes(NS, [0, 1, 2, 2**31])
    with pytest.raises(ValueError, match="full page"):
        block_hash(NS, ROOT, [1, 2])
    with pytest.raises(ValueError, match="parent"):
        block_hash(NS, b"short", [1, 2, 3, 4])
    with pytest.raises(ValueError, match="page_size"):
        Namespace("m", "float32", 0, 1, 1, 1)
    assert block_hashes(NS, [-1, 0, 1, 2**31 - 1])  # the whole int32 range hashes


def test_hex_form_round_trips_and_rejects_non_keys():
    key = block_hashes(NS, [1, 2, 3, 4])[0]
    assert key_from_hex(key_hex(key)) == key
    assert key_from_hex(key_hex(key).upper()) is None  # one spelling per key
    assert key_from_hex("ab" * 15) is None
    assert key_from_hex("zz" * 16) is None
    assert key_from_hex(" " + key_hex(key)[1:]) is None
