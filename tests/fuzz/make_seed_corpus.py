#!/usr/bin/python3
"""Writes the fuzz targets' seed corpora under tests/fuzz/corpus/<target>/.

wire: the messages jupyter_client serialized (tests/fixtures/
jupyter_client_vectors.json), in the wire target's input format, plus
hand-made edge cases. connection_file: the connection files jupyter_client
wrote, plus edge cases. limits and image: the documented examples, the repo's
image.json files, plus edge cases. http_head: proxy requests as curl and
Python send them, plus edge cases. zmtp: a ZMTP 3.0 peer's bytes (handshakes
and traffic as libzmq ROUTER, PUB and XPUB sockets send them, long and oversize
frames, broken handshakes) in fuzz_zmtp's input format. packed: the local file
socket's datagrams (a signed request, malformed packings).

    /usr/bin/python3 tests/fuzz/make_seed_corpus.py [TARGET...]

Deterministic: regenerating changes files only when the inputs change.
"""

import base64
import hashlib
import hmac
import json
import pathlib
import shutil
import struct
import sys

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent.parent
VECTORS = ROOT / "tests" / "fixtures" / "jupyter_client_vectors.json"
CORPUS = HERE / "corpus"
DELIM = b"<IDS|MSG>"

# The wire target's keys, by the index in its flags byte (fuzz_wire.cpp).
KEYS = [b"5f9e1c2a-vector-key-0123456789abcdef", b"\x00\xffbinary\x80key\x00", b"k" * 200, b""]
RESIGN = 4
SMALL_LIMITS = 8


def wire_input(frames, flags=0):
    """The wire target's format: a flags byte, then (u16 little-endian length, bytes) frames."""
    out = bytes([flags])
    for f in frames:
        assert len(f) < 65536
        out += struct.pack("<H", len(f)) + f
    return out


def sign(key, header, parent, metadata, content):
    if not key:
        return b""
    h = hmac.new(key, digestmod=hashlib.sha256)
    for part in (header, parent, metadata, content):
        h.update(part)
    return h.hexdigest().encode()


def message(key=KEYS[0], header=None, parent=b"{}", metadata=b"{}", content=b"{}",
            identities=(), buffers=()):
    if header is None:
        header = json.dumps({"msg_id": "fuzz-0001", "msg_type": "execute_request",
                             "username": "fuzz", "session": "fuzz-session",
                             "date": "2024-05-06T07:08:09.123456Z", "version": "5.3"}).encode()
    return [*identities, DELIM, sign(key, header, parent, metadata, content),
            header, parent, metadata, content, *buffers]


