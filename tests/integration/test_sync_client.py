import concurrent.futures
import contextlib
import signal
import subprocess
import os
import sys
import textwrap
import threading
import time

import psutil
import pytest
import torch

from rollfleet.actors import FleetConfig, SyncClient
from rollfleet.errors import FleetClosed, InvalidRequest, RequestTimeout, WorkerStartError
from rollfleet.transport.messages import SamplingParams

from .test_fleet_echo import expected_tokens

# filterwarnings: a coroutine collected unfinished must close quietly (one that awaited in its
# cleanup was reported as "coroutine ignored GeneratorExit").
pytestmark = [pytest.mark.usefixtures("no_leaks"),
              pytest.mark.filterwarnings("error::pytest.PytestUnraisableExceptionWarning")]


def test_generate_batch_update_and_controls_from_plain_code():
    with SyncClient(FleetConfig(engine="echo", num_workers=2)) as fleet:
        prompts = [[i + 1, i + 2] for i in range(10)]
        results = fleet.generate_batch(prompts, SamplingParams(max_tokens=8))
        assert [r.token_ids for r in results] == [expected_tokens(p, 8) for p in prompts]
        fleet.update_weights([("offset", torch.tensor([3]))], version=4)
        r = fleet.generate("x", [5], SamplingParams(max_tokens=3))
        assert r.token_ids == expected_tokens([5], 3, offset=3) and r.weight_versions == [4]
        fleet.sleep()
        assert [w["engine_stats"]["sleeping"] for w in fleet.stats()["workers"]] == [True, True]
        fleet.wake_up()
        assert [w["engine_stats"]["sleeping"] for w in fleet.stats()["workers"]] == [False, False]
        workers = fleet.control("clear_kv_cache")
        assert sorted(workers) == sorted(w["worker_id"] for w in fleet.stats()["workers"])
        assert all(data == {"op": "clear_kv_cache"} for data in workers.values())
        # bad sampling given as a map fails with the library's error, not a ValueError, before
        # any request is sent
        with pytest.raises(InvalidRequest) as info:
            fleet.generate_batch([[1], [2]], {"max_tokens": -1}, return_exceptions=True)
        assert info.value.code == "bad_field" and fleet.stats()["num_completed"] == 11
        stats = fleet.stats()
        assert stats["weight_version"] == 4 and stats["num_workers"] == 2
        pids = [w["pid"] for w in stats["workers"]]
    assert not any(psutil.pid_exists(p) for p in pids)
    with pytest.raises(FleetClosed):
        fleet.generate("y", [1])


def test_a_failed_request_ends_its_batch_and_leaves_none_of_the_others_running():
    with SyncClient(FleetConfig(engine="echo", num_workers=2, engine_options={"tokens_per_s": 100})) as fleet:
        # the third prompt holds an id outside the echo engine's vocabulary: its worker refuses it
        prompts = [[1], [2], [10**6], [3]]
        ids = ["a", "b", "c", "d"]
        with pytest.raises(InvalidRequest):
            fleet.generate_batch(prompts, SamplingParams(max_tokens=1000), request_ids=ids)
        assert fleet.stats()["num_inflight"] == 0  # the others were stopped, not left to run
        again = fleet.generate_batch([[1], [2]], SamplingParams(max_tokens=2), request_ids=ids[:2])
        assert [r.token_ids for r in again] == [expected_tokens([1], 2), expected_tokens([2], 2)]
        # a batch given up at its timeout leaves nothing behind either
        with pytest.raises(RequestTimeout):
            fleet.generate_batch([[1], [2]], SamplingParams(max_tokens=1000), timeout=0.3)
        assert fleet.stats()["num_inflight"] == 0


def test_abort_all_from_another_thread_ends_a_blocked_batch_with_partial_output():
    # The usual over-sampling pattern: a batch runs in one thread, another stops what is
    # left once enough samples are in.
    with SyncClient(FleetConfig(engine="echo", num_workers=2, engine_options={"tokens_per_s": 100})) as fleet:
        prompts = [[i + 1] for i in range(6)]
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            batch = pool.submit(fleet.generate_batch, prompts, SamplingParams(max_tokens=1000))
            deadline = time.monotonic() + 10
            while fleet.stats()["num_inflight"] < 6 and time.monotonic() < deadline:
                time.sleep(0.01)
            time.sleep(0.1)
            assert len(fleet.abort_all()) == 6
            results = batch.result(timeout=10)
        for prompt, r in zip(prompts, results):
            assert r.finish_reason == "abort" and 0 < len(r.token_ids) < 1000
            assert r.token_ids == expected_tokens(prompt, len(r.token_ids))


