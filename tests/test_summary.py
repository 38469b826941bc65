"""OUTOFCUDA_SUMMARY: the utilisation sampler and the block printed at exit.

No GPU or driver exists here, so NVML is the stand-in libnvidia-ml.so.1 of
tests/stub_nvml/stub_nvml.c (built by tests/conftest.py) serving a known
sequence of utilisation values and memory figures from a file; the real C
thread samples it. Scenarios where CUDA initialises use the fake CUDA-build torch of
tests/fake_torch.py (its ``torch.cuda._fake_cuda_init()`` runs the lazy-init
queue as torch does); the rest use the real torch 2.13 CPU build with the
test door ``_outofcuda._testing.summary_start``. Every scenario is a fresh interpreter.
"""
import json
import os
import re
import textwrap
import time

import pytest

from conftest import stub_nvml_config, stub_nvml_device
from fake_torch import make_fake_torch
from kit import CHILD

GIB = 1024 ** 3

PRELUDE = CHILD + """
import atexit, json
import _outofcuda
# need(pred, what, **SAMPLED): a wait for the sampler that names its figures on timing out
SAMPLED = {"timeout": 20.0, "detail": _outofcuda._summary_stats, "poll": 0.005}

def samples(device=0):
    devs = _outofcuda._summary_stats()["devices"]
    return devs[device] if len(devs) > device else {"ticks": 0, "util_samples": 0}
"""


def gpus(stub_nvml, workdir, *lines, **env):
    """Environment that makes the stand-in serve `lines`, one per device:
    "<used bytes> <total bytes> <util> <util> ... [+|hang]", each utilisation
    value served once, in turn (after the last: none, or with "+" the last for
    ever, or with "hang" a call that never returns)."""
    devices, seqs = [], []
    for i, line in enumerate(lines):
        used, total, *utils = line.split()
        end = utils.pop() if utils and utils[-1] in ("+", "hang") else ""
        devices.append(stub_nvml_device(name=f"Stand-in GPU {i}", uuid=f"GPU-stand-in-{i}",
                                        total=total, used=used))
        seqs.append((i, utils, end))
    cfg = stub_nvml_config(workdir / "nvml.cfg", devices, utilseqs=seqs)
    return dict({"LD_LIBRARY_PATH": str(stub_nvml), "STUB_NVML_CONFIG": str(cfg)}, **env)


def run(venv, workdir, body, env, **kw):
    return venv.check(PRELUDE + textwrap.dedent(body), env=env, cwd=workdir, **kw)


def blocks(stderr):
    """stderr's summary blocks: lists of lines, each opening with the header."""
    out = []
    for line in stderr.splitlines():
        if "outofcuda summary: " in line:
            out.append([line])
        elif out and re.sub(r"^\[rank \d+\] ", "", line).startswith("  "):
            out[-1].append(line)
    return out


def test_mean_and_share_under_50_are_what_nvml_served(venv, workdir, stub_nvml):
    # Device 0 serves 10, 30, 60, 100 then nothing; device 1 serves 90, 90, 90, 40.
    env = gpus(stub_nvml, workdir, f"{GIB} {8 * GIB} 10 30 60 100",
               f"{6 * GIB} {8 * GIB} 90 90 90 40")
    r = run(venv, workdir, """
        assert _outofcuda._testing.summary_start([0, 1], 10) is True
        assert "oc-summary" in thread_names(), thread_names()
        # Every value served, then a few ticks that get no utilisation.
        need(lambda: samples(0)["ticks"] >= 7 and samples(1)["ticks"] >= 7, "all values sampled",
             **SAMPLED)
        print(json.dumps(_outofcuda._summary_stats()))
    """, env)
    stats = json.loads(r.stdout)
    d0, d1 = stats["devices"]
    assert (d0["util_samples"], d0["util_sum"], d0["under_50"]) == (4, 200.0, 2)
    assert (d1["util_samples"], d1["util_sum"], d1["under_50"]) == (4, 310.0, 1)
    assert (d0["mem_peak"], d0["mem_total"]) == (GIB, 8 * GIB)
    b = blocks(r.stderr)
    assert len(b) == 2, r.stderr
    assert b[0][0].startswith("outofcuda summary: cuda:0 Stand-in GPU 0 (NVML 0), ")
    assert "  utilisation    mean 50.0 %; under 50 % in 50.0 % of 4 samples (every 10 ms" in b[0][1]
    assert "  utilisation    mean 77.5 %; under 50 % in 25.0 % of 4 samples" in b[1][1]
    assert "  device memory  peak 1.00 of 8.00 GiB (12.5 %, all processes)" in b[0]
    assert "  device memory  peak 6.00 of 8.00 GiB (75.0 %, all processes)" in b[1]
    # Device 1: busy and 75 % full: nothing to suggest.
    assert not any("hint" in line for line in b[1]), b[1]