def wire_seeds():
    seeds = {}
    vectors = json.loads(VECTORS.read_text())["vectors"]
    for v in vectors:
        key = base64.b64decode(v["key_b64"])
        frames = [base64.b64decode(f) for f in v["frames_b64"]]
        index = KEYS.index(key)  # a new fixture key needs a slot in fuzz_wire.cpp
        seeds[f"jc-{v['name']}"] = wire_input(frames, index)
        seeds[f"jc-{v['name']}-resign"] = wire_input(frames, index | RESIGN)
        seeds[f"jc-{v['name']}-small"] = wire_input(frames, index | RESIGN | SMALL_LIMITS)

    good = message()
    hdr = good[2]
    seeds["edge-missing-delimiter"] = wire_input(good[:1] + good[2:])
    seeds["edge-only-delimiter"] = wire_input([DELIM])
    for n in range(5):
        seeds[f"edge-{n}-frames-after-delimiter"] = wire_input([b"id"] + good[:n + 1])
    seeds["edge-two-delimiters"] = wire_input([DELIM] + good)
    seeds["edge-17-identities"] = wire_input([b"i%d" % i for i in range(17)] + good)
    seeds["edge-uppercase-signature"] = wire_input([DELIM, good[1].upper()] + good[2:])
    seeds["edge-long-signature"] = wire_input([DELIM, good[1] * 3] + good[2:])
    seeds["edge-empty-key-empty-signature"] = wire_input(message(key=b""), 3)
    seeds["edge-empty-key-with-signature"] = wire_input(good, 3)
    seeds["edge-buffers"] = wire_input(good + [b"\x00\xff", b"", DELIM])
    seeds["edge-many-frames-small"] = wire_input(good + [b""] * 20, SMALL_LIMITS)

    # Correctly signed by the target (RESIGN), so they reach the JSON checks.
    def signed(name, **frames):
        seeds[name] = wire_input(message(**frames), RESIGN)

    signed("json-deep", content=b"[" * 70 + b"]" * 70)
    signed("json-deep-in-string", content=b'{"s": "' + b"[" * 100 + b'"}')
    signed("json-nul-after-object", content=b"{}\x00junk")
    signed("json-nul-in-string", content=b'{"s": "a\x00b"}')
    signed("json-bom", content=b"\xef\xbb\xbf{}")
    signed("json-nan", content=b'{"x": NaN}')
    signed("json-infinity", content=b'{"x": -Infinity}')
    signed("json-overflow-number", content=b'{"x": 1e400}')
    signed("json-big-integer", content=b'{"x": 18446744073709551616}')
    signed("json-negative-zero", content=b'{"x": -0.0, "y": -0}')
    signed("json-duplicate-keys", content=b'{"a": 1, "a": 2}')
    signed("json-bad-utf8", content=b'{"s": "\xff\xfe"}')
    signed("json-overlong-utf8", content=b'{"s": "\xc0\xaf"}')
    signed("json-lone-surrogate", content=b'{"s": "\\ud800"}')
    signed("json-surrogate-pair", content=b'{"s": "\\ud83d\\ude00"}')
    signed("json-comment", content=b"{/* c */}")
    signed("json-trailing-comma", content=b'{"a": 1,}')
    signed("json-array", content=b"[]")
    signed("json-empty", content=b"")
    signed("header-msg-id-number", header=b'{"msg_id": 1, "msg_type": "execute_request"}')
    signed("header-no-msg-type", header=b'{"msg_id": "x"}')
    signed("header-msg-type-null", header=b'{"msg_id": "x", "msg_type": null}')
    signed("header-not-object", header=b'"execute_request"')
    signed("parent-not-object", parent=b"[1]")
    signed("metadata-deep", metadata=b'{"a":' * 63 + b"1" + b"}" * 63)

    # Replay guard model: repeated and case-varied signatures (capacity 1..8).
    sigs = [hashlib.sha256(bytes([i])).hexdigest().encode() for i in range(4)]
    seeds["replay-repeats"] = wire_input(sigs + [sigs[0], sigs[0].upper(), b""] + sigs, 0x20)
    seeds["replay-evict"] = wire_input(sigs * 3, 0x00)
    return seeds


def connection_seeds():
    seeds = {}
    for c in json.loads(VECTORS.read_text())["connection"]:
        seeds[f"jc-{c['transport']}"] = c["file_text"].encode()
    base = json.loads(seeds["jc-tcp"])

    def variant(name, **changes):
        j = dict(base)
        for k, v in changes.items():
            if v is ...:
                j.pop(k, None)
            else:
                j[k] = v
        seeds[name] = json.dumps(j).encode()

    variant("port-negative", shell_port=-1)
    variant("port-65536", iopub_port=65536)
    variant("port-2-63", stdin_port=2 ** 63)
    variant("port-2-64-1", control_port=2 ** 64 - 1)
    variant("port-float", hb_port=5555.0)
    variant("port-string", shell_port="5555")
    variant("port-zero", shell_port=0)
    variant("no-key", key=...)
    variant("no-transport", transport=...)
    variant("key-nul", key="a\u0000b")
    variant("key-unicode", key="kéy-☃-😀")
    variant("key-empty", key="")
    variant("transport-udp", transport="udp")
    variant("scheme-md5", signature_scheme="hmac-md5")
    variant("kernel-name-null", kernel_name=None)
    variant("kernel-name-number", kernel_name=3)
    variant("ip-path", transport="ipc", ip="/tmp/x/../y")
    variant("extra-field", extra={"a": [1, 2]})
    seeds["not-object"] = b"[1, 2, 3]"
    seeds["empty"] = b""
    seeds["trailing-nul-junk"] = seeds["jc-tcp"] + b"\x00junk"
    seeds["bom"] = b"\xef\xbb\xbf" + seeds["jc-tcp"]
    seeds["truncated"] = seeds["jc-tcp"][:40]
    return seeds


