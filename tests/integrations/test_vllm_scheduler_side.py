"""The connector's scheduler side: a request's own bad ``kv_transfer_params`` makes that request
recompute, never an exception in vLLM's scheduler (which would stop the engine). Run without vLLM
(tests/vllm_stub.py)."""

from __future__ import annotations

from pathlib import Path

from vllm_stub import run_without_vllm

CODE = r'''
from types import SimpleNamespace
import torch
from kvfetcher.integrations.vllm_meta import Options
from kvfetcher.integrations.vllm_scheduler import SchedulerSide

spec = SimpleNamespace(block_size=16, dtype=torch.bfloat16, num_kv_heads=2, head_size=64)
kv_cache_config = SimpleNamespace(kv_cache_groups=[SimpleNamespace(kv_cache_spec=spec, layer_names=["l0", "l1"])])
vllm_config = SimpleNamespace(parallel_config=SimpleNamespace(tensor_parallel_size=1))
s = SchedulerSide(vllm_config, kv_cache_config, Options(socket="/nonexistent/kvfetcher.sock", model="m"))
for params in ({"presets": ["balnced"]}, {"presets": 5}, {"ttft_budget_s": "soon"}):
    request = SimpleNamespace(request_id=str(params), prompt_token_ids=list(range(600)), kv_transfer_params=params,
                              skip_reading_prefix_cache=False)
    print(s.matched(request, 0), s.matched(request, 0))
s.close()
'''


def test_unknown_presets_in_a_request_make_it_recompute():
    run = run_without_vllm(CODE)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split("\n")[:3] == ["(0, False) (0, False)"] * 3, run.stdout


STORES = r'''
import time
from types import SimpleNamespace
import torch
from kvfetcher.integrations.vllm_meta import Options
from kvfetcher.integrations.vllm_scheduler import SchedulerSide

spec = SimpleNamespace(block_size=16, dtype=torch.bfloat16, num_kv_heads=2, head_size=64)
kv_cache_config = SimpleNamespace(kv_cache_groups=[SimpleNamespace(kv_cache_spec=spec, layer_names=["l0", "l1"])])


def stored(role, params, hit=None):
    """The tokens the scheduler asks the workers to store of one finished 600-token prefill (and
    from which token), and its lookups; ``hit``: the sidecar's answer, ``hit`` tokens stored, recompute."""
    vllm_config = SimpleNamespace(parallel_config=SimpleNamespace(tensor_parallel_size=1), kv_transfer_config=SimpleNamespace(kv_role=role),
                                  model_config=SimpleNamespace(model="m"))
    s = SchedulerSide(vllm_config, kv_cache_config, Options.parse({"socket": "/nonexistent/kvfetcher.sock"}, vllm_config))
    s.client.chunk_tokens = 256  # as learnt from a sidecar's reply
    if hit is not None:
        s.client.lookup = lambda *a, **k: SimpleNamespace(preset="recompute", loaded_tokens=0, hit_tokens=hit)
    looked, lookup = [], s._lookup
    s._lookup = lambda *a: looked.append(1) or lookup(*a)
    prompt = list(range(600))
    request = SimpleNamespace(request_id="r", prompt_token_ids=prompt, kv_transfer_params=params, skip_reading_prefix_cache=False)
    while s.matched(request, 0) == (None, False):  # the lookup in flight
        time.sleep(0.001)
    new = SimpleNamespace(req_id="r", num_computed_tokens=0, block_ids=(list(range(40)),), prompt_token_ids=prompt)
    none = SimpleNamespace(req_ids=[], num_computed_tokens=[], new_block_ids=[], resumed_req_ids=set())
    out = SimpleNamespace(scheduled_new_reqs=[new], scheduled_cached_reqs=none, num_scheduled_tokens={"r": 600},
                          total_num_scheduled_tokens=600, preempted_req_ids=set())
    meta = s.step(out)
    held = s.finished("r", True)
    s.close()
    return [(len(x.tokens), x.first_token) for x in meta.stores], len(looked), held

for role, params in (("kv_both", {}), ("kv_consumer", {}), ("kv_both", {"store": False}), ("kv_producer", {}), ("kv_both", {"store": "no"})):
    print(role, params, *stored(role, params))
for hit in (256, 512):
    print("hit", hit, *stored("kv_both", {}, hit))
'''


