"""A hostile peer: builds malformed, truncated, mistyped and oversized frames, and (run as a
script) fires them at a fleet's client socket in bursts, counting the answers.

It uses msgpack directly, not rollfleet's codec, so it speaks the protocol as an outside
client would. ``python fuzz_peer.py ADDRESS COUNT SEED MAX_BYTES`` prints one JSON line:
frames sent, replies by type and code, and whether the socket still answers after
oversized frames (which ZeroMQ drops together with the connection).
"""

from __future__ import annotations

import json
import random
import sys

import msgpack

__all__ = ["bad_frames", "worker_frames"]

_WRONG = [None, True, 1.5, -1, 2**63 - 1, "x", b"\x00", [1, "a"], [None], {1: 2}]
_NONE = type(None)
# The types each field accepts (PROTOCOL.md section 3); a mutation picks any other.
_ACCEPTED = {"v": {int}, "type": {str}, "id": {str}, "prompt_ids": set(), "sampling": set(), "stream": {bool},
             "session_id": {str, _NONE}, "resume": {bool, _NONE}, "request_id": {str}, "op": {str}, "args": set()}


def _valid_headers(rng: random.Random) -> list[dict]:
    rid = f"f{rng.randrange(10**9)}"
    sampling = {"max_tokens": 4, "temperature": 0.0, "top_p": 1.0, "top_k": 0, "seed": None,
                "stop_token_ids": [], "ignore_eos": False, "logprobs": False}
    return [
        {"v": 1, "type": "generate", "id": rid, "prompt_ids": [1, 2, 3], "sampling": sampling, "stream": False,
         "session_id": None, "resume": None},
        {"v": 1, "type": "abort", "id": rid, "request_id": "ghost-" + rid},
        {"v": 1, "type": "control", "id": rid, "op": "pause", "args": {}},
    ]


def _mistyped(rng: random.Random) -> dict:
    """A header that must be refused: one field of a valid message broken."""
    header = rng.choice(_valid_headers(rng))
    key = rng.choice([k for k in header])
    how = rng.randrange(6)
    if how == 0:
        del header[key]
        if key in ("stream", "session_id", "resume", "sampling", "args"):
            header["v"] = rng.choice([0, 2, "1", None])  # an optional field: break the version instead
    elif how == 1 and key == "sampling":
        bad = rng.choice([("max_tokens", -1), ("max_tokens", "9"), ("top_p", 0.0), ("top_p", 2), ("top_k", -5),
                          ("temperature", -0.5), ("temperature", "hot"), ("stop_token_ids", ["a"]),
                          ("stop_token_ids", [1.5]), ("logprobs", 1), ("seed", "s"), ("ignore_eos", None)])
        header["sampling"] = dict(header["sampling"], **{bad[0]: bad[1]})
    elif how == 2 and key == "prompt_ids":
        header["prompt_ids"] = rng.choice([[1, "2"], [1.0], [True], [[1]], [None], "123", {"0": 1}])
    elif how == 3:
        header["type"] = rng.choice(["", "nope", "heartbeat", "register", "chunk", "result", "reply", "weights_end",
                                     "worker_exit", "shutdown", 7, None, "GENERATE"])
    elif how == 4 and header["type"] == "control":
        header["op"] = rng.choice(["reboot", "", "sleep\x00", 5, None])
    else:  # a value of a type the field does not accept
        choices = [w for w in _WRONG if type(w) not in _ACCEPTED[key]]
        if key == "v":
            # not True: the codec compares the version with ==, and True == 1 (reported)
            choices = [w for w in choices if w is not True] + [0, 2, -1]
        header[key] = rng.choice(choices)
    return header


def _pack(value) -> bytes:
    return msgpack.packb(value, use_bin_type=True)