@pytest.mark.parametrize("workers", [0, 4])
def test_block_at_exit_ranks_number_backed_hints(venv, workdir, stub_nvml, workers):
    env = gpus(stub_nvml, workdir, f"{GIB} {8 * GIB} 20 +")
    r = run(venv, workdir, f"""
        import torch, outofcuda

        class MyLoader(torch.utils.data.DataLoader):
            pass

        # Alive at exit (no worker process starts before iteration).
        loader = MyLoader(torch.utils.data.TensorDataset(torch.zeros(8, 2)), num_workers={workers})
        tries = []

        @outofcuda.auto_microbatch
        def step(batch):
            tries.append(len(batch))
            if len(batch) > 4:
                raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 MiB")
            return batch.sum() * 0

        step(torch.ones(8, 2, requires_grad=True))
        assert tries == [8, 4, 4], tries
        _outofcuda._testing.summary_start([0], 10)
        need(lambda: samples()["util_samples"] >= 5, "5 utilisation samples", **SAMPLED)
    """, env)
    (b,) = blocks(r.stderr)
    assert "  events         0 CUDA OOMs, 1 micro-batch split" in b
    hints = [line for line in b if line.startswith("  hint ")]
    assert len(hints) == 2, b
    # Every sample was under 50 % (score 2.0) ranks above 87.5 % of memory
    # unused (score 1.75). The loader was never iterated: the main thread
    # never waited on it, so it is not blamed, whatever its num_workers.
    assert hints[0].startswith("  hint 1         low utilisation: the GPU was under 50 % busy in "
                               "100 % of samples (mean 20 %); the main thread waited for data in "
                               "only 0 % of the run")
    assert "num_workers" not in hints[0]
    assert hints[1].startswith("  hint 2         bigger batch: device memory peaked at 1.00 of "
                               "8.00 GiB (12.5 %)")


def test_json_path_form_resolved_at_start_and_rank_file(venv, workdir, stub_nvml):
    (workdir / "out").mkdir()
    env = gpus(stub_nvml, workdir, f"{2 * GIB} {8 * GIB} 70 20 +",
               OUTOFCUDA_SUMMARY="out/run.json")
    run(venv, workdir, """
        _outofcuda._testing.summary_start([0], 10)
        os.chdir("/")  # the path was made absolute when the summary started
        need(lambda: samples()["util_samples"] >= 6, "6 samples", **SAMPLED)
    """, env)
    doc = json.loads((workdir / "out" / "run.json").read_text())
    assert doc["version"] == 1 and doc["rank"] is None and doc["interval_ms"] == 10
    assert doc["ooms"] == 0 and doc["microbatch_splits"] == 0 and doc["dataloader_workers"] is None
    (d,) = doc["devices"]
    n = d["samples"]
    assert n >= 6 and d["device"] == 0 and d["nvml_index"] == 0 and d["name"] == "Stand-in GPU 0"
    assert d["utilization_mean"] == pytest.approx((70 + 20 * (n - 1)) / n)
    assert d["utilization_under_50_share"] == pytest.approx((n - 1) / n)
    assert (d["memory_used_peak"], d["memory_total"]) == (2 * GIB, 8 * GIB)
    assert d["peak_allocated"] is None and d["peak_reserved"] is None
    assert d["hints"][0].startswith("low utilisation:") and d["hints"][1].startswith("bigger batch:")
    wait = doc["input_wait"]
    assert doc["no_gpu"] is None and wait["starved"] is False and wait["waiting"] == 0
    assert wait["samples"] >= 6 and wait["share"] == 0.0
    assert not list((workdir / "out").glob("*.tmp*"))

    # Under torchrun each rank writes its own file.
    env.update(RANK="3", LOCAL_RANK="1", WORLD_SIZE="4")
    r = run(venv, workdir, """
        _outofcuda._testing.summary_start([0], 10)
        need(lambda: samples()["util_samples"] >= 1, "1 sample", **SAMPLED)
    """, env)
    assert "outofcuda summary" not in r.stderr
    assert json.loads((workdir / "out" / "run.rank3.json").read_text())["rank"] == 3