def test_a_consumer_role_or_a_request_saying_store_false_stores_nothing_and_a_producer_looks_nothing_up():
    run = run_without_vllm(STORES)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.splitlines() == [
        "kv_both {} [(512, 0)] 1 True",  # as deployed: looked up, its two whole chunks stored (its blocks held for the copy)
        "kv_consumer {} [] 1 False",  # loads only: looked up, nothing stored
        "kv_both {'store': False} [] 1 False",  # the request's own "do not store this"
        "kv_producer {} [(512, 0)] 0 True",  # stores only: no lookup
        "kv_both {'store': 'no'} [] 0 False",  # refused params: the request's own recompute, not stored
        "hit 256 [(512, 256)] 1 True",  # recomputed, its first chunk stored already: only the second is copied out
        "hit 512 [] 1 False",  # recomputed, both stored already: no store, its blocks not held
    ], run.stdout


PATIENCE = r'''
import sys
from types import SimpleNamespace
import torch
from kvfetcher.fetch.prefill import PrefillModel
from kvfetcher.integrations.vllm_meta import Options
from kvfetcher.integrations.vllm_scheduler import MAX_WAIT_S, SchedulerSide

spec = SimpleNamespace(block_size=16, dtype=torch.bfloat16, num_kv_heads=2, head_size=64)
kv_cache_config = SimpleNamespace(kv_cache_groups=[SimpleNamespace(kv_cache_spec=spec, layer_names=["l0", "l1"])])
s = SchedulerSide(SimpleNamespace(parallel_config=SimpleNamespace(tensor_parallel_size=1)), kv_cache_config, Options(socket="/nonexistent/s", model="m"))
short, long = (SimpleNamespace(prompt_token_ids=list(range(n))) for n in (600, 131072))
slow = PrefillModel.linear(10_000.0)
print(min(s._patience(r, 0, m)[0] for r in (short, long) for m in (None, slow)) >= sys.getswitchinterval(),
      s._patience(long, 0, slow)[0] == MAX_WAIT_S)
s.lookups.took.extend([0.006] * 10)  # answers lately take 6 ms: a short prompt's ask waits for one
print(0.006 < s._patience(short, 0, None)[0] <= MAX_WAIT_S, s._patience(long, 0, slow)[0] == MAX_WAIT_S)
s.close()
'''


def test_one_ask_waits_at_least_a_gil_switch_interval_and_as_long_as_answers_lately_took():
    """The lookup thread in the engine's process may wait a switch interval for the GIL, and a busy
    sidecar answers later: an ask that gave up sooner would put the request off a whole step for an
    answer a millisecond away. Never longer than MAX_WAIT_S."""
    run = run_without_vllm(PATIENCE)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split("\n")[:2] == ["True True", "True True"], run.stdout


DEFERRALS = r'''
import logging, sys, threading, time
from types import SimpleNamespace
import torch
from kvfetcher.integrations.vllm_meta import Options
from kvfetcher.integrations.vllm_scheduler import SchedulerSide

logging.basicConfig(stream=sys.stdout, level=logging.WARNING, format="%(message)s")
spec = SimpleNamespace(block_size=16, dtype=torch.bfloat16, num_kv_heads=2, head_size=64)
kv_cache_config = SimpleNamespace(kv_cache_groups=[SimpleNamespace(kv_cache_spec=spec, layer_names=["l0", "l1"])])
s = SchedulerSide(SimpleNamespace(parallel_config=SimpleNamespace(tensor_parallel_size=1)), kv_cache_config,
                  Options(socket="/nonexistent/s", model="m", lookup_timeout_s=0.2))
gate = threading.Event()
s._lookup = lambda request, options: gate.wait(5) and None
request = SimpleNamespace(request_id="r", prompt_token_ids=list(range(600)), kv_transfer_params=None)
print("answer", s.matched(request, 0))  # not answered within the wait: put off a step (and said so)
time.sleep(0.25)
print("answer", s.matched(request, 0))  # past the request's timeout: recomputes (and says so, not muted by the first)
gate.set()
s.close()
'''