def test_a_batch_interrupted_by_ctrl_c_leaves_none_of_its_requests_running():
    # A KeyboardInterrupt in the waiting thread (Ctrl-C in a notebook, say) left the whole
    # batch generating on the fleet, unseen, as the fleet lives on.
    script = textwrap.dedent("""
        import os, signal, threading, time
        from rollfleet.actors import SyncClient, FleetConfig
        from rollfleet.transport.messages import SamplingParams

        # Ctrl-C as in a terminal: a runner started in the background passes SIGINT on ignored.
        signal.signal(signal.SIGINT, signal.default_int_handler)
        with SyncClient(FleetConfig(engine="echo", num_workers=2, engine_options={"tokens_per_s": 50})) as fleet:
            threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT)).start()
            try:
                fleet.generate_batch([[i + 1] for i in range(8)], SamplingParams(max_tokens=1000))  # 20 s
            except KeyboardInterrupt:
                print("interrupted", flush=True)
            deadline = time.monotonic() + 10
            while fleet.stats()["num_inflight"] and time.monotonic() < deadline:
                time.sleep(0.05)
            print(fleet.stats()["num_inflight"], flush=True)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["interrupted", "0"], out.stdout + out.stderr


def test_fleet_is_shut_down_at_interpreter_exit():
    script = textwrap.dedent("""
        from rollfleet.actors import SyncClient, FleetConfig
        fleet = SyncClient(FleetConfig(engine="echo", num_workers=2))
        print(fleet.supervisor.private_dir, *[w["pid"] for w in fleet.stats()["workers"]], flush=True)
        # no shutdown: atexit must do it
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    fields = out.stdout.split()
    pids = [int(p) for p in fields[1:]]
    assert len(pids) == 2 and not any(psutil.pid_exists(p) for p in pids)
    import os

    assert not os.path.exists(fields[0])


def test_a_client_dropped_without_shutdown_stops_its_fleet_at_once(tmp_path):
    # The client goes out of scope in a function: its fleet stops then, not at exit (its loop
    # thread used to keep it running for as long as the process lived).
    front = tmp_path / "front.sock"
    script = textwrap.dedent(f"""
        import os, time
        import psutil
        from rollfleet.actors import SyncClient, FleetConfig

        def rollouts():
            fleet = SyncClient(FleetConfig(engine="echo", num_workers=1, frontend_addr="ipc://{front}"))
            return fleet.supervisor.private_dir, [w["pid"] for w in fleet.stats()["workers"]]

        private, pids = rollouts()
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and (any(psutil.pid_exists(p) for p in pids) or os.path.exists(private)):
            time.sleep(0.05)
        print(any(psutil.pid_exists(p) for p in pids), os.path.exists(private), os.path.exists("{front}"), flush=True)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "False", "False"], out.stdout + out.stderr


def holding_the_loop(release, seconds):
    """Weights whose generator holds the fleet's loop thread until ``release`` is set (at most
    ``seconds``), as a collective that never completes would."""
    yield "offset", torch.tensor([0])
    release.wait(seconds)


def test_shutdown_with_the_loop_blocked_in_a_weight_generator_kills_the_workers_promptly(tmp_path):
    # Ctrl-C while update_weights pulls a generator that blocks (a collective that never
    # completes): the loop cannot run a shutdown, so the workers are killed from this thread
    # (it waited 60 s, then left the private directory behind).
    fleet = SyncClient(FleetConfig(engine="echo", num_workers=2, private_dir_root=str(tmp_path)))
    pids = [h.pid for h in fleet.supervisor.workers.values()]
    private_dir = fleet.supervisor.private_dir
    release = threading.Event()

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        update = pool.submit(fleet.update_weights, holding_the_loop(release, 60), 1)
        time.sleep(0.5)
        t0 = time.monotonic()
        fleet.shutdown()
        took = time.monotonic() - t0
        with pytest.raises(FleetClosed):
            update.result(30)
        release.set()
    assert took < 30
    assert not any(psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE for pid in pids)
    assert not os.path.exists(private_dir)


def test_stream_from_plain_code_yields_chunks_then_the_result_and_closing_it_aborts():
    import contextlib

    with SyncClient(FleetConfig(engine="echo", num_workers=1, engine_options={"tokens_per_s": 200})) as fleet:
        items = list(fleet.stream("s1", [4, 5], SamplingParams(max_tokens=6)))
        assert len(items) >= 2 and hasattr(items[-1], "finish_reason")
        tokens = [t for item in items[:-1] for t in item.token_ids]
        assert tokens == items[-1].token_ids == expected_tokens([4, 5], 6)
        # closed after the first chunk: the request stops on its worker before close() returns
        with contextlib.closing(fleet.stream("s2", [1], SamplingParams(max_tokens=1000))) as stream:
            first = next(stream)
            assert first.token_ids
        assert fleet.stats()["num_inflight"] == 0 and fleet.stats()["num_cancelled"] == 1
        # errors are raised like generate's, in the caller's thread
        with pytest.raises(InvalidRequest):
            next(fleet.stream("s3", [1], {"max_tokens": -1}))
        # prompts given as a generator are all generated for (they used to be used up by the ids)
        results = fleet.generate_batch((p for p in ([1], [2], [3])), SamplingParams(max_tokens=2))
        assert [r.token_ids for r in results] == [expected_tokens(p, 2) for p in ([1], [2], [3])]
    with pytest.raises(FleetClosed):
        next(fleet.stream("s4", [1]))


def test_a_start_that_outlasts_start_timeout_s_is_a_worker_start_error_and_leaves_nothing():
    config = FleetConfig(engine="echo", num_workers=1, engine_options={"start_delay_s": 30})
    t0 = time.monotonic()
    with pytest.raises(WorkerStartError, match="start_timeout_s=1"):  # was RequestTimeout, a request's error
        SyncClient(config, start_timeout_s=1)
    assert time.monotonic() - t0 < 20  # (the no_leaks fixture checks that no worker is left)


def test_its_llm_client_used_from_another_event_loop_raises_instead_of_hanging():
    import asyncio

    with SyncClient(FleetConfig(engine="echo", num_workers=1)) as fleet:
        async def elsewhere():
            with pytest.raises(RuntimeError, match="event loop"):
                await fleet.client.generate("x", [1], SamplingParams(max_tokens=2))
            with pytest.raises(RuntimeError, match="event loop"):
                await fleet.client.stats()

        outcome = concurrent.futures.ThreadPoolExecutor(1).submit(asyncio.run, elsewhere())
        outcome.result(30)  # it used to wait forever: its answer was set on the fleet's loop
        assert fleet.stats()["num_inflight"] == 0
        assert fleet.generate("y", [1], SamplingParams(max_tokens=2)).token_ids == expected_tokens([1], 2)


def test_a_forked_child_cannot_use_the_fleet_and_leaves_it_running_when_it_exits():
    # The child has a copy of the client but not its loop thread: its calls raise at once (they
    # waited for ever), and its normal exit (finalizers, atexit) leaves the parent's fleet alone
    # (it killed the parent's workers and removed its private directory).
    script = textwrap.dedent("""
        import contextlib, os, sys
        import psutil
        from rollfleet.actors import SyncClient, FleetConfig
        from rollfleet.errors import FleetClosed
        from rollfleet.transport.messages import SamplingParams

        with SyncClient(FleetConfig(engine="echo", num_workers=1)) as fleet:
            worker = fleet.stats()["workers"][0]["pid"]
            pid = os.fork()
            if pid == 0:
                try:
                    fleet.generate("c", [1], SamplingParams(max_tokens=2), timeout=5)
                    print("child: answered", flush=True)
                except FleetClosed as exc:
                    print("child:", "refused" if "forked" in str(exc) else repr(exc), flush=True)
                with contextlib.suppress(FleetClosed):
                    list(fleet.stream("cs", [1]))
                fleet.shutdown()  # a no-op here
                sys.exit(0)  # not os._exit: the with block's exit, finalizers and atexit run
            _, status = os.waitpid(pid, 0)
            print("parent:", os.waitstatus_to_exitcode(status), psutil.pid_exists(worker),
                  os.path.isdir(fleet.supervisor.private_dir), fleet.stats()["workers"][0]["pid"] == worker,
                  fleet.generate("p", [3], SamplingParams(max_tokens=4), timeout=20).token_ids, flush=True)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)  # a group: a child that hangs is killed with its parent
    try:
        stdout, stderr = proc.communicate(timeout=90)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert proc.returncode == 0, stderr
    assert stdout.splitlines() == ["child: refused", f"parent: 0 True True True {expected_tokens([3], 4)}"], stdout + stderr