def test_json_is_never_written_through_a_link(venv, workdir, stub_nvml):
    """The temporary file is made new, never opened through a name planted in
    the directory (planted here by the same user: enough to show that no link
    is followed), and a final name that is a link is replaced, not written
    through."""
    out = workdir / "out"
    out.mkdir()
    (workdir / "victim").write_text("kept\n")
    (workdir / "target").write_text("kept too\n")
    (out / "run.json").symlink_to(workdir / "target")
    env = gpus(stub_nvml, workdir, f"{GIB} {8 * GIB} 30 +", OUTOFCUDA_SUMMARY="out/run.json")
    run(venv, workdir, """
        _outofcuda._testing.summary_start([0], 10)
        # The name a predictable temporary file would have: <path>.tmp<pid>.
        os.symlink(os.path.abspath("victim"), f"out/run.json.tmp{os.getpid()}")
        need(lambda: samples()["util_samples"] >= 1, "1 sample", **SAMPLED)
    """, env)
    assert (workdir / "victim").read_text() == "kept\n"
    assert (workdir / "target").read_text() == "kept too\n"
    final = out / "run.json"
    assert not final.is_symlink() and json.loads(final.read_text())["version"] == 1
    # Only the file it made is gone from the directory; the planted link stays.
    (planted,) = [p for p in out.iterdir() if p != final]
    assert planted.is_symlink() and planted.readlink() == workdir / "victim"


def test_a_relative_json_path_is_resolved_when_cuda_starts(venv, workdir, stub_nvml, tmp_path):
    root = make_fake_torch(tmp_path / "fake", "2.14.1")
    (workdir / "later").mkdir()
    env = gpus(stub_nvml, workdir, f"{GIB} {8 * GIB} 30 +", OUTOFCUDA_SUMMARY="run.json",
               PYTHONPATH=str(root))
    run(venv, workdir, """
        import torch
        os.chdir("later")  # a launcher's step between `import torch` and CUDA's start
        torch.cuda._fake_cuda_init()
        os.chdir("/")
        need(lambda: samples()["util_samples"] >= 1, "1 sample", **SAMPLED)
    """, env)
    assert not (workdir / "run.json").exists()
    assert json.loads((workdir / "later" / "run.json").read_text())["devices"][0]["device"] == 0


def test_every_line_carries_the_rank_under_torchrun(venv, workdir, stub_nvml):
    env = gpus(stub_nvml, workdir, f"{GIB} {8 * GIB} 20 +", OUTOFCUDA_SUMMARY="1", RANK="5",
               LOCAL_RANK="1", WORLD_SIZE="8")
    r = run(venv, workdir, """
        _outofcuda._testing.summary_start([0], 10)
        need(lambda: samples()["util_samples"] >= 5, "5 samples", **SAMPLED)
        # What the Python layer prints (the OOM report) gets the same label.
        print(json.dumps(_outofcuda._labelled("a\\n\\nb\\n")))
    """, env)
    assert json.loads(r.stdout) == "[rank 5] a\n\n[rank 5] b\n"
    lines = r.stderr.strip().splitlines()
    assert lines[0].startswith("[rank 5] outofcuda summary: cuda:0 Stand-in GPU 0"), r.stderr
    assert len(lines) >= 6 and all(line.startswith("[rank 5] ") for line in lines), r.stderr
    assert any(line.startswith("[rank 5]   hint 1         low utilisation") for line in lines)