def test_a_request_put_off_a_step_is_logged_and_does_not_mute_the_recompute_warning():
    run = run_without_vllm(DEFERRALS)
    assert run.returncode == 0, run.stderr[-2000:]
    lines = run.stdout.splitlines()
    assert lines[0].startswith("kvfetcher: a request was put off a step") and "1 of 0 asks" in lines[0], lines
    assert lines[1] == "answer (None, False)"
    assert lines[2].startswith("KV lookup not answered in time") and lines[3] == "answer (0, False)", lines


SHORT = r'''
from types import SimpleNamespace
import torch
from kvfetcher.integrations.vllm_meta import Options
from kvfetcher.integrations.vllm_scheduler import SchedulerSide

spec = SimpleNamespace(block_size=16, dtype=torch.bfloat16, num_kv_heads=2, head_size=64)
kv_cache_config = SimpleNamespace(kv_cache_groups=[SimpleNamespace(kv_cache_spec=spec, layer_names=["l0", "l1"])])
s = SchedulerSide(SimpleNamespace(parallel_config=SimpleNamespace(tensor_parallel_size=1)), kv_cache_config, Options(socket="/nonexistent/s", model="m"))
asked = []
s._lookup = lambda request, options: asked.append(request.request_id) or s._late(request)
def ask(rid, tokens, local):
    return s.matched(SimpleNamespace(request_id=rid, prompt_token_ids=list(range(tokens)), kv_transfer_params=None), local)
ask("before the chunk size is known", 100, 0)
s.client.chunk_tokens = 256  # as the sidecar's first answer says
for rid, tokens, local in (("short", 200, 0), ("all whole chunks held by vLLM", 600, 512), ("one chunk beyond vLLM's hit", 600, 256)):
    print(rid, ask(rid, tokens, local))
print(asked)
s.close()
'''


def test_a_prompt_with_no_whole_chunk_beyond_vllms_own_hit_is_not_looked_up():
    """Nothing a load could add: the scheduler neither asks the sidecar nor waits (a short chat turn pays nothing)."""
    run = run_without_vllm(SHORT)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.splitlines()[-1] == "['before the chunk size is known', \"one chunk beyond vLLM's hit\"]", run.stdout


NOTHING = r'''
import threading
from types import SimpleNamespace
import torch
from kvfetcher.fetch.plan import FetchPlan
from kvfetcher.integrations.vllm_meta import Options
from kvfetcher.integrations.vllm_scheduler import NOTHING_TO_WAIT_FOR, SchedulerSide, _Request

spec = SimpleNamespace(block_size=16, dtype=torch.bfloat16, num_kv_heads=2, head_size=64)
kv_cache_config = SimpleNamespace(kv_cache_groups=[SimpleNamespace(kv_cache_spec=spec, layer_names=["l0", "l1"])])
s = SchedulerSide(SimpleNamespace(parallel_config=SimpleNamespace(tensor_parallel_size=1)), kv_cache_config,
                  Options(socket="/nonexistent/s", model="m", lookup_timeout_s=5.0))
plan = FetchPlan("m", "bfloat16", 0, 256, 512, "k", 512, "recompute", (), 0.0, {}, None, None, None)
gate, late = threading.Event(), set()
def lookup(request, options, end):
    if request.request_id in late:
        gate.wait(5)
    return _Request(request, [], (plan,), end, options, answered=True)
def ask(rid, end):
    s._lookup = lambda request, options: lookup(request, options, end)
    return s.matched(SimpleNamespace(request_id=rid, prompt_token_ids=list(range(600)), kv_transfer_params=None), 0)
late.add("late, loads planned lately")
print([ask(str(i), 512) for i in range(NOTHING_TO_WAIT_FOR)][-1], ask("late, loads planned lately", 512))
for i in range(NOTHING_TO_WAIT_FOR):
    ask(f"nothing {i}", 0)  # answered in time, each a recompute
late.add("late, nothing planned lately")
print(ask("late, nothing planned lately", 512))
gate.set()
s.close()
'''


