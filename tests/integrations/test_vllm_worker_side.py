"""The connector's worker side without vLLM (tests/vllm_stub.py): how a step that computed nothing
waits for a load to land."""

from vllm_stub import run_without_vllm

IDLE = r'''
import threading, time
from types import SimpleNamespace
from kvfetcher.fetch.plan import FetchOptions
from kvfetcher.integrations import vllm_worker
from kvfetcher.integrations.vllm_meta import FetchSpec, Options, StepMeta

cfg = SimpleNamespace(cache_config=SimpleNamespace(block_size=16))
w = vllm_worker.WorkerSide(cfg, Options(socket="/nonexistent/s", model="m"))
bound = w.options.idle_step_wait_s
w.block_size = 16
gate = threading.Event()
w._with_buffer = lambda fn: gate.wait(5) and 64  # a load that lands when the gate opens: 64 tokens written
spec = FetchSpec("r", list(range(64)), (), 0, 64, list(range(4)), FetchOptions())

def timed(meta):
    w.start_step(meta)
    t = time.perf_counter()
    got = w.finished(set())
    return time.perf_counter() - t, got

busy, _ = timed(StepMeta([spec], [], 64))  # a step that computed tokens: no wait
idle, got = timed(StepMeta([], [], 0))  # computed nothing while the load runs: waits, bounded
print(busy < bound, bound <= idle < 0.5, got)
threading.Timer(0.05, gate.set).start()
w.idle_step = True
w.options = Options(socket="/nonexistent/s", model="m", idle_step_wait_s=1.0)
t = time.perf_counter()
got = w.finished(set())  # woken as the load lands, long before the (here 1 s) bound
print(0.04 <= time.perf_counter() - t < 1.0, got, w.load_errors())
t = time.perf_counter()
w.finished(set())  # nothing loading any more: no wait
print(time.perf_counter() - t < 0.05)
w.options = Options(socket="/nonexistent/s", model="m", idle_step_wait_s=0)
gate = threading.Event()
w.start_step(StepMeta([spec], [], 64))  # a load that runs until the gate opens
w.start_step(StepMeta([], [], 0))
t = time.perf_counter()
w.finished(set())  # a wait of 0: never held
print(time.perf_counter() - t < 0.05)
gate.set()
w.close()
'''


def test_a_step_that_computed_nothing_waits_for_a_running_load_a_bounded_time_and_wakes_as_it_lands():
    """vLLM steps without pause while a request waits for its KV; the worker side holds such a step
    up to the connector's idle_step_wait_s for a load to land, wakes as soon as one does, and never holds a step that
    computed tokens or one with no load running."""
    run = run_without_vllm(IDLE)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split("\n")[:4] == ["True True (None, None)", "True (None, {'r'}) set()", "True", "True"], run.stdout


TIMED = r'''
import threading, time
from types import SimpleNamespace
from kvfetcher.fetch.plan import FetchOptions
from kvfetcher.integrations import vllm_worker
from kvfetcher.integrations.vllm_meta import FetchSpec, Options, StepMeta, WorkerReport

cfg = SimpleNamespace(cache_config=SimpleNamespace(block_size=16))
w = vllm_worker.WorkerSide(cfg, Options(socket="/nonexistent/s", model="m"))
w.block_size = 16
w._with_buffer = lambda fn: time.sleep(0.1) or 64  # a 0.1 s fetch that writes 64 tokens
t0 = time.perf_counter()
w.start_step(StepMeta([FetchSpec("r", list(range(64)), (), 0, 64, list(range(4)), FetchOptions())], [], 0))
while not w.finished(set())[1]:
    time.sleep(0.01)
rep = w.take_report()
start, end = rep.fetched["r"]
print(t0 <= start < t0 + 0.05, 0.09 <= end - start < 0.5, w.take_report())
a = WorkerReport({"x": 3}, [], {"r": (1.0, 2.0), "s": (5.0, 6.0)})
b = WorkerReport({"x": 2}, [], {"r": (0.5, 1.5), "t": (7.0, 8.0)})
print(a.aggregate(b).fetched == {"r": (0.5, 2.0), "s": (5.0, 6.0), "t": (7.0, 8.0)}, a.aggregate(b).stored_chunks)
w.close()
'''


def test_the_workers_report_each_fetchs_span_and_the_ranks_spans_join():
    """A fetch's start and end (one clock across the host's processes) reach the scheduler in the
    workers' report, once; over tensor-parallel ranks the earliest start and the latest end."""
    run = run_without_vllm(TIMED)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.splitlines() == ["True True None", "True {'x': 2}"], run.stdout


APART = r'''
import threading, time
from types import SimpleNamespace
from kvfetcher.fetch.plan import FetchOptions
from kvfetcher.integrations import vllm_worker
from kvfetcher.integrations.vllm_meta import FetchSpec, Options, StepMeta, StoreSpec

cfg = SimpleNamespace(cache_config=SimpleNamespace(block_size=16))
w = vllm_worker.WorkerSide(cfg, Options(socket="/nonexistent/s", model="m"))
w.block_size = 16
gate = threading.Event()
w._with_buffer = lambda fn: fn("buf")
w._store_from = lambda buf, spec, ready: gate.wait(5) and 0  # stores that hold their threads until the gate opens
w._fetch_into = lambda buf, spec: 64
w.end_step(StepMeta([], [StoreSpec("s1", list(range(64)), list(range(4))), StoreSpec("s2", list(range(64)), list(range(4)))], 64))
w.start_step(StepMeta([FetchSpec("r", list(range(64)), (), 0, 64, list(range(4)), FetchOptions())], [], 0))
t = time.perf_counter()
while not (got := w.finished(set())[1]) and time.perf_counter() - t < 3:
    time.sleep(0.01)
print(got, time.perf_counter() - t < 1.0, not gate.is_set())
gate.set()
w.close()
'''


def test_a_fetch_never_waits_behind_stores_for_a_thread():
    """Two stores that take their time (a staged store copies a long prompt out) do not hold the
    thread a request's fetch needs: fetches and stores have threads of their own."""
    run = run_without_vllm(APART)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.splitlines() == ["{'r'} True True"], run.stdout