FAKE_CUDA_INIT = """
import torch
queued = [getattr(fn, "__name__", "") for fn, _stack in torch.cuda._queued_calls]
before = thread_names()
torch.cuda._fake_cuda_init()
need(lambda: samples(0)["util_samples"] >= 5 and samples(1)["ticks"] >= 1, "the sampler",
     **SAMPLED)
after = thread_names()
print(json.dumps([queued, before, after, _outofcuda._summary_stats()]))
"""


def test_cuda_initialisation_starts_the_sampler_and_exit_reads_torch_peaks(
        venv, workdir, stub_nvml, tmp_path):
    root = make_fake_torch(tmp_path / "fake", "2.14.1")
    env = gpus(stub_nvml, workdir, f"{GIB} {80 * GIB} 30 +", f"{GIB} {80 * GIB} 30 +",
               OUTOFCUDA_SUMMARY="1", PYTHONPATH=str(root))
    r = run(venv, workdir, FAKE_CUDA_INIT + textwrap.dedent("""
        # What a CUDA torch reports once initialised: 3 GiB of tensors in 6 GiB
        # reserved on cuda:0, nothing on cuda:1.
        torch.cuda.is_initialized = lambda: True
        torch.cuda.current_device = lambda: 0
        torch.cuda.max_memory_allocated = lambda d=None: 3 * 2**30 if d == 0 else 0
        torch.cuda.max_memory_reserved = lambda d=None: 6 * 2**30 if d == 0 else 0
        _outofcuda._oom_observer(0, 2**20, 2**30, 0)  # torch's observer saw one OOM
        pid = os.fork()
        if pid == 0:
            sys.exit(0)  # atexit runs in the child: it has no sampler and says nothing
        assert os.waitpid(pid, 0)[1] == 0
    """), env)
    queued, before, after, stats = json.loads(r.stdout)
    assert queued.count("outofcuda_at_cuda_init") == 1
    # The stack sampler runs from `import torch`; CUDA's start adds the devices.
    assert "oc-summary" in before and "oc-summary" in after
    # No LOCAL_RANK: every visible device is sampled.
    assert [d["device"] for d in stats["devices"]] == [0, 1] and stats["interval_ms"] == 200
    (b,) = blocks(r.stderr)  # cuda:1 held nothing: no block; the child printed none
    assert b[0].startswith("outofcuda summary: cuda:0 Stand-in GPU 0 (NVML 0), ")
    assert "  this process   peak allocated 3.00 GiB, peak reserved 6.00 GiB" in b
    assert "  events         1 CUDA OOM, 0 micro-batch splits" in b
    hints = [line[17:] for line in b if line.startswith("  hint ")]
    # Scores: under 50 % every time 2.0, 98.8 % memory unused 1.98, 50 % cached 2.0.
    assert [h.split(":")[0] for h in hints] == ["low utilisation", "fragmentation", "bigger batch"]
    assert ("fragmentation: torch reserved 6.00 GiB at peak for 3.00 GiB of tensors (50 % cached "
            "but unused); expandable_segments is on") in hints[1]


def test_local_rank_picks_the_one_device_sampled(venv, workdir, stub_nvml, tmp_path):
    root = make_fake_torch(tmp_path / "fake", "2.14.1")
    env = gpus(stub_nvml, workdir, f"{GIB} {8 * GIB} 30 +", f"{GIB} {8 * GIB} 30 +",
               OUTOFCUDA_SUMMARY="1", PYTHONPATH=str(root), LOCAL_RANK="1", RANK="1")
    r = run(venv, workdir, """
        import torch
        torch.cuda._fake_cuda_init()
        need(lambda: samples(0)["util_samples"] >= 1, "the sampler", **SAMPLED)
        print(json.dumps(_outofcuda._summary_stats()))
    """, env)
    assert [d["device"] for d in json.loads(r.stdout)["devices"]] == [1]
    assert blocks(r.stderr)[0][0].startswith("[rank 1] outofcuda summary: cuda:1 Stand-in GPU 1")