def test_a_late_answer_waits_a_step_only_while_answers_lately_planned_loads():
    """Under load with nothing worth loading, a late answer would put the request off a step (a
    step of TTFT) for a plan that recomputes anyway: once the last answers all planned no load, a
    late one recomputes at once."""
    run = run_without_vllm(NOTHING)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.splitlines() == ["(512, True) (None, False)", "(0, False)"], run.stdout


LOADS = r'''
import time
from types import SimpleNamespace
import torch
from kvfetcher.fetch import prefill
from kvfetcher.fetch.plan import FetchPlan
from kvfetcher.integrations.vllm_meta import Options
from kvfetcher.integrations.vllm_scheduler import LOAD_OVERHEAD_PRIOR_S, SchedulerSide, _Request

spec = SimpleNamespace(block_size=16, dtype=torch.bfloat16, num_kv_heads=2, head_size=64)
kv_cache_config = SimpleNamespace(kv_cache_groups=[SimpleNamespace(kv_cache_spec=spec, layer_names=["l0", "l1"])])
s = SchedulerSide(SimpleNamespace(parallel_config=SimpleNamespace(tensor_parallel_size=1)), kv_cache_config,
                  Options(socket="/nonexistent/s", model="m", lookup_timeout_s=5.0))
s.prefill.observe(*prefill.terms([(0, 600)]), 0.006)  # the engine's prefill: 10 us a token, so 88 tokens' tail ~1 ms
plan = FetchPlan("m", "bfloat16", 0, 256, 512, "k", 512, "raw", (("raw", 1), ("raw", 1)), 0.01, {"raw": 0.05, "recompute": 0.5},
                 None, None, None)
seen = []
def lookup(request, options):
    seen.append(options.load_overhead_s)
    assert options.prefill_error == s.wall.error
    return _Request(request, list(range(599)), (plan,), 512, options, answered=True)
s._lookup = lookup
none = SimpleNamespace(req_ids=[], num_computed_tokens=[], new_block_ids=[], resumed_req_ids=set())

def load(rid, loaded, end_by, done=True):
    # a 600-token request whose 512-token load is handed off and reported done (done), then, 0.1 s
    # later, first scheduled with `loaded` tokens computed; then its prefill ends (end_by: a later
    # step, or the request's end)
    r = SimpleNamespace(request_id=rid, prompt_token_ids=list(range(600)), kv_transfer_params=None)
    assert s.matched(r, 0) == (512, True)
    s.allocated(r, list(range(38)), 512)
    time.sleep(0.05)  # the fetch: not the engine's time
    s.loads_done([rid] if done else [])
    time.sleep(0.1)
    new = SimpleNamespace(req_id=rid, num_computed_tokens=loaded, block_ids=(list(range(38)),), prompt_token_ids=r.prompt_token_ids)
    s.step(SimpleNamespace(scheduled_new_reqs=[new], scheduled_cached_reqs=none, num_scheduled_tokens={rid: 600 - loaded},
                           total_num_scheduled_tokens=600 - loaded, preempted_req_ids=set()))
    if end_by == "step":
        cached = SimpleNamespace(req_ids=[rid], num_computed_tokens=[600], new_block_ids=[None], resumed_req_ids=set())
        s.step(SimpleNamespace(scheduled_new_reqs=[], scheduled_cached_reqs=cached, num_scheduled_tokens={rid: 1},
                               total_num_scheduled_tokens=1, preempted_req_ids=set()))
    s.finished(rid, True)

print(s.load_overhead.seconds == LOAD_OVERHEAD_PRIOR_S)
load("short", 256, "finished")  # the load fell short: not timed
load("unreported", 512, "finished", done=False)  # never reported done: not timed
print(s.load_overhead.seconds == LOAD_OVERHEAD_PRIOR_S)
load("whole", 512, "step")  # 0.1 s from its end to the end of its prefill, ~1 ms of it predicted
print(0.09 <= s.load_overhead.seconds < 0.14)
load("one token", 512, "finished")  # its prefill ends with the request
print(0.09 <= s.load_overhead.seconds < 0.14, seen[0] == LOAD_OVERHEAD_PRIOR_S, seen[-1] > 0.09, not s.loading)
s.close()
'''


