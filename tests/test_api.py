"""The power-user API on real torch (CPU): autocast, compile_model,
smart_dataloader, memory_report, clear_cache, CudaOptimizer. Each scenario
runs in a fresh interpreter from the built wheel."""
import json
import re
import shutil

import pytest

from kit import last_json


def test_import_is_cheap_and_memory_report_never_initialises_cuda(venv, workdir):
    r = venv.check("""
        import json, sys
        import outofcuda
        from outofcuda import memory_report, clear_cache
        before = "torch" in sys.modules
        rep = memory_report()
        released = clear_cache()
        after_api = "torch" in sys.modules
        import torch
        rep2 = outofcuda.memory_report()
        print(json.dumps([before, after_api, rep, rep2, released,
                          torch.cuda.is_initialized(), torch.cuda.memory_stats()]))
    """, cwd=workdir)
    torch_before, torch_after_api, rep, rep2, released, initialised, stats = last_json(r)
    assert torch_before is False and torch_after_api is False
    assert rep == {} and rep2 == {}
    assert released == 0
    assert initialised is False and stats == {}


def test_autocast_context_uses_bfloat16_on_cpu(venv, workdir):
    r = venv.check("""
        import json, torch, outofcuda
        lin = torch.nn.Linear(8, 8)
        x = torch.randn(4, 8)
        with outofcuda.autocast_context() as ctx:
            default = lin(x).dtype
        with outofcuda.autocast_context("cpu", dtype="fp16"):
            explicit = lin(x).dtype
        with outofcuda.autocast_context("cpu", enabled=False):
            off = lin(x).dtype
        errors = []
        for kw in ({"device_type": 3}, {"dtype": "int7"}, {"enabled": "yes"}):
            try:
                outofcuda.autocast_context(**kw)
            except TypeError as e:
                errors.append(str(e))
        print(json.dumps([str(default), str(explicit), str(off), type(ctx).__name__, errors]))
    """, cwd=workdir)
    default, explicit, off, ctx, errors = last_json(r)
    assert default == "torch.bfloat16"
    assert explicit == "torch.float16"
    assert off == "torch.float32"
    assert ctx == "autocast"
    assert len(errors) == 3
    assert "device_type" in errors[0] and "dtype" in errors[1] and "enabled" in errors[2]


def test_autocast_dtype_follows_environment(venv, workdir):
    r = venv.check("""
        import torch, outofcuda
        with outofcuda.autocast_context():
            print(torch.nn.Linear(4, 4)(torch.randn(2, 4)).dtype)
    """, cwd=workdir, env={"OUTOFCUDA_AMP_DTYPE": "float16"})
    assert r.stdout.strip() == "torch.float16"


MODELS = """
    import json, torch, warnings, outofcuda
    torch.manual_seed(0)
    cl, cl3 = torch.channels_last, torch.channels_last_3d
    def check(model, x):
        ref = model(x)
        out_model = outofcuda.compile_model(model)
        out = out_model(x)
        return out_model, bool(torch.allclose(out, ref, atol=1e-6))
    conv = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU(), torch.nn.Conv2d(8, 4, 1))
    conv, eq2 = check(conv, torch.randn(2, 3, 12, 12))
    c3 = torch.nn.Sequential(torch.nn.Conv3d(2, 4, 3), torch.nn.ReLU())
    c3, eq3 = check(c3, torch.randn(1, 2, 6, 6, 6))
    class Mixed(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Conv2d(2, 2, 1)
            self.b = torch.nn.Conv3d(2, 2, 1)
        def forward(self, x):
            return self.b(self.a(x[:, :, 0]).unsqueeze(2).expand_as(x))
    mixed, eqm = check(Mixed(), torch.randn(1, 2, 3, 4, 4))
    try:
        outofcuda.compile_model("not a model")
        err = None
    except TypeError as e:
        err = str(e)
    print(json.dumps({
        "conv": conv[0].weight.is_contiguous(memory_format=cl), "eq2": eq2,
        "c3": c3[0].weight.is_contiguous(memory_format=cl3), "eq3": eq3,
        "mixed": [mixed.a.weight.is_contiguous(memory_format=cl),
                  mixed.b.weight.is_contiguous(memory_format=cl3)], "eqm": eqm,
        "err": err}))
"""