@pytest.mark.parametrize("value", [None, "0", "off"])
def test_unset_or_off_queues_nothing_starts_nothing_prints_nothing(
        venv, workdir, stub_nvml, tmp_path, value):
    root = make_fake_torch(tmp_path / "fake", "2.14.1")
    env = gpus(stub_nvml, workdir, f"{GIB} {8 * GIB} 30 +", OUTOFCUDA_SUMMARY=value,
               PYTHONPATH=str(root))
    r = run(venv, workdir, """
        n = atexit._ncallbacks()
        import torch
        queued = [getattr(fn, "__name__", "") for fn, _stack in torch.cuda._queued_calls]
        torch.cuda._fake_cuda_init()
        print(json.dumps([queued, thread_names(), atexit._ncallbacks() - n,
                          _outofcuda._summary_stats()]))
    """, env)
    queued, names, new_callbacks, stats = json.loads(r.stdout)
    # outofcuda's one CUDA-init callback is there for its other steps.
    assert queued.count("outofcuda_at_cuda_init") == 1
    assert "oc-summary" not in names and not stats["running"] and stats["devices"] == []
    assert new_callbacks == 0
    assert r.stderr == ""


# ---- the input wait: the main thread's stack, sampled ----

LOOPS = """
import torch

class Slow(torch.utils.data.Dataset):
    # Each item takes 5 ms to make: a loop over it waits on its data.
    def __len__(self):
        return 10 ** 6

    def __getitem__(self, i):
        time.sleep(0.005)
        return torch.zeros(4)

def loop(loader, step_s, samples):
    # Iterates until the sampler has taken `samples` stack samples.
    while True:
        for batch in loader:
            if step_s:
                time.sleep(step_s)  # the step's own work, outside the loader
            if _outofcuda._summary_stats()["frames"]["samples"] >= samples:
                return
"""


def test_cpu_build_names_a_slow_loop_starved_and_a_fast_one_not(venv, workdir):
    # The real CPU torch: the summary starts at `import torch`; no GPU part.
    r = run(venv, workdir, LOOPS + textwrap.dedent("""
        _outofcuda._testing.summary_start([], 10)
        loop(torch.utils.data.DataLoader(Slow(), batch_size=4), 0, 40)
    """), {"OUTOFCUDA_SUMMARY": "run.json", "OUTOFCUDA_NUM_WORKERS": "3"})
    assert "outofcuda summary" not in r.stderr
    doc = json.loads((workdir / "run.json").read_text())
    wait = doc["input_wait"]
    assert doc["no_gpu"] == "torch is a CPU build" and doc["devices"] == []
    assert wait["starved"] is True and wait["share"] > 0.5 and wait["num_workers"] == 0
    cpus = len(os.sched_getaffinity(0))
    assert (wait["cpus"], wait["suggested_workers"]) == (cpus, min(3, cpus))
    assert wait["gpu_under_50_while_waiting_share"] == []
    assert doc["hints"][0].startswith("input pipeline: the main thread waited for the next batch")

    # A fast loader, a slow step: never blamed. Text form this time.
    r = run(venv, workdir, LOOPS + textwrap.dedent("""
        _outofcuda._testing.summary_start([], 10)
        # Alive at exit: without CUDA, a block comes from a process that was
        # seen waiting on its data or still holds a DataLoader.
        loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.zeros(64, 4)),
                                             batch_size=4)
        loop(loader, 0.01, 40)
        print(json.dumps(_outofcuda._summary_stats()["frames"]))
    """), {"OUTOFCUDA_SUMMARY": "1"})
    frames = json.loads(r.stdout)
    assert frames["samples"] >= 40 and frames["waiting"] < 0.1 * frames["samples"], frames
    (b,) = blocks(r.stderr)
    assert b[0].startswith("outofcuda summary: no GPU part (torch is a CPU build)"), b
    assert not any(line.startswith("  hint") for line in b), b