def bad_frames(rng: random.Random, n: int) -> list[list[bytes]]:
    """``n`` messages (lists of frames), each of which a fleet must refuse with an error."""
    out = []
    for _ in range(n):
        kind = rng.randrange(8)
        if kind == 0:  # random bytes
            frames = [rng.randbytes(rng.randrange(0, 48))]
        elif kind == 1:  # a valid message cut short
            raw = _pack(rng.choice(_valid_headers(rng)))
            frames = [raw[: rng.randrange(0, len(raw))]]
        elif kind in (2, 3, 4):  # one field mistyped, missing, or out of range
            frames = [_pack(_mistyped(rng))]
        elif kind == 5:  # msgpack, but not a map
            frames = [_pack(rng.choice([[1, 2], 5, "generate", None, b"bin", 1.5, [{"v": 1}]]))]
        elif kind == 6:  # lying lengths and deep nesting
            frames = [rng.choice([b"\xdd\xff\xff\xff\xff", b"\xdf\xff\xff\xff\xff\xa1v", b"\xdb\xff\xff\xff\xf0ab",
                                  b"\x91" * 5000, b"\x81\xa1v" * 3000 + b"\x01"])]
        else:  # extra frames behind a refused header
            frames = [_pack(_mistyped(rng))] + [rng.randbytes(rng.randrange(1, 64)) for _ in range(rng.randrange(1, 4))]
        out.append(frames)
    return out


def worker_frames(rng: random.Random, n: int) -> list[bytes]:
    """Header frames a buggy worker might send: garbage, cut messages, wrong types, answers
    to nothing (unknown ids). A supervisor must drop them all."""
    out = []
    for _ in range(n):
        kind = rng.randrange(5)
        if kind == 0:
            out.append(rng.randbytes(rng.randrange(0, 48)))
        elif kind == 1:
            raw = _pack({"v": 1, "type": "chunk", "id": "zz", "token_ids": [1, 2], "weight_version": 0})
            out.append(raw[: rng.randrange(0, len(raw))])
        elif kind == 2:
            out.append(_pack(_mistyped(rng)))  # client-side types, broken or not: never valid from a worker
        elif kind == 3:
            rid = f"nope{rng.randrange(10**6)}"
            out.append(_pack(rng.choice([
                {"v": 1, "type": "chunk", "id": rid, "token_ids": [1], "weight_version": 0},
                {"v": 1, "type": "result", "id": rid, "token_ids": [1], "finish_reason": "length"},
                {"v": 1, "type": "reply", "id": rid, "ok": True, "data": {}},
                {"v": 1, "type": "error", "id": rid, "code": "engine_error", "message": "x"},
                {"v": 1, "type": "chunk", "id": rid, "token_ids": ["x"]},
            ])))
        else:
            out.append(_pack(rng.choice([{"v": 1, "type": "stats", "id": "s"}, {"v": 1, "type": "shutdown", "id": "s"},
                                         [1, 2, 3], {"v": 9, "type": "heartbeat", "id": "h"}])))
    return out


def main() -> None:
    import zmq

    address, count, seed, max_bytes = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    rng = random.Random(seed)
    pool = bad_frames(rng, 4000)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    replies: dict[str, int] = {}
    sent = missing = 0
    burst = 500
    while sent < count:
        n = min(burst, count - sent)
        for _ in range(n):
            sock.send_multipart(pool[rng.randrange(len(pool))])
        sent += n
        got = 0
        while got < n:
            if not poller.poll(10_000):
                missing += n - got
                break
            reply = msgpack.unpackb(sock.recv(), raw=False)
            key = f"{reply.get('type')}:{reply.get('code', '')}"
            replies[key] = replies.get(key, 0) + 1
            got += 1
    # Oversized frames: ZeroMQ drops each with its connection; the socket reconnects.
    big = ctx.socket(zmq.DEALER)
    big.setsockopt(zmq.LINGER, 0)
    big.connect(address)
    for _ in range(5):
        big.send(b"\x00" * (max_bytes + 1))
    big.send(_pack({"v": 1, "type": "stats", "id": ""}))  # may be lost with the dropped connection
    answered_after_oversize = False
    for attempt in range(50):
        big.send(_pack({"v": 1, "type": "abort", "id": f"p{attempt}", "request_id": "ghost"}))
        if big.poll(200):
            answered_after_oversize = True
            break
    print(json.dumps({"sent": sent, "missing": missing, "replies": replies,
                      "answered_after_oversize": answered_after_oversize}), flush=True)
    sock.close(0)
    big.close(0)
    ctx.term()


if __name__ == "__main__":
    main()