def test_compile_model_channels_last_and_conv3d(venv, workdir):
    res = last_json(venv.check(MODELS, cwd=workdir))
    assert res["conv"] is True and res["eq2"] is True
    assert res["c3"] is True and res["eq3"] is True
    assert res["mixed"] == [True, True] and res["eqm"] is True
    assert "torch.nn.Module" in res["err"]


def test_compile_model_respects_channels_last_off(venv, workdir):
    res = last_json(venv.check(MODELS, cwd=workdir, env={"OUTOFCUDA_CHANNELS_LAST": "0"}))
    # A 3x3 conv weight in the default layout is not channels-last contiguous.
    assert res["conv"] is False and res["eq2"] is True
    assert res["c3"] is False and res["eq3"] is True


@pytest.mark.skipif(shutil.which("g++") is None, reason="inductor's CPU backend needs g++")
def test_compile_model_really_compiles_with_outofcuda_compile(venv, workdir):
    r = venv.check("""
        import json, torch, outofcuda
        from torch._dynamo.utils import counters
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU())
        x = torch.randn(4, 8)
        ref = model(x)
        compiled = outofcuda.compile_model(model)
        out = compiled(x)
        print(json.dumps([type(compiled).__name__, counters["frames"]["ok"],
                          counters["stats"]["unique_graphs"], bool(torch.equal(out, ref)),
                          float((out - ref).abs().max())]))
    """, cwd=workdir, timeout=600,
        env={"OUTOFCUDA_COMPILE": "1", "OUTOFCUDA_COMPILE_MODE": "default",
             "TORCHINDUCTOR_CACHE_DIR": str(workdir / "inductor"),
             # inductor keeps more than its cache under gettempdir()/torchinductor_<user>
             "TMPDIR": str(workdir)})
    name, frames_ok, graphs, equal, diff = last_json(r)
    assert name == "OptimizedModule"
    assert frames_ok >= 1 and graphs >= 1
    assert diff <= 1e-6, (equal, diff)
    assert any((workdir / "inductor").rglob("*.so")), "inductor built no kernel"


def test_compile_model_warns_once_and_runs_when_compiling_is_impossible(venv, workdir):
    # No compiler on PATH: inductor could not build its CPU kernels.
    empty = workdir / "bin"
    empty.mkdir()
    r = venv.check("""
        import json, torch, warnings, outofcuda
        model = torch.nn.Linear(4, 2)
        x = torch.randn(3, 4)
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            out = outofcuda.compile_model(model)
        print(json.dumps([type(out).__name__, [str(i.message) for i in w],
                          bool(torch.equal(out(x), model(x)))]))
    """, cwd=workdir, env={"OUTOFCUDA_COMPILE": "1", "PATH": str(empty), "CXX": None})
    name, messages, equal = last_json(r)
    assert name == "Linear" and equal is True
    assert len(messages) == 1
    assert "OUTOFCUDA_COMPILE=1" in messages[0] and "C++ compiler" in messages[0]