def test_stand_in_gpu_pairs_the_wait_with_utilisation(venv, workdir, stub_nvml):
    env = gpus(stub_nvml, workdir, f"{GIB} {8 * GIB} 20 +", OUTOFCUDA_SUMMARY="run.json")
    run(venv, workdir, LOOPS + textwrap.dedent("""
        _outofcuda._testing.summary_start([0], 10)
        loop(torch.utils.data.DataLoader(Slow(), batch_size=4), 0, 40)
    """), env)
    doc = json.loads((workdir / "run.json").read_text())
    wait, (d,) = doc["input_wait"], doc["devices"]
    assert doc["no_gpu"] is None and wait["starved"] is True and wait["num_workers"] == 0
    # The GPU served 20 % at every sample: under 50 % whenever the main thread waited.
    (paired,) = wait["gpu_under_50_while_waiting_share"]
    assert paired == pytest.approx(wait["share"], abs=0.1) and paired > 0.5
    assert d["hints"][0].startswith("input pipeline: the GPU was under 50 % busy in ")


def test_a_spawned_worker_says_nothing_and_a_bare_import_prints_nothing(venv, workdir):
    # A worker started by spawn imports torch (the sampler starts) and runs
    # torch's _worker_loop: it stops at its first sample and prints no block.
    # A worker finds the dataset's class by module: Slow from a file.
    (workdir / "slowdata.py").write_text("import time\n" + LOOPS)
    r = run(venv, workdir, LOOPS + textwrap.dedent("""
        from slowdata import Slow
        _outofcuda._testing.summary_start([], 10)
        loader = torch.utils.data.DataLoader(Slow(), batch_size=4, num_workers=1,
                                             multiprocessing_context="spawn")
        loop(loader, 0, 30)
        print(json.dumps(_outofcuda._summary_stats()["frames"]))
    """), {"OUTOFCUDA_SUMMARY": "1"}, timeout=180)
    frames = json.loads(r.stdout)
    assert frames["workers"] == 1 and frames["waiting"] > 0.5 * frames["samples"], frames
    (b,) = blocks(r.stderr)
    assert any("this DataLoader has num_workers=1:" in line for line in b), b


def test_a_cpu_build_that_only_imports_torch_says_why_in_one_line(venv, workdir):
    """No CUDA and no data loop: one line says why there is nothing to
    report (not silence), in either output mode, and no JSON is written."""
    lines = {}
    for value in ("1", "run.json", None):
        r = run(venv, workdir, "import torch", {"OUTOFCUDA_SUMMARY": value})
        lines[value] = [ln for ln in r.stderr.splitlines() if "outofcuda summary" in ln]
    why = "outofcuda summary: nothing to report: torch is a CPU build"
    assert lines == {"1": [why], "run.json": [why + " (no JSON written)"], None: []}
    assert not (workdir / "run.json").exists()


def test_bad_values_warn_once_and_leave_the_summary_off(venv, workdir, stub_nvml, tmp_path):
    cases = ["1", "yes", " OFF ", "  /tmp/run.json ", "", "maybe", "2", "out.txt", ".json",
             "dir/.json", "run\x01.json", "/" + "x" * 1100 + ".json"]
    r = venv.check(
        "import json, _outofcuda\n"
        f"cases = {cases!r}\n"
        "print(json.dumps([_outofcuda._parse_config({'OUTOFCUDA_SUMMARY': c}) for c in cases]))")
    got = json.loads(r.stdout)
    # An empty value means unset, as for every OUTOFCUDA_* variable.
    assert [g["summary"] for g in got[:5]] == ["stderr", "stderr", "off", "/tmp/run.json", "off"]
    assert all(g["warnings"] == [] for g in got[:5])
    for value, g in zip(cases[5:], got[5:]):
        assert g["summary"] == "off", value
        (w,) = g["warnings"]
        assert w.startswith("outofcuda: ignoring OUTOFCUDA_SUMMARY=") and ".json" in w, w

    # End to end: a word it does not know, and a directory that does not exist.
    root = make_fake_torch(tmp_path / "fake", "2.14.1")
    for value, says in [("maybe", "expected 1/0"), ("no/such/dir/run.json", "does not exist")]:
        env = gpus(stub_nvml, workdir, f"{GIB} {8 * GIB} 30 +", OUTOFCUDA_SUMMARY=value,
                   PYTHONPATH=str(root))
        r = run(venv, workdir, """
            import torch
            torch.cuda._fake_cuda_init()
            print(json.dumps([thread_names(), _outofcuda._summary_stats()["running"]]))
        """, env)
        names, running = json.loads(r.stdout)
        assert "oc-summary" not in names and not running
        assert r.stderr.count("OUTOFCUDA_SUMMARY") == 1 and says in r.stderr, r.stderr
        assert "outofcuda summary" not in r.stderr