IDLE = LOADS.split("print(s.load_overhead.seconds == LOAD_OVERHEAD_PRIOR_S)")[0].replace(
    "s.prefill.observe(*prefill.terms([(0, 600)]), 0.006)",
    "for n in (300, 600, 1200, 2400):\n    s.prefill.observe(*prefill.terms([(0, n)]), 0.05 + 1e-5 * n)  # 50 ms a step whatever it computes") + r'''
m = s.prefill_model()
rid = "idle"
r = SimpleNamespace(request_id=rid, prompt_token_ids=list(range(600)), kv_transfer_params=None)
assert s.matched(r, 0) == (512, True)
s.allocated(r, list(range(38)), 512)
s.loads_done([rid])
idle = SimpleNamespace(scheduled_new_reqs=[], scheduled_cached_reqs=none, num_scheduled_tokens={}, total_num_scheduled_tokens=0,
                       preempted_req_ids=set())
for _ in range(3):  # the engine steps on, computing nothing, before it schedules the request again
    time.sleep(0.05)
    s.step(idle)
new = SimpleNamespace(req_id=rid, num_computed_tokens=512, block_ids=(list(range(38)),), prompt_token_ids=r.prompt_token_ids)
s.step(SimpleNamespace(scheduled_new_reqs=[new], scheduled_cached_reqs=none, num_scheduled_tokens={rid: 88},
                       total_num_scheduled_tokens=88, preempted_req_ids=set()))
s.finished(rid, True)
tail = m.step(*prefill.terms([(512, 88)]))
print(round(m.c0, 3), 0.05 < tail < 0.06, 0.15 - tail - 0.01 <= s.load_overhead.seconds < 0.15 - tail + 0.04)
s.close()
'''


def test_the_steps_that_compute_nothing_while_a_loaded_request_waits_count_as_the_loads_overhead():
    """Steps of no tokens between a load's end and the request's prefill are what the load cost the
    engine, not prefill time: the prefill model's fixed term is not subtracted for them."""
    run = run_without_vllm(IDLE)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.splitlines() == ["0.05 True True"], run.stdout


SPAN = LOADS.split("print(s.load_overhead.seconds == LOAD_OVERHEAD_PRIOR_S)")[0] + r'''
from kvfetcher.integrations.vllm_meta import WorkerReport

def timed_load(rid, report):
    # handed over; the fetch starts 0.05 s later and takes 0.1 s; the workers report it 0.1 s after
    # its end; the request's 88-token tail is then computed at once
    r = SimpleNamespace(request_id=rid, prompt_token_ids=list(range(600)), kv_transfer_params=None)
    assert s.matched(r, 0) == (512, True)
    s.allocated(r, list(range(38)), 512)
    time.sleep(0.05)
    start = time.perf_counter()
    time.sleep(0.1)
    end = time.perf_counter()
    time.sleep(0.1)
    s.loads_done([rid])
    if report:
        s.report(WorkerReport(fetched={rid: (start, end)}))
    new = SimpleNamespace(req_id=rid, num_computed_tokens=512, block_ids=(list(range(38)),), prompt_token_ids=r.prompt_token_ids)
    s.step(SimpleNamespace(scheduled_new_reqs=[new], scheduled_cached_reqs=none, num_scheduled_tokens={rid: 88},
                           total_num_scheduled_tokens=88, preempted_req_ids=set()))
    s.finished(rid, True)
    return s.load_overhead.seconds

print(timed_load("reported only", False) < 0.02)  # timed from the workers' report: the engine's wait before it is not seen
s.load_overhead = prefill.LoadOverhead()
print(0.14 <= timed_load("timed by the workers", True) < 0.2)  # 0.05 before the fetch began + 0.1 after it ended
s.close()
'''