def test_smart_dataloader_iterates_with_0_and_2_workers_and_caller_wins(venv, workdir):
    r = venv.check("""
        import json, torch, outofcuda
        ds = torch.utils.data.TensorDataset(torch.arange(20.0))
        def run(**kw):
            dl = outofcuda.smart_dataloader(ds, batch_size=5, **kw)
            got = sorted(v for b in dl for v in b[0].tolist())
            return {"workers": dl.num_workers, "prefetch": dl.prefetch_factor,
                    "persistent": dl.persistent_workers, "pin": dl.pin_memory,
                    "ok": got == [float(i) for i in range(20)], "batch": dl.batch_size}
        res = {"default": run(), "zero": run(num_workers=0), "two": run(num_workers=2),
               "override": run(num_workers=1, prefetch_factor=5, persistent_workers=False,
                               pin_memory=False)}
        errs = []
        for bad in ({"num_workers": -1}, {"num_workers": 1.5}, {"num_workers": 10**30}):
            try:
                outofcuda.smart_dataloader(ds, **bad)
            except ValueError as e:
                errs.append(str(e))
        try:
            outofcuda.smart_dataloader(None)
        except TypeError as e:
            errs.append(str(e))
        res["errs"] = errs
        print(json.dumps(res))
    """, cwd=workdir, env={"OUTOFCUDA_NUM_WORKERS": "64", "OUTOFCUDA_PREFETCH_FACTOR": "3"})
    res = last_json(r)
    import os
    cpus = len(os.sched_getaffinity(0))
    assert res["default"] == {"workers": min(64, cpus), "prefetch": 3, "persistent": True,
                              "pin": False, "ok": True, "batch": 5}
    assert res["zero"] == {"workers": 0, "prefetch": None, "persistent": False, "pin": False,
                           "ok": True, "batch": 5}
    assert res["two"]["workers"] == 2 and res["two"]["prefetch"] == 3 and res["two"]["ok"]
    assert res["override"] == {"workers": 1, "prefetch": 5, "persistent": False, "pin": False,
                               "ok": True, "batch": 5}
    assert len(res["errs"]) == 4 and "num_workers" in res["errs"][0]
    # past what the engine takes as a C long: the same clear ValueError, no OverflowError
    assert "num_workers must be a whole number from 0 to 2147483647" in res["errs"][2]
    # torch's "suggested max number of worker" warning must not appear.
    assert "suggested max" not in r.stderr


@pytest.mark.skipif(shutil.which("taskset") is None, reason="needs taskset")
def test_worker_count_is_capped_by_cpu_affinity(venv, workdir):
    code = ("import _outofcuda, json; "
            "print(json.dumps(_outofcuda._api_loader_plan(False)))")
    r = venv.run(None, args=("-c", code), cwd=workdir)
    assert r.returncode == 0, r.stderr
    import subprocess
    from conftest import _clean_env
    one = subprocess.run(["taskset", "-c", "0", str(venv.python), "-c", code],
                         capture_output=True, text=True, env=_clean_env(), cwd=workdir)
    assert one.returncode == 0, one.stderr
    plan = json.loads(one.stdout)
    assert plan["cpus"] == 1 and plan["num_workers"] == 1
    assert plan["persistent_workers"] is True and plan["pin_memory"] is False


def test_small_shared_memory_warns_once(venv, workdir):
    r = venv.check("""
        import json, _outofcuda
        big = 1 << 50   # more than any /dev/shm: "too small"
        first = _outofcuda._api_loader_plan(False, 2, "/dev/shm", big)["shm_warning"]
        second = _outofcuda._api_loader_plan(False, 2, "/dev/shm", big)["shm_warning"]
        print(json.dumps([first, second]))
    """, cwd=workdir)
    first, second = last_json(r)
    assert "/dev/shm holds only" in first and "--shm-size" in first
    assert second == ""
    r = venv.check("""
        import json, _outofcuda
        none = _outofcuda._api_loader_plan(False, 0, "/dev/shm", 1 << 50)["shm_warning"]
        missing = _outofcuda._api_loader_plan(False, 2, "/no/such/shm")["shm_warning"]
        print(json.dumps([none, missing]))
    """, cwd=workdir)
    none, missing = last_json(r)
    assert none == ""        # no workers, no shared memory needed
    assert "/no/such/shm is missing" in missing


def test_cuda_optimizer_delegates(venv, workdir):
    r = venv.check("""
        import json, torch, outofcuda
        opt = outofcuda.CudaOptimizer()
        model = opt.prepare(torch.nn.Conv2d(3, 4, 3))
        loader = opt.dataloader(torch.utils.data.TensorDataset(torch.randn(4, 3, 8, 8)),
                                batch_size=2, num_workers=0)
        with opt.autocast():
            y = model(next(iter(loader))[0])
        print(json.dumps([model.weight.is_contiguous(memory_format=torch.channels_last),
                          str(y.dtype), opt.clear(), opt.report(), repr(opt)]))
    """, cwd=workdir)
    assert last_json(r) == [True, "torch.bfloat16", 0, {}, "CudaOptimizer()"]