def test_a_driver_call_that_never_returns_does_not_hang_the_exit(venv, workdir, stub_nvml):
    # Two samples, then the third utilisation call blocks for ever: the join
    # at exit gives up after its bound and the block still comes out.
    env = gpus(stub_nvml, workdir, f"{GIB} {8 * GIB} 40 60 hang")
    r = run(venv, workdir, """
        _outofcuda._testing.summary_start([0], 10)
        need(lambda: os.path.exists(os.environ["STUB_NVML_CONFIG"] + ".hanging"), "the stuck call",
             **SAMPLED)
    """, env, timeout=60)
    (b,) = blocks(r.stderr)
    assert "  utilisation    mean 50.0 %; under 50 % in 50.0 % of 2 samples (every 10 ms" in b[1]


def test_a_ctrl_c_while_the_exit_waits_on_a_stuck_driver_call_skips_the_summary(
        venv, workdir, stub_nvml):
    """The wait for the sampler at exit handles signals between short slices:
    a Ctrl-C ends it at the next slice, the summary is skipped, and the
    KeyboardInterrupt comes out of the atexit callback, which Python reports
    without changing the exit status (as for any atexit callback)."""
    env = gpus(stub_nvml, workdir, f"{GIB} {8 * GIB} 40 hang", OUTOFCUDA_SUMMARY="run.json")
    r = run(venv, workdir, """
        import ctypes
        guard(60)
        _outofcuda._testing.summary_start([0], 10)
        need(lambda: os.path.exists(os.environ["STUB_NVML_CONFIG"] + ".hanging"), "the stuck call",
             **SAMPLED)
        # Callbacks run last registered first: the time is noted, then libc's
        # kill() sends the Ctrl-C (called through ctypes, no Python code runs
        # after it, so no handler runs before the summary's callback) and the
        # summary's callback is next, its sampler stuck in the driver.
        def note_time():
            with open("sent", "w") as f:
                f.write(repr(time.monotonic()))

        atexit.register(ctypes.CDLL(None).kill, os.getpid(), signal.SIGINT)
        atexit.register(note_time)
    """, env, timeout=60)
    ended = time.monotonic()
    assert "outofcuda summary" not in r.stderr and not (workdir / "run.json").exists(), r.stderr
    assert not list(workdir.glob("run.json.tmp*"))
    last = r.stderr.splitlines()[-1]
    assert "outofcuda_summary_at_exit" in r.stderr and last.startswith("KeyboardInterrupt"), r.stderr
    # One 50 ms slice, not the join's whole 5 s bound (a wide margin: busy machine).
    assert ended - float((workdir / "sent").read_text()) < 3.0


def test_without_nvml_the_block_says_why(venv, workdir):
    r = run(venv, workdir, """
        _outofcuda._testing.summary_start([0], 10)
        print(json.dumps(_outofcuda._summary_stats()))
    """, {"LD_LIBRARY_PATH": str(workdir)})
    stats = json.loads(r.stdout)
    # The thread samples the main thread's stack only.
    assert stats["devices"][0]["ticks"] == 0 and "NVIDIA driver library not found" in stats["why"]
    (b,) = blocks(r.stderr)
    assert b[1].startswith("  utilisation    not sampled: NVIDIA driver library not found")


def test_test_only_start_checks_its_arguments(venv):
    r = venv.check("""
import _outofcuda
out = []
for args in [("0",), ([0], 5), ([0], 70000), ([-1],), (["a"],), (list(range(17)),)]:
    try:
        _outofcuda._testing.summary_start(*args)
        out.append(None)
    except (TypeError, ValueError) as e:
        out.append(type(e).__name__)
print(out)
""")
    assert r.stdout.strip() == str(["TypeError", "ValueError", "ValueError", "ValueError",
                                    "TypeError", "TypeError"])