def test_a_load_is_timed_from_the_fetchs_end_as_the_workers_saw_it_plus_the_wait_before_it_began():
    """The engine's time between a fetch's end and the workers' report of it, and between handing the
    load over and the fetch's start, is the load's overhead: the workers' report carries the
    fetch's span, and the overhead counts from its end, plus the wait before its start."""
    run = run_without_vllm(SPAN)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.splitlines() == ["True", "True"], run.stdout


def test_a_load_teaches_what_it_cost_the_engine_past_the_fetch_and_lookups_then_say_so():
    """Timed from the workers' report that the load is done to the end of the request's prefill,
    against the prefill model's time for what was left (the fetch's own time is not the engine's); a
    load that fell short or was never reported done teaches nothing; the next lookup carries it."""
    run = run_without_vllm(LOADS)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.splitlines() == ["True", "True", "True", "True True True True"], run.stdout


SLOW_LISTING = r'''
import logging, sys, tempfile, time
from pathlib import Path
from types import SimpleNamespace
sys.path.insert(0, TESTS)
import torch
from kvtest import sidecar
from kvfetcher.integrations.vllm_meta import Options
from kvfetcher.integrations.vllm_scheduler import LOOKUP_SOCKET_TIMEOUT_S, SchedulerSide
from kvfetcher.store.local import LocalStore

class SlowListing(LocalStore):
    def list(self, prefix):
        time.sleep(LOOKUP_SOCKET_TIMEOUT_S + 0.5)  # a busy store: longer than the client waits beyond the listing
        return super().list(prefix)

logging.basicConfig(stream=sys.stdout, level=logging.WARNING, format="%(message)s")
spec = SimpleNamespace(block_size=16, dtype=torch.bfloat16, num_kv_heads=2, head_size=64)
kv_cache_config = SimpleNamespace(kv_cache_groups=[SimpleNamespace(kv_cache_spec=spec, layer_names=["l0", "l1"])])
tmp = Path(tempfile.mkdtemp())
with sidecar(SlowListing(tmp / "store"), token=None, socket_path=str(tmp / "s.sock")):
    for tp in (1, 2):  # one sidecar answers for both ranks (each its own namespace)
        s = SchedulerSide(SimpleNamespace(parallel_config=SimpleNamespace(tensor_parallel_size=tp)), kv_cache_config,
                          Options(socket=str(tmp / "s.sock"), model="m", lookup_timeout_s=10, listing_wait_s=LOOKUP_SOCKET_TIMEOUT_S + 3))
        request = SimpleNamespace(request_id="r", prompt_token_ids=list(range(600)), kv_transfer_params=None)
        while (got := s.matched(request, 0)) == (None, False):  # the lookup in flight: vLLM asks again at its next step
            time.sleep(0.01)
        print("tp", tp, got, "answered" if s.requests["r"].answered else "not answered")
        s.close()
'''


def test_a_lookup_the_sidecar_answers_within_its_listing_wait_is_not_a_failed_lookup():
    """The sidecar may wait ``listing_wait_s`` for its store's listing before it answers: the
    lookup's client waits that long and more before it takes the sidecar for gone (else a slow
    listing turned a miss or a hit into a failed lookup, and a tensor-parallel group recomputed)."""
    run = run_without_vllm(f"TESTS = {str(Path(__file__).parent.parent)!r}\n" + SLOW_LISTING)
    assert run.returncode == 0, run.stderr[-2000:]
    said = [line for line in run.stdout.splitlines() if line.startswith(("tp ", "KV lookup"))]
    assert said == ["tp 1 (0, False) answered", "tp 2 (0, False) answered"], run.stdout