def test_type_stubs_ship_and_cover_the_public_api(venv, workdir):
    r = venv.check("""
        import ast, json, pathlib, outofcuda
        pkg = pathlib.Path(outofcuda.__file__).parent
        tree = ast.parse((pkg / "__init__.pyi").read_text())
        names = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
        print(json.dumps([sorted(set(outofcuda.__all__) - names), (pkg / "py.typed").exists()]))
    """, cwd=workdir)
    assert last_json(r) == [[], True]


def test_compile_model_arguments_override_the_environment(venv, workdir):
    # torch.compile is wrapped to record what it was asked for; the real one
    # still runs (lazily: nothing is compiled until the model is called).
    r = venv.check("""
        import json, torch, warnings, outofcuda
        asked = []
        real_compile = torch.compile
        def recording(model, **kw):
            asked.append(kw)
            return real_compile(model, **kw)
        torch.compile = recording
        cl = torch.channels_last
        def conv():
            return torch.nn.Conv2d(3, 8, 3)
        res = {
            "env": outofcuda.compile_model(conv()).weight.is_contiguous(memory_format=cl),
            "off": outofcuda.compile_model(conv(), channels_last=False)
                   .weight.is_contiguous(memory_format=cl),
            "on": outofcuda.compile_model(conv(), channels_last=True)
                  .weight.is_contiguous(memory_format=cl),
        }
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            plain = outofcuda.compile_model(torch.nn.Linear(4, 2))
            res["not_compiled"] = type(plain).__name__
            res["opt_prepare"] = type(outofcuda.CudaOptimizer().prepare(
                torch.nn.Linear(4, 2), compile=False)).__name__
            compiled = outofcuda.compile_model(torch.nn.Linear(4, 2), compile=True,
                                               mode="Default", fullgraph=False)
            res["compiled"] = type(compiled).__name__
            compiled = outofcuda.compile_model(torch.nn.Linear(4, 2), compile=True)
        # torch.compile's first call imports dynamo, which warns about torch.jit.
        res["warnings"] = [str(i.message) for i in w if "outofcuda" in str(i.message)]
        res["asked"] = asked
        errors = []
        for kw in ({"channels_last": "yes"}, {"channels_last": 1}, {"compile": "1"},
                   {"fullgraph": 0}, {"mode": "fast"}, {"mode": 3}):
            try:
                outofcuda.compile_model(torch.nn.Linear(4, 2), **kw)
                errors.append(None)
            except (TypeError, ValueError) as e:
                errors.append([type(e).__name__, str(e)])
        res["errors"] = errors
        print(json.dumps(res))
    """, cwd=workdir, env={"OUTOFCUDA_CHANNELS_LAST": "0", "OUTOFCUDA_COMPILE": "0",
                           "OUTOFCUDA_COMPILE_MODE": "max-autotune-no-cudagraphs",
                           "OUTOFCUDA_COMPILE_FULLGRAPH": "1"})
    res = last_json(r)
    assert res["env"] is False and res["off"] is False and res["on"] is True
    assert res["not_compiled"] == "Linear" and res["opt_prepare"] == "Linear"
    assert res["compiled"] == "OptimizedModule"
    # mode and fullgraph given win; those not given come from the environment.
    assert res["asked"] == [{"mode": "default", "fullgraph": False},
                            {"mode": "max-autotune-no-cudagraphs", "fullgraph": True}]
    assert res["warnings"] == []
    kinds = [e[0] for e in res["errors"]]
    assert kinds == ["TypeError", "TypeError", "TypeError", "TypeError", "ValueError",
                     "ValueError"]
    assert "channels_last must be True, False or None" in res["errors"][0][1]
    assert "OUTOFCUDA_COMPILE_FULLGRAPH" in res["errors"][3][1]
    assert "reduce-overhead" in res["errors"][4][1] and "'fast'" in res["errors"][4][1]