LIMIT_FIELDS = ["max_executions", "idle_timeout_s", "lifetime_s", "exec_timeout_s",
                "output_bytes", "memory_mb", "pids", "disk_mb", "shm_mb", "output_mb",
                "cpus", "nofile"]


def limits_seeds():
    seeds = {
        "empty-object": b"{}",
        "null": b"null",
        "docs-example": b'{"max_executions": 50}',
        "docs-defaults": json.dumps({"max_executions": 1000, "idle_timeout_s": 1800,
                                     "lifetime_s": 86400, "exec_timeout_s": 30,
                                     "output_bytes": 1048576, "memory_mb": 1024, "pids": 256,
                                     "disk_mb": 256, "shm_mb": 64, "output_mb": 256,
                                     "cpus": 1, "nofile": 4096}).encode(),
        "docs-maxima": json.dumps({"max_executions": 100000, "idle_timeout_s": 604800,
                                   "lifetime_s": 604800, "exec_timeout_s": 3600,
                                   "output_bytes": 67108864, "memory_mb": 16384,
                                   "pids": 4096, "disk_mb": 16384, "shm_mb": 4096,
                                   "output_mb": 16384, "nofile": 65536}).encode(),
        "image-and-request": b'[{"memory_mb": 2048}, {"max_executions": 3, "cpus": 0.5}]',
        "request-above-max": b'{"memory_mb": 16385}',
        "unknown-field": b'{"memory": 1}',
        "zero": b'{"pids": 0}',
        "negative": b'{"exec_timeout_s": -1}',
        "whole-float": b'{"max_executions": 1000.0}',
        "fraction": b'{"max_executions": 1.5}',
        "huge-float": b'{"memory_mb": 9.3e18}',
        "int64-max": b'{"output_bytes": 9223372036854775807}',
        "uint64-max": b'{"output_bytes": 18446744073709551615}',
        "int-overflow": b'{"nofile": 4294967297}',
        "string": b'{"exec_timeout_s": "30"}',
        "bool": b'{"cpus": true}',
        "nested": b'{"cpus": {"n": 1}}',
        "not-object": b"[1]",
        "tiny": b'{"lifetime_s": 1e-300}',
        "utf8-two-byte": "é".encode() * 8,
        "utf8-three-byte": "☃".encode() * 8,
        "utf8-four-byte": "😀".encode() * 8,
        "utf8-mixed": "a é ☃ 😀 z".encode(),
        "utf8-truncated": "😀".encode()[:3] + b"abc",
        "utf8-stray-continuation": b"\x80\x80\x80\x80abc",
        "utf8-overlong": b"\xc0\xaf\xe0\x80\xaf",
        "utf8-five-byte-lead": b"\xf8\x88\x80\x80\x80",
        "utf8-surrogate": b"\xed\xa0\x80",
    }
    for field in LIMIT_FIELDS:
        seeds[f"field-{field}"] = json.dumps({field: 2}).encode()
    return seeds


