"""A real worker process against a bare ROUTER playing the supervisor: batches both ways."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import msgpack
import pytest
import zmq

from rollfleet.actors.process import CONFIG_ENV
from rollfleet.engines.echo import echo_tokens
from rollfleet.transport import codec
from rollfleet.transport.messages import Batch, Error, Generate, Register, Reply, Result, SamplingParams, Shutdown


@pytest.fixture
def worker(tmp_path):
    """(router socket, worker identity, process): a registered echo worker."""
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.ROUTER_MANDATORY, 1)
    router.setsockopt(zmq.LINGER, 0)
    addr = f"ipc://{tmp_path}/w.sock"
    router.bind(addr)
    config = {"addr": addr, "worker_id": "w0-0", "engine": "echo", "engine_options": {"tokens_per_s": 0},
              "parent_pid": os.getpid(), "heartbeat_interval_s": 60}
    proc = subprocess.Popen([sys.executable, "-m", "rollfleet.actors.worker"],
                            env=dict(os.environ, **{CONFIG_ENV: json.dumps(config)}))
    try:
        assert router.poll(60_000), "the worker did not register"
        ident, raw = router.recv_multipart()
        register = codec.decode([raw])
        assert isinstance(register, Register) and register.batch is True  # it says it takes batches
        router.send_multipart([ident, codec.encode(Reply(id=register.id, data={"worker_id": "w0-0"}))])
        yield router, ident, proc
        router.send_multipart([ident, codec.encode(Shutdown(id="bye"))])
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        router.close()
        ctx.term()


def collect(router, wanted: set[str], timeout_s: float = 30.0) -> tuple[dict[str, object], int]:
    """Answers by id until every wanted id has one; also how many frames carried them."""
    got: dict[str, object] = {}
    frames = 0
    deadline = time.monotonic() + timeout_s
    while not wanted <= got.keys():
        assert router.poll(max(1, int((deadline - time.monotonic()) * 1000))), f"missing {wanted - got.keys()}"
        _, raw = router.recv_multipart()
        frames += 1
        msg = codec.decode([raw])
        for item in codec.unbatch(msg) if isinstance(msg, Batch) else [msg]:
            assert not isinstance(item, codec.DecodeError)
            got[item.id] = item
    return got, frames


def test_a_batch_is_served_message_by_message_and_a_bad_one_costs_the_others_nothing(worker):
    router, ident, _ = worker
    params = SamplingParams(max_tokens=3)
    good = [Generate(id=f"g{i}", prompt_ids=[i + 1, 7], sampling=params) for i in range(40)]
    items = [codec.encode(m) for m in good[:20]]
    items.append(msgpack.packb({"v": 1, "type": "generate", "id": "bad", "prompt_ids": "x"}))
    items.append(msgpack.packb({"v": 1, "type": "batch", "id": "nested", "messages": []}))
    items += [codec.encode(m) for m in good[20:]]
    router.send_multipart([ident, codec.batch_frame(items)])
    got, frames = collect(router, {m.id for m in good} | {"bad", "nested"})
    for m in good:
        result = got[m.id]
        assert isinstance(result, Result) and result.token_ids == echo_tokens(m.prompt_ids, 3)
    assert isinstance(got["bad"], Error) and got["bad"].code == "bad_field"
    assert isinstance(got["nested"], Error) and got["nested"].code == "bad_message"
    # 42 answers made in one turn of the worker's loop come back in far fewer frames.
    assert frames < len(got)


def test_unbatched_messages_still_work(worker):
    router, ident, _ = worker
    router.send_multipart([ident, codec.encode(Generate(id="solo", prompt_ids=[5], sampling=SamplingParams(max_tokens=2)))])
    got, _ = collect(router, {"solo"})
    assert got["solo"].token_ids == echo_tokens([5], 2)
