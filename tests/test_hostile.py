"""Hostile input to the replica's session routes and to the chunk decoder: garbage frames,
lying sizes, checkpoints crafted to exhaust memory, oversized and malformed requests,
traversal in ids and URIs. Every refusal is a 4xx with a JSON error, never a 500, and leaves
no KV blocks reserved. (Manifest and frame parsers are fuzzed in test_storage_format_hostile.py.)"""

from __future__ import annotations

import json
import resource
import struct

import pytest
import torch
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from relayout.storage.errors import CorruptCheckpoint
from relayout.storage.format.chunks import chunk_hash, pack_kv, unpack_kv
from relayout.storage.format.manifest import ChunkRef, Manifest
from relayout.storage.stream import MAGIC_CHUNK, encode_chunk_frame, encode_manifest_frame

IMPORT_LIMIT = 2 << 20


@pytest.fixture(scope="module")
def app_client(tmp_path_factory):
    from relayout.engine.runtime.async_engine import AsyncEngine
    from relayout.engine.runtime.engine import LLMEngine
    from relayout.migrate.replica.serve import create_replica_app
    from starlette.testclient import TestClient

    root = tmp_path_factory.mktemp("hostile")
    mp = pytest.MonkeyPatch()
    mp.setenv("RELAYOUT_DATA_DIR", str(root))
    mp.delenv("RELAYOUT_FILE_ROOTS", raising=False)
    mp.delenv("RELAYOUT_TOKEN", raising=False)
    mp.setenv("RELAYOUT_MAX_IMPORT_BYTES", str(IMPORT_LIMIT))
    eng = LLMEngine("builtin:tiny", None, kv_cache_bytes=4 << 20)
    app = create_replica_app(AsyncEngine(eng), "builtin:tiny")
    with TestClient(app, raise_server_exceptions=False) as c:
        c.root = root  # type: ignore[attr-defined]
        c.engine = eng  # type: ignore[attr-defined]
        yield c
    mp.undo()


def blocks(c) -> int:
    return c.get("/v1/replica").json()["kv_blocks_used"]


def refused(r, *codes: int) -> dict:
    assert r.status_code in codes, (r.status_code, r.text[:300])
    body = r.json()
    assert isinstance(body["error"]["message"], str) and "Traceback" not in r.text
    return body


# ---- a well-formed transfer, to corrupt --------------------------------------------------------------
def _manifest_bytes(c, sid: str, n_tokens: int, entries: list[dict], ckpt: str = "m1") -> bytes:
    from relayout.engine.moves.snapshot import geometry, model_ref
    from relayout.storage.format.manifest import KVEntry, Manifest, SessionEntry

    eng = c.engine
    m = Manifest(checkpoint_id=ckpt, created_at=0.0, model=model_ref(eng), source_layout={}, kv=geometry(eng),
                 sessions=[SessionEntry(session_id=sid, state=_state(sid, min(n_tokens, 8)), num_kv_tokens=n_tokens)],
                 kv_entries=[KVEntry.model_validate(e) for e in entries])
    return m.to_bytes()


def _state(sid: str, n: int) -> dict:
    from relayout.engine.runtime.session import SamplingParams, SessionState

    st_ = SessionState(session_id=sid, prompt_token_ids=[5] * max(n, 1), sampling=SamplingParams(max_tokens=4))
    return st_.to_dict()


def test_manifest_helper_is_valid(app_client):
    from relayout.storage.format.manifest import Manifest

    m = Manifest.parse(_manifest_bytes(app_client, "s", 0, []))
    assert m.sessions[0].session_id == "s"


# ---- the import route ------------------------------------------------------------------------------
def test_import_garbage_frames(app_client):
    c = app_client
    r = c.post("/v1/sessions/import", params={"transfer": "g1"}, content=b"GARBAGE" * 1000)
    assert "magic" in refused(r, 400)["error"]["message"]
    assert blocks(c) == 0
    assert c.get("/v1/sessions/transfers/g1").json()["incoming"] == "aborted"