def image_seeds():
    seeds = {}
    for path in sorted((ROOT / "images").glob("*/image.json")):
        seeds[f"repo-{path.parent.name}"] = path.read_bytes()
    minimal = {"name": "x", "kernel_argv": ["/bin/true"]}

    def variant(name, **changes):
        seeds[name] = json.dumps({**minimal, **changes}).encode()

    variant("minimal")
    variant("limits-session-fields", limits={"max_executions": 5, "memory_mb": 512})
    variant("limits-not-object", limits=5)
    variant("limits-string", limits={"memory_mb": "1024"})
    variant("limits-fraction", limits={"cpus": 0.25, "pids": 1.5})
    variant("host-bind-relative", host_binds=["etc"])
    variant("host-bind-dotdot", host_binds=["/etc/../root"])
    variant("env-not-strings", env={"A": 1})
    variant("argv-not-strings", kernel_argv=[1, 2])
    variant("build-section", build={
        "suite": "bookworm", "packages": ["python3", "python3-numpy=1:1.24.2-1"],
        "strip_docs": False,
        "files": [{"path": "/etc/x.conf", "content": "a", "mode": "0644"},
                  {"path": "/usr/local/bin/y", "source": "files/y", "mode": "0755"}]})
    variant("build-section-hostile", build={
        "packages": ["bad name", "x;rm"], "mirror": "file:///",
        "files": [{"path": "/tmp/../etc/passwd", "content": "x", "mode": "4755"},
                  {"path": "/etc/a", "source": "../../etc/shadow"}]})
    variant("build-not-object", build=["python3"])
    seeds["no-name"] = b'{"kernel_argv": ["x"]}'
    seeds["not-object"] = b'"host"'
    return seeds


def http_head_seeds():
    seeds = {
        "curl-connect": b"CONNECT api.example.com:443 HTTP/1.1\r\nHost: api.example.com:443\r\n"
                        b"User-Agent: curl/7.88.1\r\nProxy-Connection: Keep-Alive\r\n\r\n",
        "curl-get": b"GET http://example.com/path?q=1 HTTP/1.1\r\nHost: example.com\r\n"
                    b"User-Agent: curl/7.88.1\r\nAccept: */*\r\n"
                    b"Proxy-Connection: Keep-Alive\r\n\r\n",
        "python-post-body": b"POST http://example.com:8080/api HTTP/1.1\r\n"
                            b"Host: example.com:8080\r\nAccept-Encoding: identity\r\n"
                            b"Content-Length: 7\r\nContent-Type: application/json\r\n"
                            b"Connection: close\r\n\r\n{\"a\":1}",
        "connect-ipv6": b"CONNECT [2001:db8::1]:443 HTTP/1.1\r\n\r\n",
        "connect-no-port": b"CONNECT example.com HTTP/1.1\r\n\r\n",
        "connect-mapped": b"CONNECT [::ffff:169.254.169.254]:80 HTTP/1.1\r\n\r\n",
        "lf-only": b"GET http://example.com/ HTTP/1.0\nHost: example.com\n\n",
        "connection-names": b"GET http://example.com/ HTTP/1.1\r\nConnection: keep-alive, X-A\r\n"
                            b"X-A: 1\r\nTE: trailers\r\nUpgrade: h2c\r\n"
                            b"Proxy-Authorization: Basic eDp5\r\n\r\n",
        "userinfo": b"GET http://user:pw@example.com/ HTTP/1.1\r\n\r\n",
        "https-url": b"GET https://example.com/ HTTP/1.1\r\n\r\n",
        "origin-form": b"GET /index.html HTTP/1.1\r\nHost: example.com\r\n\r\n",
        "http2": b"GET http://example.com/ HTTP/2.0\r\n\r\n",
        "obs-fold": b"GET http://example.com/ HTTP/1.1\r\nA: b\r\n c\r\n\r\n",
        "space-before-colon": b"GET http://example.com/ HTTP/1.1\r\nA : b\r\n\r\n",
        "many-headers": b"GET http://example.com/ HTTP/1.1\r\n" + b"X: y\r\n" * 6 + b"\r\n",
        "long-line": b"GET http://example.com/" + b"a" * 80 + b" HTTP/1.1\r\n\r\n",
        "incomplete": b"GET http://example.com/ HTTP/1.1\r\nHost: exa",
        "pattern-suffix": b"*.example.com:443",
        "pattern-ipv6": b"[::1]:*",
    }
    return seeds