def test_compile_model_compile_true_names_the_argument_when_it_cannot_compile(venv, workdir):
    empty = workdir / "bin"
    empty.mkdir()
    r = venv.check("""
        import json, torch, warnings, outofcuda
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            out = outofcuda.compile_model(torch.nn.Linear(4, 2), compile=True)
        print(json.dumps([type(out).__name__, [str(i.message) for i in w]]))
    """, cwd=workdir, env={"PATH": str(empty), "CXX": None})
    name, messages = last_json(r)
    assert name == "Linear" and len(messages) == 1
    assert "compile=True" in messages[0] and "C++ compiler" in messages[0]


def test_public_names_in_the_stubs_exist(venv, workdir):
    """Every public name outofcuda/__init__.pyi declares is an attribute of the
    package at run time."""
    r = venv.check("""
        import ast, json, pathlib, outofcuda
        tree = ast.parse((pathlib.Path(outofcuda.__file__).parent / "__init__.pyi").read_text())
        names = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
        print(json.dumps(sorted(n for n in names if not n.startswith("_")
                                and not hasattr(outofcuda, n))))
    """, cwd=workdir)
    assert last_json(r) == []


def test_engine_stub_ships_and_names_every_function(venv, workdir):
    r = venv.check("""
        import ast, json, sysconfig, pathlib, _outofcuda
        stub = pathlib.Path(sysconfig.get_paths()["purelib"]) / "_outofcuda.pyi"
        declared = {n.name for n in ast.parse(stub.read_text()).body
                    if isinstance(n, ast.FunctionDef)}
        real = {n for n in dir(_outofcuda)
                if type(getattr(_outofcuda, n)).__name__ == "builtin_function_or_method"}
        print(json.dumps([sorted(real - declared), sorted(declared - real)]))
    """, cwd=workdir)
    assert last_json(r) == [[], []]


def _engine(name, parsed_as=None, first=()):
    """An engine function: its name, the name its argument parser's messages
    use (the format's, where it has one), the arguments it requires first."""
    return name, parsed_as or name, list(first)


# For each calling convention: a built-in of it with the arguments it
# requires first (from a module of its own: CPython names it module.name, as
# it names the engine's functions, where len() would be named bare), the
# engine's functions of that convention, and bad calls (args, kwargs) made
# after the required arguments.
CONVENTIONS = {
    "METH_NOARGS": (("time.time", []),
                    [_engine(n) for n in ("install", "config", "status", "_platform",
                                          "nvml_devices", "_summary_stats")],
                    [([1], {}), ([], {"x": 1}), ([1, 2], {"x": 1})]),
    "METH_O": (("math.sqrt", []),
               [_engine(n) for n in ("nvml_index", "_alloc_items", "_oom_format", "_monitor_stop",
                                     "_parse_config")],
               [([], {}), ([1, 2], {}), ([1], {"x": 1}), ([], {"x": 1})]),
    "METH_VARARGS": (("time.strftime", []),
                     [_engine(n) for n in ("_alloc_var", "_labelled", "_known_bugs_check",
                                           "_monitor_stop_all", "_grad_set_aside")],
                     [([], {"x": 1}), ([1], {"x": 1})]),
    "METH_VARARGS | METH_KEYWORDS": (("_socket.getaddrinfo", [None, None]),
                                     [_engine("_merge_alloc_conf", first=["", ""]),
                                      _engine("_find_torch_spec", "find_spec", [None, "x"])],
                                     [([], {"bogus": 1})]),
}
BAD_CALLS = """
import importlib, json, _outofcuda

def message(fn, args, kw):
    try:
        fn(*args, **kw)
    except TypeError as e:
        return str(e)

out = []
for conv, ((ref_name, ref_first), functions, calls) in %r.items():
    module, name = ref_name.rsplit(".", 1)
    ref = getattr(importlib.import_module(module), name)
    for fn_name, parsed_as, first in functions:
        fn = getattr(_outofcuda, fn_name)
        for args, kw in calls:
            out.append({"conv": conv, "ref": ref_name, "as": parsed_as, "module": fn.__module__,
                        "call": [fn_name, args, kw], "builtin": message(ref, ref_first + args, kw),
                        "engine": message(fn, first + args, kw)})
print(json.dumps(out))
"""