def test_import_frame_declaring_huge_body_is_refused_before_buffering(app_client):
    c = app_client
    lie = struct.pack(">4sQ", MAGIC_CHUNK, 1 << 40) + b"\x00" * 64
    r = c.post("/v1/sessions/import", params={"transfer": "g2"}, content=lie)
    assert "exceeds" in refused(r, 400)["error"]["message"]


def test_import_chunk_header_lying_about_size(app_client):
    c = app_client
    data, ref = pack_kv(torch.zeros(2, 2, 16, 16))
    frame = bytearray(encode_chunk_frame(ref, data))
    bad = ref.model_copy(update={"size": ref.size + 10})
    h = json.dumps(bad.model_dump(), separators=(",", ":")).encode()
    body = struct.pack(">4sQ", MAGIC_CHUNK, 4 + len(h) + len(data)) + struct.pack(">I", len(h)) + h + data
    r = c.post("/v1/sessions/import", params={"transfer": "g3"}, content=body)
    refused(r, 400)
    r = c.post("/v1/sessions/import", params={"transfer": "g3b"}, content=bytes(frame[:-7]))  # truncated
    assert "truncated" in refused(r, 400)["error"]["message"]


def test_import_content_length_over_limit(app_client):
    c = app_client
    r = c.post("/v1/sessions/import", params={"transfer": "g4"}, content=b"x" * (IMPORT_LIMIT + 1))
    assert "limit" in refused(r, 413)["error"]["message"]