# fuzz_zmtp's input (fuzz_zmtp.cpp): a 5-byte header (flags, u16, byte, the
# number of op bytes), the peer's bytes, then the ops that cut them into reads.
ZMTP_SUB, ZMTP_ROUTER, ZMTP_PUB, ZMTP_IDENTITY = 0x01, 0x10, 0x11, 0x08
ZMTP_SMALL, ZMTP_MEDIUM, ZMTP_LARGE, ZMTP_DEFAULTS = 0 << 1, 1 << 1, 2 << 1, 3 << 1
ZMTP_COMMIT = 0x80  # an op's bit 7: read_buffer()/commit() rather than feed()


def zmtp_greeting(major=3, minor=0, mechanism=b"NULL"):
    return (b"\xff" + b"\x00" * 8 + b"\x7f" + bytes([major, minor]) +
            mechanism.ljust(20, b"\x00") + b"\x00" * 32)


def zmtp_frame(flags, body, force_long=False):
    if len(body) > 255 or force_long:
        return bytes([flags | 0x02]) + struct.pack(">Q", len(body)) + body
    return bytes([flags, len(body)]) + body


def zmtp_command(name, data=b""):
    return zmtp_frame(0x04, bytes([len(name)]) + name + data)


def zmtp_ready(*props):
    return zmtp_command(b"READY", b"".join(bytes([len(k)]) + k + struct.pack(">I", len(v)) + v
                                          for k, v in props))


def zmtp_message(*frames):
    return b"".join(zmtp_frame(0x01 if i + 1 < len(frames) else 0x00, f)
                    for i, f in enumerate(frames))


