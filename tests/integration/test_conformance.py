"""The protocol from other languages: a Node.js and a C client, written from PROTOCOL.md, get
the same answers as the Python client from a real ``rollfleet serve`` on the echo engine.

Needs node, the npm packages of tests/clients/node and the C client built against libzmq and
msgpack-c: ``bash tests/clients/install.sh`` (the Makefile's install step runs it). When they
are missing these tests fail; they never skip.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import pathlib
import shutil
import signal
import subprocess
import sys
import time
from typing import Any

import msgpack
import psutil
import pytest
import zmq

from rollfleet.actors import RemoteClient
from rollfleet.engines.echo import echo_tokens
from rollfleet.errors import RolloutError
from rollfleet.transport.messages import MsgType

pytestmark = pytest.mark.timeout(300)

ROOT = pathlib.Path(__file__).resolve().parents[2]
CLIENTS = ROOT / "tests" / "clients"
GOLDEN = ROOT / "tests" / "golden"
NODE_CLIENT = CLIENTS / "node" / "client.js"
C_CLIENT = CLIENTS / "c" / "build" / "rfclient"
WORKERS = ("w0-0", "w1-0")

_spec = importlib.util.spec_from_file_location("make_vectors", GOLDEN / "make_vectors.py")
make_vectors = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(make_vectors)  # type: ignore[union-attr]

# Bad input, as raw header frames: (id the answer carries, frame bytes).
GARBAGE = ("", b"\xc1")  # 0xc1 is never valid msgpack
WRONG_VERSION = ("vm1", msgpack.packb({"v": 2, "type": "stats", "id": "vm1"}))
UNKNOWN_TYPE = ("ut1", msgpack.packb({"v": 1, "type": "frobnicate", "id": "ut1"}))
WORKER_ONLY = ("hb1", msgpack.packb({"v": 1, "type": "heartbeat", "id": "hb1"}))
# A batch whose first message has an int key: that one is answered alone (bad_field "bm1"), and
# the abort after it still runs (unknown_request "bm2", the answer waited for).
BAD_IN_BATCH = ("bm2", msgpack.packb({"v": 1, "type": "batch", "id": "B", "messages": [
    {"v": 1, "type": "stats", "id": "bm1", 7: 1}, {"v": 1, "type": "abort", "id": "bm2", "request_id": "zz"}]}))
# An error about a batch itself carries "", whatever the batch's own id.
BATCH_VERSION = ("", msgpack.packb({"v": 2, "type": "batch", "id": "b12", "messages": []}))
RAWS = (GARBAGE, WRONG_VERSION, UNKNOWN_TYPE, WORKER_ONLY, BAD_IN_BATCH, BATCH_VERSION)
# What the Node and C clients send for `generate bad1 1,2 max_tokens=-1`, minus the fields
# they add with default values (which do not change the answer).
BAD_GENERATE = msgpack.packb({"v": 1, "type": "generate", "id": "bad1", "prompt_ids": [1, 2],
                              "sampling": {"max_tokens": -1, "temperature": 0.0}})

SCRIPT = "\n".join([
    "generate gen-1 1,2,3 max_tokens=5",
    "generate stream-1 5,6,7 max_tokens=6 stream=1",
    "abort_after abort-1 3 9,9 max_tokens=100000",
    "abort nope",
    "control bogus",
    "generate bad1 1,2 max_tokens=-1",
    *(f"raw {rid or '-'} {raw.hex()}" for rid, raw in RAWS),
    "stats",
]) + "\n"


# ------------------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module")
def tools() -> dict[str, str]:
    """The two clients, built; fails (never skips) when what they need is missing."""
    missing = []
    if not NODE_CLIENT.exists():
        missing.append(str(NODE_CLIENT))
    node = subprocess.run(["node", "-e", 'require("zeromq"); require("@msgpack/msgpack")'], cwd=NODE_CLIENT.parent,
                          capture_output=True, text=True) if _which("node") else None
    if node is None or node.returncode != 0:
        missing.append("node with the npm packages zeromq and @msgpack/msgpack"
                       + (f" ({node.stderr.strip().splitlines()[-1]})" if node and node.stderr.strip() else ""))
    build = subprocess.run(["make", "-s", "-C", str(C_CLIENT.parent.parent)], capture_output=True, text=True) \
        if _which("make") else None
    if build is None or build.returncode != 0 or not C_CLIENT.exists():
        missing.append("the C client (libzmq3-dev, libmsgpack-dev, a C compiler)"
                       + (f": {build.stderr.strip()[-400:]}" if build else ""))
    if missing:
        pytest.fail("run `bash tests/clients/install.sh` first; missing: " + "; ".join(missing))
    return {"node": str(NODE_CLIENT), "c": str(C_CLIENT)}


def _which(tool: str) -> bool:
    return shutil.which(tool) is not None


def start_serve(tmp: pathlib.Path, *extra: str) -> tuple[subprocess.Popen[str], str]:
    ready = tmp / "ready"
    proc = subprocess.Popen(
        [sys.executable, "-m", "rollfleet.cli", "serve", "--engine", "echo", "--bind", "tcp://127.0.0.1:0",
         "--ready-file", str(ready), *extra],
        cwd=tmp, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    deadline = time.monotonic() + 90
    while not ready.exists():
        if proc.poll() is not None:
            pytest.fail(f"rollfleet serve exited with {proc.returncode}: {proc.stderr.read()[-2000:]}")
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail("rollfleet serve did not become ready within 90s")
        time.sleep(0.05)
    return proc, ready.read_text().strip()


def stop_serve(proc: subprocess.Popen[str], sig: int = signal.SIGTERM) -> int:
    if proc.poll() is None:
        proc.send_signal(sig)
    try:
        return proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Any:
    # 200 tokens/s per request: short requests finish in milliseconds, and an abort sent
    # after the third chunk lands long before a 100000-token request could finish.
    proc, address = start_serve(tmp_path_factory.mktemp("serve"), "--workers", "2", "--tokens-per-s", "200")
    try:
        yield address
    finally:
        stop_serve(proc)


# ------------------------------------------------------------------------------ the runs


def run_client(cmd: list[str], address: str) -> list[dict[str, Any]]:
    out = subprocess.run([*cmd, "run", address], input=SCRIPT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, f"{cmd[-1]} failed ({out.returncode}): {out.stderr[-2000:]}"
    return [json.loads(line) for line in out.stdout.splitlines()]


def raw_answer(sock: zmq.Socket, frame: bytes, answer_id: str) -> dict[str, Any]:
    """The first answer with ``answer_id`` to ``frame`` (others before it are skipped, as the
    Node and C clients do)."""
    sock.send(frame)
    while True:
        answer = msgpack.unpackb(sock.recv_multipart()[0])
        if answer["id"] == answer_id:
            return answer


def result_view(r: Any) -> dict[str, Any]:
    return {"token_ids": r.token_ids, "finish_reason": r.finish_reason, "logprobs": r.logprobs,
            "weight_versions": r.weight_versions, "num_preemptions": r.num_preemptions, "worker": r.worker,
            "timings": sorted(r.timings)}


async def run_python(address: str) -> list[dict[str, Any]]:
    """The script of the other clients, done with RemoteClient (and a raw socket for bad input)."""
    out: list[dict[str, Any]] = []
    async with RemoteClient(address, call_timeout_s=30) as client:
        r = await client.generate("gen-1", [1, 2, 3], {"max_tokens": 5, "temperature": 0.0})
        out.append({"cmd": "generate", "id": "gen-1", "chunks": [], "result": result_view(r)})
        for cmd, rid, prompt, max_tokens, abort_after in (("generate", "stream-1", [5, 6, 7], 6, None),
                                                          ("abort_after", "abort-1", [9, 9], 100000, 3)):
            chunks: list[list[int]] = []
            aborting = None
            async for item in client.stream(rid, prompt, {"max_tokens": max_tokens, "temperature": 0.0}):
                if hasattr(item, "finish_reason"):
                    entry = {"cmd": cmd, "id": rid, "chunks": chunks, "result": result_view(item)}
                else:
                    chunks.append(item.token_ids)
                    if len(chunks) == abort_after:
                        aborting = asyncio.create_task(client.abort(rid))
            if aborting is not None:
                entry["abort"] = {"reply": {"request_id": rid}} if await aborting else None
            out.append(entry)
        found = await client.abort("nope")
        out.append({"cmd": "abort", "request_id": "nope", "found": found})
        try:
            await client.control("bogus")
            out.append({"cmd": "control", "op": "bogus"})
        except RolloutError as exc:
            out.append({"cmd": "control", "op": "bogus", "error": {"code": exc.code, "message": str(exc)}})
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.RCVTIMEO, 30000)
        sock.connect(address)
        try:
            err = raw_answer(sock, BAD_GENERATE, "bad1")
            out.append({"cmd": "generate", "id": "bad1", "chunks": [],
                        "error": {"code": err["code"], "message": err["message"], "request_id": err["request_id"]}})
            for answer_id, raw in RAWS:
                out.append({"cmd": "raw", "answer": raw_answer(sock, raw, answer_id)})
        finally:
            sock.close(linger=0)
            ctx.term()
        out.append({"cmd": "stats", "reply": await client.stats()})
    return out


def normalize(lines: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """What must be equal across clients: routing picks workers at random and an abort lands
    after some number of tokens, so those are reduced to checked properties."""
    out = []
    for line in lines:
        line = dict(line)
        if "result" in line:
            result = dict(line["result"])
            assert result.pop("worker") in WORKERS
            result["timings"] = sorted(result["timings"])
            tokens = [t for chunk in line["chunks"] for t in chunk]
            if line["chunks"]:
                assert tokens == result["token_ids"], "chunks must add up to the result's tokens"
            if line["cmd"] == "abort_after":
                n = len(result["token_ids"])
                assert n >= 3 and result["token_ids"] == echo_tokens([9, 9], n)
                result["token_ids"] = "a prefix of the echo sequence"
                line["chunks"] = "add up to the result"
                assert line["abort"] == {"reply": {"request_id": line["id"]}}
            line["result"] = result
        if line["cmd"] == "abort":  # RemoteClient.abort answers False for unknown_request
            if "error" in line:
                assert line["error"]["request_id"] == line["request_id"]
                line = {"cmd": "abort", "request_id": line["request_id"],
                        "found": line["error"]["code"] != "unknown_request"}
        if "error" in line:
            line["error"] = {k: line["error"][k] for k in ("code", "message")}
        if line["cmd"] == "stats":
            stats = line["reply"]
            line["reply"] = {
                "keys": sorted(stats),
                "num_workers": stats["num_workers"],
                "workers": [(w["worker_id"], w["state"], w["engine"], w["device"], sorted(w)) for w in stats["workers"]],
            }
        out.append(line)
    return out


# ------------------------------------------------------------------------------ tests


async def test_node_and_c_clients_get_what_the_python_client_gets(tools, server):
    py = await run_python(server)
    node = run_client(["node", tools["node"]], server)
    c = run_client([tools["c"]], server)
    assert [line["cmd"] for line in node] == [line["cmd"] for line in py] == [line["cmd"] for line in c]

    # The Python answers are the right ones, so equality below is not vacuous.
    by_id = {line.get("id"): line for line in py}
    assert by_id["gen-1"]["result"]["token_ids"] == echo_tokens([1, 2, 3], 5)
    assert by_id["gen-1"]["result"]["finish_reason"] == "length"
    assert by_id["stream-1"]["chunks"] == [[t] for t in echo_tokens([5, 6, 7], 6)]
    assert by_id["abort-1"]["result"]["finish_reason"] == "abort"
    assert by_id["bad1"]["error"]["code"] == "bad_field"
    raws = [line["answer"] for line in py if line["cmd"] == "raw"]
    assert [(a["type"], a["id"], a["code"]) for a in raws] == [
        ("error", "", "bad_frame"), ("error", "vm1", "version_mismatch"),
        ("error", "ut1", "unknown_type"), ("error", "hb1", "unknown_type"), ("error", "bm2", "unknown_request"),
        ("error", "", "version_mismatch")]
    control = next(line for line in py if line["cmd"] == "control")
    assert control["error"]["code"] == "unknown_op"
    assert next(line for line in py if line["cmd"] == "abort")["found"] is False

    want = normalize(py)
    assert normalize(node) == want
    assert normalize(c) == want


def test_node_client_says_hello_then_sends_and_reads_batches(tools, server):
    """PROTOCOL.md 4.1 hello and 4.3 batch from a second language: 10 generates in one batch
    frame before hello (answers one to a frame), then 100 after it, their answers read out of
    batch frames; every result right."""
    script = "batch a 10 1,2 max_tokens=1\nhello\nbatch b 100 3,4 max_tokens=2\nstats\n"
    out = subprocess.run(["node", tools["node"], "run", server], input=script, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    before, hello, batch, stats = (json.loads(line) for line in out.stdout.splitlines())
    assert [r["token_ids"] for r in before["results"]] == [echo_tokens([1, 2, i], 1) for i in range(10)]
    assert before["frames"] == 10
    assert hello == {"cmd": "hello", "reply": {"batch": True, "max_message_bytes": 64 << 20}}
    assert "error" not in batch, batch
    assert [r["token_ids"] for r in batch["results"]] == [echo_tokens([3, 4, i], 2) for i in range(100)]
    assert {r["finish_reason"] for r in batch["results"]} == {"length"}
    assert 0 < batch["frames"] < 100  # answers came several to a frame
    assert stats["reply"]["num_workers"] == 2


def test_node_client_decodes_every_golden_vector(tools):
    out = subprocess.run(["node", tools["node"], "golden", str(GOLDEN)], capture_output=True, text=True, timeout=60)
    report = json.loads(out.stdout)
    assert report["failures"] == [], report["failures"]
    assert sorted(report["checked"]) == sorted(t.value for t in MsgType)
    assert out.returncode == 0


def test_c_client_decodes_every_golden_vector_and_encodes_its_requests_identically(tools):
    names = [t.value for t in MsgType]
    out = subprocess.run([tools["c"], "golden", str(GOLDEN), *names], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    lines = [json.loads(line) for line in out.stdout.splitlines()]
    assert [line["name"] for line in lines] == names
    for line in lines:
        want = json.loads((GOLDEN / f"{line['name']}.json").read_text())
        assert line["valid"], line["name"]
        diff = make_vectors.difference(line["decoded"], want)
        assert diff is None, f"{line['name']}: {diff}"
        sent_by_clients = line["name"] in ("generate", "abort", "stats", "control")
        assert line["encodes_same"] is (True if sent_by_clients else None), line["name"]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_serve_shuts_down_cleanly_on_a_signal_and_leaves_no_process(tmp_path, sig):
    proc, address = start_serve(tmp_path, "--workers", "2")
    assert address.startswith("tcp://127.0.0.1:")
    children = psutil.Process(proc.pid).children(recursive=True)
    assert len(children) >= 2  # the workers
    code = stop_serve(proc, sig)
    stdout = proc.stdout.read() if proc.stdout else ""
    assert code == 0, proc.stderr.read() if proc.stderr else ""
    assert f"rollfleet serving on {address}" in stdout
    assert not (tmp_path / "ready").exists()
    deadline = time.monotonic() + 10
    alive = children
    while alive and time.monotonic() < deadline:
        alive = [p for p in alive if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        time.sleep(0.05)
    assert not alive, f"left behind: {[p.pid for p in alive]}"


def test_serve_rejects_bad_options_without_starting_a_fleet(tmp_path):
    out = subprocess.run([sys.executable, "-m", "rollfleet.cli", "serve", "--engine", "torch", "--tokens-per-s", "5"],
                         capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert out.returncode == 2
    assert "echo engine only" in out.stderr
    out = subprocess.run([sys.executable, "-m", "rollfleet.cli", "serve", "--engine", "echo",
                          "--engine-option", "novalue"], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert out.returncode == 2 and "KEY=VALUE" in out.stderr