def test_import_streamed_past_limit_without_content_length(app_client):
    c = app_client
    data, ref = pack_kv(torch.randn(2, 2, 256, 16))
    frame = encode_chunk_frame(ref, data)

    def gen():
        for _ in range(IMPORT_LIMIT // len(frame) + 3):
            yield frame  # valid frames, all the same chunk: more bytes than the limit allows

    r = c.post("/v1/sessions/import", params={"transfer": "g5"}, content=gen())
    refused(r, 413)
    assert blocks(c) == 0


def test_import_crafted_to_exhaust_memory_refused_before_decoding(app_client):
    """A manifest declaring a 10^7-token session whose chunk is a tiny zstd bomb: refused for
    room before any chunk is decoded (peak RSS grows by far less than the declared size)."""
    c = app_client
    eng = c.engine
    n = 10_000_000
    heads, d = eng.cfg.num_kv_heads, eng.cfg.head_dim
    raw_size = 2 * heads * n * d * 4 + 8 + 128
    bomb = zstandard.ZstdCompressor(write_content_size=False).compress(b"\x00" * (1 << 20))
    ref = ChunkRef(hash=chunk_hash(bomb), size=len(bomb), raw_size=raw_size, codec="zstd")
    entries = [{"session_id": "bomb", "layer": layer, "head_lo": 0, "head_hi": heads, "tok_lo": 0, "tok_hi": n,
                "chunk": ref.model_dump()} for layer in range(eng.cfg.num_layers)]
    man = _manifest_bytes(c, "bomb", n, entries, "bomb1")
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    body = encode_chunk_frame(ref, bomb) + encode_manifest_frame(Manifest.parse(man), man)
    r = c.post("/v1/sessions/import", params={"transfer": "bomb1", "final": "true"}, content=body)
    refused(r, 400, 409)
    grown_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    assert grown_mb < 200, grown_mb  # the declared KV is ~1.2 GB
    assert blocks(c) == 0


def test_restore_crafted_checkpoint_refused_before_decoding(app_client):
    """The same bomb as a stored checkpoint: the restore route checks room before verify()."""
    from relayout.storage.stores.local import LocalStore

    c = app_client
    eng = c.engine
    n = 10_000_000
    heads, d = eng.cfg.num_kv_heads, eng.cfg.head_dim
    bomb = zstandard.ZstdCompressor(write_content_size=False).compress(b"\x00" * (8 << 20))
    ref = ChunkRef(hash=chunk_hash(bomb), size=len(bomb), raw_size=2 * heads * n * d * 4 + 8 + 128, codec="zstd")
    store = LocalStore(c.root / "checkpoints")
    store.put_chunk(ref.hash, bomb)
    entries = [{"session_id": "bomb", "layer": layer, "head_lo": 0, "head_hi": heads, "tok_lo": 0, "tok_hi": n,
                "chunk": ref.model_dump()} for layer in range(eng.cfg.num_layers)]
    store.put_manifest("bomb2", _manifest_bytes(c, "bomb", n, entries, "bomb2"))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    r = c.post("/v1/sessions/restore", json={"checkpoint": f"{(c.root / 'checkpoints').as_uri()}/bomb2"})
    msg = refused(r, 400, 409)["error"]["message"]
    assert "KV tokens" in msg or "KV blocks" in msg, msg
    assert (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024 < 200
    assert blocks(c) == 0


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.binary(max_size=2048), st.integers(0, 4))
def test_import_random_bytes_never_500(app_client, junk, where):
    """Random bytes, alone or spliced into a valid chunk frame: always a 4xx, nothing reserved."""
    c = app_client
    data, ref = pack_kv(torch.ones(2, 2, 16, 16))
    good = encode_chunk_frame(ref, data)
    cut = len(good) * where // 4
    body = junk if where == 0 else good[:cut] + junk + good[cut:]
    r = c.post("/v1/sessions/import", params={"transfer": "fz"}, content=body)
    refused(r, 400, 409, 413)
    assert blocks(c) == 0


# ---- JSON routes: size, shape, traversal ------------------------------------------------------------
def test_oversized_json_bodies_413(app_client):
    c = app_client
    big = json.dumps({"sessions": ["a" * 100] * 20000}).encode()
    assert len(big) > 1 << 20
    # one table bounds every concern's paths: the session routes, the protection routes, a promotion
    for path in ("/v1/sessions/release", "/v1/sessions/resume", "/v1/sessions/checkpoint", "/v1/sessions/export",
                 "/v1/protection", "/v1/standby/p1/promote"):
        refused(c.post(path, content=big, headers={"content-type": "application/json"}), 413)
        # no content-length (chunked): read up to the limit, then refused
        refused(c.post(path, content=iter([big[i:i + 65536] for i in range(0, len(big), 65536)]),
                       headers={"content-type": "application/json"}), 413)
    # a completion is bounded by its own (larger) limit: a 2 MiB prompt is parsed, 9 MiB is refused unread
    assert c.post("/v1/completions", content=big, headers={"content-type": "application/json"}).status_code == 400
    refused(c.post("/v1/completions", content=b" " * (9 << 20), headers={"content-type": "application/json"}), 413)


@pytest.mark.parametrize("body", [b"{", b"[]", b'{"sessions": "x"}', b'{"sessions": [1, 2]}', b"\xff\xfe",
                                  b'{"sessions": [], "extra": 1}'])
def test_malformed_json_400(app_client, body):
    refused(app_client.post("/v1/sessions/release", content=body, headers={"content-type": "application/json"}), 400)


@pytest.mark.parametrize("value", [b"NaN", b"Infinity", b"-Infinity", b"-0.5"])
def test_a_temperature_that_is_not_a_finite_number_is_refused_and_the_replica_serves_on(app_client, value):
    """JSON bodies may carry NaN and Infinity (Python's parser takes them): a NaN temperature was admitted
    and failed the engine's next step, taking every session of the replica down with it."""
    c = app_client
    body = b'{"model": "builtin:tiny", "prompt": "hi", "max_tokens": 4, "temperature": ' + value + b"}"
    r = c.post("/v1/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400 and "temperature" in r.json()["error"]["message"], r.text
    ok = c.post("/v1/completions", json={"model": "builtin:tiny", "prompt": "hi", "max_tokens": 4, "temperature": 0.7,
                                         "seed": 1})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 4, ok.text


BAD_IDS = ["../x", "..", "a/b", "a\\b", "", "x" * 200, "a\x00b", "-lead", "%2e%2e", "a b"]


@pytest.mark.parametrize("bad", BAD_IDS)
def test_traversal_in_ids(app_client, bad):
    c = app_client
    refused(c.post("/v1/sessions/release", json={"sessions": [bad]}), 400)
    refused(c.post("/v1/sessions/export", json={"transfer": bad}), 400)
    refused(c.post("/v1/sessions/import", params={"transfer": bad}, content=b""), 400)
    if bad:  # an empty checkpoint id means "name one for me"
        refused(c.post("/v1/sessions/checkpoint", json={"checkpoint_id": bad}), 400)
    refused(c.post("/v1/sessions/restore", json={"checkpoint": f"{(c.root / 'checkpoints').as_uri()}/{bad}"}), 400)


@pytest.mark.parametrize("uri", [
    "file:///etc", "file:///tmp/../etc", "file://evil.host/tmp", "file:relative/path", "http://x/y",
    "s3://bucket/../up", "s3://Bad_Bucket/x", "s3://b/x?versionId=1", "file:///%2e%2e/etc", "gopher://x",
])
def test_traversal_in_uris(app_client, uri):
    c = app_client
    refused(c.post("/v1/sessions/checkpoint", json={"destination": uri}), 400)
    refused(c.post("/v1/sessions/restore", json={"checkpoint": f"{uri}/ckpt-1"}), 400)


def test_symlink_out_of_root_refused(app_client, tmp_path):
    c = app_client
    link = c.root / "escape"
    link.symlink_to(tmp_path)
    refused(c.post("/v1/sessions/checkpoint", json={"destination": link.as_uri()}), 400)


@pytest.mark.parametrize("src", ["file:///etc/passwd", "http://x y", "javascript:alert(1)", "http://h/" + "a" * 3000])
def test_import_source_must_be_a_url(app_client, src):
    refused(app_client.post("/v1/sessions/import", params={"transfer": "s1", "source": src}, content=b""), 400)


def test_commit_and_release_of_unknown_transfers(app_client):
    c = app_client
    refused(c.post("/v1/sessions/transfers/nope/commit"), 404)
    r = c.post("/v1/sessions/release", json={"sessions": ["s"], "transfer": "nope"})
    assert "unknown" in refused(r, 409)["error"]["message"]
    assert c.delete("/v1/sessions/transfers/nope").status_code == 200  # idempotent abort


# ---- chunk decoder ------------------------------------------------------------------------------------
@settings(max_examples=150, deadline=None)
@given(st.sampled_from(["none", "zstd", "zstd-planes"]), st.integers(0, 3), st.binary(min_size=1, max_size=64),
       st.integers(-64, 1 << 30))
def test_unpack_kv_never_raises_anything_else(codec, mode, junk, size_delta):
    """Mutated payloads, re-hashed so they pass the hash check, with lying raw sizes and shapes:
    CorruptCheckpoint or the exact tensor, nothing else, and never more than raw_size decoded."""
    t = torch.arange(2 * 2 * 8 * 4, dtype=torch.float32).reshape(2, 2, 8, 4)
    data, ref = pack_kv(t, codec)
    if mode == 1:
        data = data[: len(data) // 2] + junk + data[len(data) // 2:]
    elif mode == 2:
        data = junk
    raw_size = max(0, ref.raw_size + (size_delta if mode == 3 else 0))
    ref2 = ChunkRef(hash=chunk_hash(data), size=len(data), raw_size=min(raw_size, 1 << 40), codec=codec)
    try:
        out = unpack_kv(data, ref2, (2, 2, 8, 4), torch.float32)
    except CorruptCheckpoint:
        return
    assert torch.equal(out, t)


def test_zstd_bomb_bounded_by_declared_size():
    bomb = zstandard.ZstdCompressor(write_content_size=False).compress(b"\x00" * (256 << 20))
    ref = ChunkRef(hash=chunk_hash(bomb), size=len(bomb), raw_size=1 << 16, codec="zstd")
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(CorruptCheckpoint, match="more than the declared"):
        unpack_kv(bomb, ref, (2, 2, 16, 16), torch.float32)
    assert (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024 < 64
    # a frame that states its (huge) content size is refused before any allocation
    bomb2 = zstandard.ZstdCompressor().compress(b"\x00" * (64 << 20))
    ref2 = ChunkRef(hash=chunk_hash(bomb2), size=len(bomb2), raw_size=1 << 16, codec="zstd")
    with pytest.raises(CorruptCheckpoint, match="declared"):
        unpack_kv(bomb2, ref2, (2, 2, 16, 16), torch.float32)