def zmtp_reads(n, commit=False):
    """Ops that read exactly n peer bytes."""
    ops = b""
    while n > 0:
        if n >= 512:
            k = min(n // 512, 30)
            ops += bytes([(95 + k) | (ZMTP_COMMIT if commit else 0)])
            n -= k * 512
        else:
            k = min(n, 96)
            ops += bytes([(k - 1) | (ZMTP_COMMIT if commit else 0)])
            n -= k
    return ops


def zmtp_zeros(count, commit=True):
    """An op feeding 2 * count + 1 zero bytes that are not in the input."""
    return bytes([127 | (ZMTP_COMMIT if commit else 0)]) + struct.pack("<H", count)


def zmtp_input(peer, flags=0, u16=0, byte3=0, ops=b""):
    assert len(ops) < 256
    return bytes([flags]) + struct.pack("<H", u16) + bytes([byte3, len(ops)]) + peer + ops


def zmtp_seeds():
    router = zmtp_greeting() + zmtp_ready((b"Socket-Type", b"ROUTER"), (b"Identity", b""))
    pub = zmtp_greeting(3, 1) + zmtp_ready((b"Socket-Type", b"PUB"))
    xpub = zmtp_greeting(3, 1) + zmtp_ready((b"Socket-Type", b"XPUB"))
    traffic = (zmtp_message(b"hello") + zmtp_message(b"a", b"", b"ccc") + zmtp_message(b"") +
               zmtp_message(b"L" * 300) + zmtp_frame(0x00, b"short, long form", True) +
               zmtp_command(b"PING", b"\x00\x00") + zmtp_message(b"after ping"))
    seeds = {
        "router-whole": zmtp_input(router + traffic, ZMTP_DEFAULTS | ZMTP_IDENTITY),
        "router-small-limits": zmtp_input(router + traffic, ZMTP_SMALL, 100, 3),
        "pub": zmtp_input(pub + zmtp_message(b"topic", b"{}"), ZMTP_SUB | ZMTP_DEFAULTS),
        "xpub": zmtp_input(xpub + zmtp_message(b"kernel.iopub", b"x" * 1000), ZMTP_SUB | ZMTP_LARGE,
                           0, 5),
        "oversize-then-small": zmtp_input(
            router + zmtp_message(b"y" * 200) + zmtp_message(b"a", b"y" * 200, b"b") +
            zmtp_message(b"small"), ZMTP_SMALL, 100, 7),
        "too-many-frames": zmtp_input(
            router + zmtp_message(b"1", b"2", b"3", b"4") + zmtp_message(b"1", b"2", b"3"),
            ZMTP_SMALL, 1000, 3),
        # Byte 3: max_frames 3, and a message cap of twice the frame cap.
        "message-over-byte-cap": zmtp_input(
            router + zmtp_message(b"a" * 100, b"b" * 100, b"c") +
            zmtp_message(b"a" * 100, b"b" * 100) + zmtp_message(b"after"),
            ZMTP_SMALL, 100, 3 | 1 << 4),
        "too-many-frames-then-more": zmtp_input(
            router + zmtp_message(b"a", b"bb", b"ccc", b"", b"e") + zmtp_message(b"next"),
            ZMTP_SMALL, 1000, 1),
        "zero-max-frames": zmtp_input(router + zmtp_message(b"x"), ZMTP_SMALL, 1000, 0),
        # Our ROUTER and PUB, towards clients: a DEALER that names itself, a SUB
        # that subscribes and cancels.
        "router-from-dealer": zmtp_input(
            zmtp_greeting(3, 1) +
            zmtp_ready((b"Socket-Type", b"DEALER"), (b"Identity", b"client-1")) +
            zmtp_message(b"", b"request"), ZMTP_ROUTER | ZMTP_DEFAULTS),
        "router-long-identity": zmtp_input(
            zmtp_greeting() + zmtp_ready((b"Socket-Type", b"DEALER"), (b"Identity", b"i" * 256)),
            ZMTP_ROUTER | ZMTP_DEFAULTS),
        "pub-from-sub": zmtp_input(
            zmtp_greeting(3, 1) + zmtp_ready((b"Socket-Type", b"SUB")) + zmtp_message(b"\x01") +
            zmtp_message(b"\x01topic") + zmtp_message(b"\x00topic"),
            ZMTP_PUB | ZMTP_MEDIUM, 4096, 2),
    }
    # Byte-wise and in odd pieces, both ways of reading.
    chunks = zmtp_reads(1) + zmtp_reads(7, True) + zmtp_reads(63) + zmtp_reads(2, True) + \
        zmtp_reads(90) + zmtp_reads(1, True)
    seeds["router-pieces"] = zmtp_input(router + traffic, ZMTP_DEFAULTS | ZMTP_IDENTITY,
                                        ops=chunks)
    # Frames over 64 KiB (read into their own storage), their bodies zeros the
    # target adds: one of 65801 bytes (kept), one of 120001 (over the medium
    # limits' cap of 66036, skipped; kept under the large ones), then a small message.
    head = router + zmtp_frame(0x01, b"head")
    big = bytes([0x03]) + struct.pack(">Q", 2 * 32900 + 1)  # MORE, LONG, 65801 bytes
    bigger = bytes([0x02]) + struct.pack(">Q", 2 * 60000 + 1)  # LONG, 120001 bytes
    peer = head + big + zmtp_frame(0x00, b"tail") + bigger + zmtp_message(b"next")
    ops = (zmtp_reads(len(head) + len(big), True) + zmtp_zeros(32900) +
           zmtp_reads(len(zmtp_frame(0x00, b"tail")) + len(bigger)) + zmtp_zeros(60000, False) +
           zmtp_reads(30, True))
    seeds["long-frames-kept-and-skipped"] = zmtp_input(peer, ZMTP_MEDIUM | ZMTP_IDENTITY,
                                                       66036 - 65536, 0x80 | 3, ops)
    seeds["long-frame-in-large-limits"] = zmtp_input(peer, ZMTP_LARGE, 20000, 5, ops)
    seeds["huge-frame-header"] = zmtp_input(router + bytes([0x02]) + struct.pack(">Q", 60 << 20) +
                                            b"partial body", ZMTP_DEFAULTS)
    # The handshake failing, one way each (under the default limits).
    def zmtp_fails(peer, flags=0):
        return zmtp_input(peer, flags | ZMTP_DEFAULTS)

    bad_signature = bytearray(zmtp_greeting())
    bad_signature[9] = 0x7e
    seeds["bad-signature"] = zmtp_fails(bytes(bad_signature) + router[64:])
    seeds["zmtp-2"] = zmtp_fails(zmtp_greeting(1, 0) + b"\x00\x00")
    seeds["mechanism-plain"] = zmtp_fails(zmtp_greeting(3, 0, b"PLAIN"))
    seeds["ready-without-socket-type"] = zmtp_fails(
        zmtp_greeting() + zmtp_ready((b"Identity", b"x")))
    seeds["sub-to-router"] = zmtp_fails(router, ZMTP_SUB)
    seeds["error-command"] = zmtp_fails(zmtp_greeting() + zmtp_command(b"ERROR", b"\x04nope"))
    seeds["reserved-flags"] = zmtp_fails(router + b"\x08\x01x" + zmtp_message(b"never"))
    seeds["message-before-ready"] = zmtp_fails(zmtp_greeting() + zmtp_message(b"early"))
    seeds["command-with-more"] = zmtp_fails(zmtp_greeting() + b"\x05" +
                                            zmtp_ready((b"Socket-Type", b"ROUTER"))[1:])
    return seeds


def pack(frames):
    """The local file socket's datagram: [u32 count][u32 size, bytes]..., little-endian."""
    return struct.pack("<I", len(frames)) + b"".join(struct.pack("<I", len(f)) + f for f in frames)


def packed_seeds():
    """fuzz_packed's input: the most frames accepted (one byte), then a datagram."""
    header = json.dumps({"msg_id": "a", "msg_type": "file_put_local_request", "session": "s",
                         "username": "u", "date": "2026-11-26T00:00:00Z",
                         "version": "5.3"}).encode()
    content = json.dumps({"session_id": "s", "path": "x"}).encode()
    good = message(KEYS[0], header=header, content=content)
    seeds = {
        "signed-request": bytes([64]) + pack(good),
        "unsigned-request": bytes([64]) + pack([DELIM, b"", header, b"{}", b"{}", content]),
        "empty": bytes([64]) + pack([]),
        "one-empty-frame": bytes([64]) + pack([b""]),
        "too-many-frames": bytes([3]) + pack(good),
        "short-count": bytes([64]) + b"\x01\x00",
        "size-past-end": bytes([64]) + struct.pack("<II", 1, 100) + b"abc",
        "trailing-bytes": bytes([64]) + pack([b"x"]) + b"junk",
        "huge-count": bytes([255]) + struct.pack("<I", 0xFFFFFFFF),
    }
    return seeds


TARGETS = {"wire": wire_seeds, "connection_file": connection_seeds, "limits": limits_seeds,
           "image": image_seeds, "http_head": http_head_seeds, "zmtp": zmtp_seeds,
           "packed": packed_seeds}


def main():
    for target in sys.argv[1:] or TARGETS:
        seeds = TARGETS[target]()
        out = CORPUS / target
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
        for name, data in sorted(seeds.items()):
            (out / name).write_bytes(data)
        print(f"{out.relative_to(ROOT)}: {len(seeds)} seeds")


if __name__ == "__main__":
    main()