def as_if_named(text, ref, name, module):
    """A built-in's message with its name replaced by `name` as CPython
    writes it: module.name where it wrote the built-in's module, else bare."""
    ref_module, ref_name = ref.rsplit(".", 1)
    return re.sub(rf"\b({re.escape(ref_module)}\.)?{re.escape(ref_name)}\b",
                  lambda m: (module + "." if m.group(1) else "") + name, text)


def test_bad_arguments_get_cpythons_own_messages(venv, workdir):
    """A call with bad arguments fails with the TypeError a built-in of the
    same calling convention gives on the same interpreter: each table entry
    carries its function's own convention (src/oc_edge.h), so CPython
    checks the arguments itself and the engine re-implements nothing."""
    seen = last_json(venv.check(BAD_CALLS % (CONVENTIONS,), cwd=workdir))
    assert len(seen) == sum(len(f) * len(c) for _, f, c in CONVENTIONS.values())
    for c in seen:
        assert c["builtin"] is not None and c["engine"] is not None, c
        assert c["engine"] == as_if_named(c["builtin"], c["ref"], c["as"], c["module"]), c


WARNED = """
import warnings, outofcuda
warnings.simplefilter("always")
with warnings.catch_warnings(record=True) as seen:
    {how}
print(seen[0].filename, seen[0].lineno)
"""


@pytest.mark.parametrize("how", ["with outofcuda.MemoryMonitor():\n        pass",
                                 "outofcuda.MemoryMonitor().start().stop()"])
def test_memory_monitor_warning_names_the_users_line(venv, workdir, how):
    """No GPU here: MemoryMonitor's one warning points at the user's line."""
    script = workdir / "train.py"
    script.write_text(WARNED.format(how=how))
    r = venv.check(None, args=[str(script)], cwd=workdir)
    assert r.stdout.split() == [str(script), "5"], r.stdout


DOCTESTS = """
import doctest, importlib, json, pkgutil, re, outofcuda
# importing __main__ runs the command line; microbatch last: its examples
# record OOMs, and last_oom()'s example shows a process that had none
names = ["outofcuda", "_outofcuda", "outofcuda_hook"] + sorted(
    (f"outofcuda.{m.name}" for m in pkgutil.iter_modules(outofcuda.__path__)
     if m.name != "__main__"), key=lambda n: (n == "outofcuda.microbatch", n))
main_src = open(outofcuda.__path__[0] + "/__main__.py").read()
finder = doctest.DocTestFinder()
runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
report = []
ran, skipped = 0, []
for name in names:
    for test in finder.find(importlib.import_module(name), name):
        for ex in test.examples:
            if ex.options.get(doctest.SKIP):
                skipped.append([test.name, ex.source])
            else:
                ran += 1
        runner.run(test, out=report.append)
print(json.dumps({"modules": names, "ran": ran, "skipped": skipped,
                  "failed": runner.failures, "report": "".join(report),
                  "main_examples": ">>>" in main_src}))
"""


def test_every_docstring_example_runs_or_says_why_not(venv, workdir):
    """Every docstring example of the installed package (the Python modules and
    both extensions) runs as a doctest in a fresh interpreter beside the hook;
    one that cannot run here is skipped with a comment saying why."""
    res = venv.json(DOCTESTS, cwd=workdir)
    assert {"outofcuda.api", "outofcuda.microbatch", "outofcuda.monitor", "outofcuda.oom",
            "outofcuda.cli"} <= set(res["modules"]), res["modules"]
    assert res["failed"] == 0, res["report"]
    assert res["ran"] >= 30 and not res["main_examples"], res
    for name, source in res["skipped"]:
        # a reason: a comment of its own before the directive
        assert re.search(r"#\s*\S[^#]*#\s*doctest:\s*\+SKIP", source), (name, source)