def test_a_call_timeout_is_kept_even_while_the_loop_is_blocked_in_a_weight_generator():
    # The timeout is the call's own on the loop; the loop held in user code cannot keep it, so
    # the calling thread gives up a second after it (generate waited for the loop to be free).
    with SyncClient(FleetConfig(engine="echo", num_workers=1)) as fleet:
        release = threading.Event()
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            update = pool.submit(fleet.update_weights, holding_the_loop(release, 30), 1)
            time.sleep(0.5)
            for call in (lambda: fleet.generate("g", [1], SamplingParams(max_tokens=2), timeout=1),
                         lambda: fleet.generate_batch([[1], [2]], SamplingParams(max_tokens=2), timeout=1),
                         lambda: list(fleet.stream("s", [1], SamplingParams(max_tokens=2), timeout=1))):
                t0 = time.monotonic()
                with pytest.raises(RequestTimeout):
                    call()
                assert time.monotonic() - t0 < 8  # 2 s and a slice; it took as long as the loop was held
            release.set()
            update.result(30)
        # nothing of those calls is left running once the loop is free again
        assert fleet.stats()["num_inflight"] == 0
        assert fleet.generate("after", [2], SamplingParams(max_tokens=3), timeout=20).token_ids == \
            expected_tokens([2], 3)
