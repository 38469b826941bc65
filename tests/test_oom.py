"""Out of memory on CPU with real torch: auto_microbatch, find_batch_size, the
report and the uncaught-exception hook.

OOMs are provoked by a test-only memory budget (BUDGET below, never in the
product) that raises the real ``torch.cuda.OutOfMemoryError`` when a forward
pass sees more samples than it allows. The exception hooks are checked on the
real CPU build (Python's own, output byte-identical to a run with
OUTOFCUDA_DISABLE=1) and on the stand-in CUDA build of tests/fake_torch.py,
whose torch.cuda._fake_cuda_init() runs the lazy-init queue as CUDA's
initialisation does. Each scenario runs in a fresh interpreter of the built
wheel's environment.

Not chosen: no hook at all and a report at exit from the observer and
sys.last_value (the report would follow the traceback, and an OOM in a thread
would go unreported with its cache kept). Observer figures go only into the
report of an OOM of the same GPU and request size within 30 s. Seen while
testing DDP on the CPU, not caused by outofcuda: with torch 2.13 a gloo process
sometimes aborts at exit ("terminate called without an active exception"),
also with OUTOFCUDA_DISABLE=1.
"""
import json
import textwrap

from kit import CHILD, last_json

BUDGET = CHILD + '''
import json, math, sys
import torch
import outofcuda

torch.manual_seed(0)
torch.use_deterministic_algorithms(True)


class Budget:
    """A forward pass that sees more than `limit` samples runs out of memory."""

    def __init__(self, limit):
        self.limit = limit
        self.forwards = []

    def check(self, n):
        self.forwards.append(n)
        if self.limit is not None and n > self.limit:
            raise torch.cuda.OutOfMemoryError(
                f"CUDA out of memory. Tried to allocate {n * 64}.00 MiB. GPU 0 has a total "
                "capacity of 79.10 GiB of which 12.00 MiB is free.")


def mlp3():
    return mlp(12, 32, 32, 3, acts=("Tanh", "GELU"))


def block():
    return torch.nn.TransformerEncoderLayer(d_model=12, nhead=3, dim_feedforward=24,
                                            dropout=0.0, batch_first=True)


def reference(model, loss_fn, batch):
    model.zero_grad(set_to_none=True)
    loss = loss_fn(batch)
    loss.backward()
    out = grads(model), loss.detach()
    model.zero_grad(set_to_none=True)
    return out
'''


def run(venv, workdir, body, **kw):
    return venv.json(BUDGET + textwrap.dedent(body), cwd=workdir, **kw)


def test_gradients_match_full_batch_for_every_split(venv, workdir):
    out = run(venv, workdir, """
    results = {}
    for name, make in (("mlp", mlp3), ("block", block)):
        model = make()
        x = torch.randn(16, 5, 12) if name == "block" else torch.randn(16, 12)
        t = torch.randn(16, 5, 12) if name == "block" else torch.randint(0, 3, (16,))
        budget = Budget(None)

        def loss_fn(batch):
            xb, tb = batch
            budget.check(xb.shape[0])
            y = model(xb)
            if name == "block":
                return torch.nn.functional.mse_loss(y, tb)
            return torch.nn.functional.cross_entropy(y, tb)

        ref_g, ref_loss = reference(model, loss_fn, (x, t))
        for limit, pieces in ((8, 2), (4, 4), (2, 8)):
            budget.limit = limit
            step = outofcuda.auto_microbatch(loss_fn)
            model.zero_grad(set_to_none=True)
            loss = step((x, t))
            assert step.pieces == pieces, (name, limit, step.pieces)
            assert not loss.requires_grad
            results[f"{name}/{pieces}"] = [rel_err(grads(model), ref_g),
                                           abs(loss.item() - ref_loss.item())]
            # The split is remembered: the next call does not try the full batch.
            budget.forwards.clear()
            model.zero_grad(set_to_none=True)
            step((x, t))
            assert max(budget.forwards) <= limit, budget.forwards

    # Uneven last micro-batch (10 samples, budget 4: pieces of 3, 3, 3, 1), a
    # gradient already accumulated at entry, and an optimiser the wrapper
    # must leave alone.
    model = mlp3()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    x, t = torch.randn(10, 12), torch.randint(0, 3, (10,))
    budget = Budget(None)

    def loss_fn(batch):
        budget.check(batch[0].shape[0])
        return torch.nn.functional.cross_entropy(model(batch[0]), batch[1])

    loss_fn((x, t)).backward()
    opt.step()
    ref_g, _ = reference(model, loss_fn, (x, t))
    g0 = [torch.randn_like(p) for p in model.parameters()]
    for p, g in zip(model.parameters(), g0):
        p.grad = g.clone()
    ids = [id(p.grad) for p in model.parameters()]
    before_params = [p.detach().clone() for p in model.parameters()]
    before_state = {k: {n: v.clone() for n, v in s.items()} for k, s in opt.state.items()}
    budget.limit = 4
    budget.forwards.clear()
    step = outofcuda.auto_microbatch(loss_fn)
    step((x, t))
    assert budget.forwards == [10, 5, 3, 3, 3, 1], budget.forwards
    assert [id(p.grad) for p in model.parameters()] == ids
    results["uneven+accumulated"] = [rel_err(grads(model), [g + r for g, r in zip(g0, ref_g)]),
                                     0.0]
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before_params))
    for k, s in opt.state.items():
        for n, v in s.items():
            assert torch.equal(v, before_state[k][n]), n

    # dict and tuple batches; values that are not tensors reach every piece.
    model = mlp3()
    x, t = torch.randn(12, 12), torch.randint(0, 3, (12,))
    seen = []

    def dict_fn(batch):
        budget.check(batch["x"].shape[0])
        seen.append(batch["tag"])
        return torch.nn.functional.cross_entropy(model(batch["x"]) * batch["scale"],
                                                 batch["y"])

    budget.limit = None
    ref_g, _ = reference(model, dict_fn, {"x": x, "y": t, "scale": 2.0, "tag": "d"})
    budget.limit = 5
    outofcuda.auto_microbatch(dict_fn)({"x": x, "y": t, "scale": 2.0, "tag": "d"})
    results["dict"] = [rel_err(grads(model), ref_g), 0.0]
    assert set(seen) == {"d"} and len(seen) > 3

    def tuple_fn(batch, weight):
        xs, (ys,), note = batch
        budget.check(xs.shape[0])
        assert note == "n"
        return weight * torch.nn.functional.cross_entropy(model(xs), ys)

    budget.limit = None
    model.zero_grad(set_to_none=True)
    tuple_fn((x, (t,), "n"), 3.0).backward()
    ref_g = grads(model)
    model.zero_grad(set_to_none=True)
    budget.limit = 3
    outofcuda.auto_microbatch(tuple_fn)((x, (t,), "n"), 3.0)
    results["tuple"] = [rel_err(grads(model), ref_g), 0.0]
    print(json.dumps(results))
    """)
    assert set(out) == {"mlp/2", "mlp/4", "mlp/8", "block/2", "block/4", "block/8",
                        "uneven+accumulated", "dict", "tuple"}
    for key, (grad_err, loss_err) in out.items():
        assert grad_err <= 1e-6, (key, grad_err)
        assert loss_err <= 1e-6, (key, loss_err)


def test_oom_in_backward_of_third_microbatch_and_gradscaler(venv, workdir):
    out = run(venv, workdir, """
    model = mlp3()
    x, t = torch.randn(16, 12), torch.randint(0, 3, (16,))
    budget = Budget(None)
    state = {"calls": 0, "raised": 0, "grads_when_raised": None}

    def loss_fn(batch):
        budget.check(batch[0].shape[0])
        state["calls"] += 1
        h = model[0](batch[0])
        if h.requires_grad:
            def hook(g, call=state["calls"]):
                # Third micro-batch of the 4-way split: the later layers'
                # gradients have already been accumulated when this fires.
                if budget.limit == 4 and call == 4 and not state["raised"]:
                    state["raised"] += 1
                    state["grads_when_raised"] = model[4].weight.grad is not None
                    raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate "
                                                      "2.00 MiB (in backward)")
                return g
            h.register_hook(hook)
        return torch.nn.functional.cross_entropy(model[1:](h), batch[1])

    ref_g, ref_loss = reference(model, loss_fn, (x, t))
    state["calls"] = 0
    budget.limit = 4
    step = outofcuda.auto_microbatch(loss_fn)
    loss = step((x, t))
    res = {"raised": state["raised"], "grads_when_raised": state["grads_when_raised"],
           "pieces": step.pieces, "err": rel_err(grads(model), ref_g),
           "loss_err": abs(loss.item() - ref_loss.item())}

    # GradScaler: the scaled loss is backpropagated.
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    budget.limit = 8
    model.zero_grad(set_to_none=True)
    scaled = outofcuda.auto_microbatch(loss_fn, scaler=scaler)
    loss = scaled((x, t))
    res["scaler_err"] = rel_err([g / 1024.0 for g in grads(model)], ref_g)
    res["scaler_pieces"] = scaled.pieces
    res["scaler_loss_err"] = abs(loss.item() - ref_loss.item())
    print(json.dumps(res))
    """)
    assert out["raised"] == 1 and out["grads_when_raised"] is True
    assert out["pieces"] == 8
    assert out["err"] <= 1e-6 and out["loss_err"] <= 1e-6
    assert out["scaler_pieces"] == 2
    assert out["scaler_err"] <= 1e-6 and out["scaler_loss_err"] <= 1e-6


def test_errors_pass_through_and_exhaustion_reraises_with_report(venv, workdir):
    out = run(venv, workdir, """
    assert outofcuda.last_oom() is None
    model = mlp3()
    x, t = torch.randn(8, 12), torch.randint(0, 3, (8,))
    res = {}

    # A non-OOM error (here in the backward of the second micro-batch of a
    # split) is the same object, raised once, with the gradients as at entry.
    boom = ValueError("boom")
    budget = Budget(4)
    def bad(batch):
        budget.check(batch[0].shape[0])
        h = model[0](batch[0])
        if len(budget.forwards) == 3:
            h.register_hook(lambda g: (_ for _ in ()).throw(boom))
        return torch.nn.functional.cross_entropy(model[1:](h), batch[1])
    try:
        outofcuda.auto_microbatch(bad)((x, t))
    except ValueError as e:
        res["same"] = e is boom
    res["calls"] = budget.forwards
    res["grads_none"] = all(p.grad is None for p in model.parameters())
    res["last_after_non_oom"] = outofcuda.last_oom()

    # min_size exhaustion: 8 -> 4 -> 2, then the original OOM with its report.
    budget = Budget(0)
    def loss_fn(batch):
        budget.check(batch[0].shape[0])
        return torch.nn.functional.cross_entropy(model(batch[0]), batch[1])
    try:
        outofcuda.auto_microbatch(loss_fn, min_size=2)((x, t))
    except torch.cuda.OutOfMemoryError as e:
        res["forwards"] = budget.forwards
        res["message"] = str(e)
        res["report"] = e.outofcuda_report
        res["same_as_last"] = e.outofcuda_report is outofcuda.last_oom()
        res["text"] = outofcuda.oom.format_report(e.outofcuda_report)

    # Bad arguments get clear messages.
    for call in (lambda: outofcuda.auto_microbatch(3),
                 lambda: outofcuda.auto_microbatch(loss_fn, min_size=0),
                 lambda: outofcuda.auto_microbatch(loss_fn, scaler=object()),
                 lambda: outofcuda.auto_microbatch(loss_fn)("not a batch"),
                 lambda: outofcuda.auto_microbatch(loss_fn)((x, t[:3]))):
        try:
            call()
        except (TypeError, ValueError) as e:
            res.setdefault("arg_errors", []).append(str(e))
    print(json.dumps(res))
    """)
    assert out["same"] is True and out["calls"] == [8, 4, 4] and out["grads_none"] is True
    # The split before the non-OOM error was itself an OOM, and is reported.
    assert out["last_after_non_oom"]["request_bytes"] == 8 * 64 * 1024 ** 2
    assert out["forwards"] == [8, 4, 2]
    assert out["message"].startswith("CUDA out of memory. Tried to allocate 128.00 MiB")
    rep = out["report"]
    assert out["same_as_last"] is True
    assert rep["request_bytes"] == 128 * 1024 ** 2 and rep["device"] == 0
    assert rep["source"] == "exception"
    # CPU: no CUDA context and no NVML, so these figures are documented as empty.
    for key in ("allocated_bytes", "reserved_bytes", "peak_allocated_bytes",
                "fragmentation_bytes", "total_bytes", "free_bytes"):
        assert rep[key] is None, key
    assert rep["other_processes"] == []
    assert any("CUDA is not initialised" in n for n in rep["notes"])
    assert any(n.startswith("NVML") for n in rep["notes"])
    assert rep["autocast"] is False
    assert rep["advice"][0].startswith("Even the smallest micro-batch does not fit")
    assert any("autocast" in a for a in rep["advice"])
    text = out["text"]
    assert text.startswith("outofcuda: CUDA out of memory on cuda:0\n")
    assert "  requested          128 MiB\n" in text
    assert "  this process       allocated unknown" in text
    assert "    1. Even the smallest micro-batch" in text
    errors = out["arg_errors"]
    assert len(errors) == 5
    assert "fn must be callable" in errors[0] and "min_size must be an int >= 1" in errors[1]
    assert "GradScaler" in errors[2] and "holds no tensor" in errors[3]
    assert "disagree on dimension 0 ([3, 8])" in errors[4]


def test_find_batch_size(venv, workdir):
    out = run(venv, workdir, """
    budget = Budget(37)
    res = {"halve": outofcuda.find_batch_size(budget.check, 128)}
    res["halve_calls"] = list(budget.forwards)
    budget.forwards.clear()
    res["grow"] = outofcuda.find_batch_size(budget.check, 128, grow=True)
    res["grow_calls"] = list(budget.forwards)
    res["fits"] = outofcuda.find_batch_size(budget.check, 20)

    def other(size):
        if size < 64:
            raise KeyError("not an OOM")
        budget.check(size)
    try:
        outofcuda.find_batch_size(other, 128)
    except KeyError as e:
        res["other"] = str(e)
    budget.limit = 0
    try:
        outofcuda.find_batch_size(budget.check, 16, min_size=4)
    except torch.cuda.OutOfMemoryError as e:
        res["exhausted"] = e.outofcuda_report["advice"][0]
    for bad in (dict(fn=1, start=8), dict(fn=budget.check, start=0),
                dict(fn=budget.check, start=8, min_size=16)):
        try:
            outofcuda.find_batch_size(**bad)
        except (TypeError, ValueError) as e:
            res.setdefault("arg_errors", []).append(str(e))
    print(json.dumps(res))
    """)
    assert out["halve"] == 32 and out["halve_calls"] == [128, 64, 32]
    assert out["grow"] == 37
    assert out["grow_calls"] == [128, 64, 32, 48, 40, 36, 38, 37]
    assert out["fits"] == 20
    assert out["other"] == "'not an OOM'"
    assert out["exhausted"].startswith("Even the smallest")
    assert len(out["arg_errors"]) == 3


def test_report_from_observer_and_ranked_advice(venv, workdir):
    """The observer's recording path (called here as torch would call it) and
    the C ranking of actions from GPU-like figures."""
    out = run(venv, workdir, """
    import _outofcuda as core
    gib = 1024 ** 3
    res = {"before": outofcuda.last_oom()}
    # What torch's allocator passes: device, request, limit-or-total, free.
    core._oom_observer(0, 2 * gib, 80 * gib, gib // 2)
    rep = outofcuda.last_oom()
    res["observer"] = {k: rep[k] for k in ("source", "device", "request_bytes", "free_bytes",
                                            "message")}
    res["same"] = outofcuda.last_oom() is rep
    res["frag"] = core._oom_advice(request=gib, total=80 * gib, allocated=40 * gib,
                                   reserved=60 * gib, inactive_split=5 * gib, expandable=False,
                                   autocast=True, others=[(4242, "python", 30 * gib)])
    res["fraction"] = core._oom_advice(request=gib, total=80 * gib, allocated=70 * gib,
                                       reserved=70 * gib, fraction=0.5, autocast=None)
    res["small_other"] = core._oom_advice(request=gib, total=80 * gib, allocated=70 * gib,
                                          reserved=71 * gib, others=[(7, "x", 100 * 2 ** 20)])
    try:
        core._oom_advice(others=[("pid", "name", 1)])
    except TypeError as e:
        res["bad"] = str(e)
    print(json.dumps(res))
    """)
    assert out["before"] is None
    assert out["observer"] == {"source": "observer", "device": 0, "request_bytes": 2 * 1024 ** 3,
                               "free_bytes": 1024 ** 3 // 2, "message": None}
    assert out["same"] is True
    frag = out["frag"]
    assert frag[0].startswith("Another process holds 30.00 GiB on this GPU: pid 4242 (python)")
    assert frag[1].startswith("20.00 GiB is reserved by PyTorch but not allocated")
    assert "expandable_segments:True" in frag[1]
    assert not any("Autocast is off" in a for a in frag)
    fraction = out["fraction"]
    assert fraction[0].startswith("The memory fraction 0.50 keeps 40.00 GiB")
    assert "auto_microbatch" in fraction[1]
    assert not any("Another process" in a for a in out["small_other"])
    assert "bad" in out


# ---- the exception hooks: Python's own until CUDA initialises -------------

# A console session: a traceback, then whether both hooks are still Python's.
CONSOLE_INPUT = """import torch
1/0
import sys, threading
print(sys.excepthook is sys.__excepthook__, threading.excepthook is threading.__excepthook__)
"""

# code.InteractiveConsole with its output captured through write(), as IDLE,
# pdb's interact and embedding applications do.
CAPTURED_CONSOLE = """
import code, json, sys

class Captured(code.InteractiveConsole):
    def __init__(self):
        super().__init__()
        self.out = []

    def write(self, data):
        self.out.append(data)

c = Captured()
for line in ("import torch", "1/0",
             "raise torch.OutOfMemoryError('CUDA out of memory. Tried to allocate 2.00 GiB')"):
    c.push(line)
print(json.dumps({"captured": "".join(c.out), "sys": sys.excepthook is sys.__excepthook__}))
"""


def _same_as_without_outofcuda(venv, workdir, **kw):
    """Runs one scenario with outofcuda and with OUTOFCUDA_DISABLE=1; returns
    both results (each as stdout + stderr)."""
    env = kw.pop("env", {})
    mine = venv.run(cwd=workdir, env=env, **kw)
    plain = venv.run(cwd=workdir, env=dict(env, OUTOFCUDA_DISABLE="1"), **kw)
    return mine, plain


def test_console_output_is_byte_identical_after_import_torch(venv, workdir):
    mine, plain = _same_as_without_outofcuda(venv, workdir, code=None, args=("-m", "code"),
                                             input=CONSOLE_INPUT)
    assert "ZeroDivisionError: division by zero" in plain.stderr
    assert "True True" in plain.stdout
    assert (mine.stdout, mine.stderr) == (plain.stdout, plain.stderr)

    mine, plain = _same_as_without_outofcuda(venv, workdir, code=CAPTURED_CONSOLE)
    out = json.loads(mine.stdout.strip().splitlines()[-1])
    assert out["sys"] is True
    # Every traceback went through the console's write(), none to stderr.
    assert "ZeroDivisionError" in out["captured"] and "OutOfMemoryError" in out["captured"]
    assert "code.py" not in out["captured"]
    assert (mine.stdout, mine.stderr) == (plain.stdout, plain.stderr)


def test_hooks_are_pythons_own_after_import_torch(venv, workdir):
    r = venv.check("""
        import json, sys, threading, torch, outofcuda, _outofcuda
        print(json.dumps({
            "sys": sys.excepthook is sys.__excepthook__,
            "thread": threading.excepthook is threading.__excepthook__,
            "queued": [getattr(fn, "__name__", "") for fn, _ in torch.cuda._queued_calls],
            "status": _outofcuda.status()["optimizations"]["oom_handler"]}))
    """, cwd=workdir)
    out = json.loads(r.stdout)
    assert out["sys"] is True and out["thread"] is True
    # A CPU-only build: nothing is queued for a CUDA that cannot start.
    assert not any(name.startswith("outofcuda") for name in out["queued"]), out["queued"]
    st = out["status"]
    assert st["applied"] is False and (st["state"], st["code"]) == ("skipped", "no_observer"), st


def test_cpu_build_uncaught_oom_prints_pythons_traceback_only(venv, workdir):
    """torch.OutOfMemoryError raised by hand on a CPU-only build (no CUDA to
    report on): in the main thread and in a thread, the output is exactly
    that of a run without outofcuda."""
    script = """
        import sys, threading, torch
        th = threading.Thread(target=lambda: (_ for _ in ()).throw(torch.OutOfMemoryError("t")))
        th.start(); th.join()
        sys.stderr.write("THREAD DONE\\n")
        raise torch.OutOfMemoryError("x")
    """
    mine, plain = _same_as_without_outofcuda(venv, workdir, code=script)
    assert plain.returncode == 1 and plain.stderr.endswith("torch.OutOfMemoryError: x\n")
    assert "THREAD DONE" in plain.stderr and "Exception in thread" in plain.stderr
    assert "outofcuda" not in mine.stderr
    assert (mine.returncode, mine.stdout, mine.stderr) == (1, plain.stdout, plain.stderr)


# A CUDA build (the stand-in of tests/fake_torch.py): CUDA initialises when
# the script calls torch.cuda._fake_cuda_init(), which runs the callbacks
# queued with torch.cuda._lazy_call as torch.cuda._lazy_init does.
FAKE_CUDA_PRELUDE = """
import json, sys, threading
import torch
# The stand-in has no autocast state; the report asks for it.
torch.is_autocast_enabled = lambda *a: False

def hooks():
    return [sys.excepthook is sys.__excepthook__,
            threading.excepthook is threading.__excepthook__]
"""


def _fake_cuda(venv, tmp_path, workdir, body, input=None, disable=False):
    from fake_torch import make_fake_torch

    root = tmp_path / "fake"
    if not root.exists():
        make_fake_torch(root, "2.14.1")
    env = {"PYTHONPATH": str(root)}
    if disable:
        env["OUTOFCUDA_DISABLE"] = "1"
    if input is not None:
        return venv.run(None, args=("-m", "code"), input=input, env=env, cwd=workdir)
    return venv.run(FAKE_CUDA_PRELUDE + textwrap.dedent(body), env=env, cwd=workdir)


def test_cuda_build_where_cuda_never_starts_is_plain_python(venv, tmp_path, workdir):
    """A CUDA build on a machine without a GPU: torch never runs its lazy-init
    queue (torch._C._cuda_init raises first), so an uncaught OOM, in a thread
    or the main thread, prints exactly what it prints without outofcuda."""
    body = """
        print(hooks())
        th = threading.Thread(target=lambda: (_ for _ in ()).throw(torch.cuda.OutOfMemoryError("t")))
        th.start(); th.join()
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    """
    mine = _fake_cuda(venv, tmp_path, workdir, body)
    plain = _fake_cuda(venv, tmp_path, workdir, body, disable=True)
    assert mine.stdout == "[True, True]\n", mine.stderr
    assert "Exception in thread" in plain.stderr and "outofcuda" not in mine.stderr
    assert (mine.returncode, mine.stdout, mine.stderr) == (1, plain.stdout, plain.stderr)


def test_uncaught_oom_report_once_cuda_initialised_then_chains(venv, tmp_path, workdir):
    r = _fake_cuda(venv, tmp_path, workdir, """
        def earlier(t, v, tb):
            sys.stderr.write("EARLIER HOOK " + t.__name__ + "\\n")
        before_user = hooks()
        sys.excepthook = earlier
        assert "outofcuda.oom" not in sys.modules
        import _outofcuda
        before = {"hooks": hooks(), "earlier": sys.excepthook is earlier,
                  "status": _outofcuda.status()["optimizations"]["oom_handler"]}
        # CUDA initialises on whichever thread touches it first; torch may
        # run its queue again (the stand-in does on every call).
        th = threading.Thread(target=torch.cuda._fake_cuda_init)
        th.start(); th.join()
        torch.cuda._fake_cuda_init()
        after = {"hooks": hooks(), "sys": getattr(sys.excepthook, "__name__", ""),
                 "status": _outofcuda.status()["optimizations"]["oom_handler"],
                 "observer": [c[0] for c in torch._C.calls
                              if c[0] == "_cuda_attach_out_of_memory_observer"]}
        print(json.dumps({"before_user": before_user, "before": before, "after": after}))

        def worker():
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 512.00 MiB. "
                                              "GPU 0 has a total capacity of 10.00 GiB")
        th = threading.Thread(target=worker)
        th.start(); th.join()
        sys.stderr.write("THREAD DONE\\n")
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 3.00 GiB. "
                                          "GPU 0 has a total capacity of 10.00 GiB")
    """)
    err = r.stderr
    assert r.returncode == 1, err
    out = last_json(r, status=1)
    # Before CUDA initialises: Python's own hooks, and the user's hook untouched.
    assert out["before_user"] == [True, True]
    assert out["before"]["hooks"] == [False, True] and out["before"]["earlier"] is True
    assert out["before"]["status"]["queued"] is True
    assert out["before"]["status"]["value"]["hooks"] == "installed when CUDA initialises"
    assert out["before"]["status"]["value"]["observer"] == "attached when CUDA initialises"
    # At CUDA initialisation: both installed once, the observer attached once.
    assert out["after"]["hooks"] == [False, False]
    assert out["after"]["sys"] == "outofcuda_excepthook"
    assert out["after"]["observer"] == ["_cuda_attach_out_of_memory_observer"]
    assert out["after"]["status"]["value"]["hooks"] == "sys.excepthook + threading.excepthook"
    assert out["after"]["status"]["value"]["observer"] == "attached"
    thread_report = err.index("outofcuda: CUDA out of memory on cuda:0")
    assert "  requested          512 MiB" in err
    assert thread_report < err.index("Exception in thread") < err.index("THREAD DONE")
    main = err.index("outofcuda: CUDA out of memory on cuda:0", err.index("THREAD DONE"))
    assert "  requested          3.00 GiB" in err[main:]
    assert main < err.index("EARLIER HOOK OutOfMemoryError")
    assert "what to try, most useful first:" in err[main:]
    # One report per OOM: a second pass over the queue did not chain twice.
    assert err.count("outofcuda: CUDA out of memory on cuda:0") == 2, err


def test_uncaught_report_never_imports_a_planted_outofcuda(venv, tmp_path, workdir):
    """An `outofcuda` folder in the working directory (first on sys.path for
    `python -c`) is never imported by the hook, whose report is the C core's
    alone: the whole report comes, then the traceback."""
    planted = workdir / "outofcuda"
    planted.mkdir()
    marker = tmp_path / "MARKER"
    for name in ("__init__.py", "oom.py"):
        (planted / name).write_text(f"open({str(marker)!r}, 'a').write({name!r})\n")
    r = _fake_cuda(venv, tmp_path, workdir, """
        torch.cuda._fake_cuda_init()
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    """)
    assert r.returncode == 1, r.stderr
    assert not marker.exists(), marker.read_text()
    assert r.stderr.startswith("outofcuda: CUDA out of memory on cuda:"), r.stderr
    assert "  requested          2.00 GiB\n" in r.stderr
    assert "\n\nTraceback" in r.stderr and r.stderr.index("\n\nTraceback") > r.stderr.index(
        "  what to try, most useful first:\n"), r.stderr


def test_cuda_init_inside_a_console_leaves_its_output_alone(venv, tmp_path, workdir):
    """CUDA initialising inside a `code` console (sys.ps1 is set) does not
    take sys.excepthook from it: the console stays byte-identical."""
    session = ("import torch\ntorch.cuda._fake_cuda_init()\n1/0\n"
               "raise torch.cuda.OutOfMemoryError('CUDA out of memory. Tried to allocate 2 MiB')\n"
               "import sys\nprint(sys.excepthook is sys.__excepthook__)\n")
    mine = _fake_cuda(venv, tmp_path, workdir, None, input=session)
    plain = _fake_cuda(venv, tmp_path, workdir, None, input=session, disable=True)
    assert "ZeroDivisionError" in plain.stderr and "True" in plain.stdout
    assert (mine.stdout, mine.stderr) == (plain.stdout, plain.stderr)


def test_snapshot_variable_is_checked(venv, workdir):
    (workdir / "adir").mkdir()
    cases = {"/nonexistent-dir/x.pickle": "does not exist", str(workdir / "adir"): "not a directory",
             str(workdir) + "/": "must name a file",
             "snap.pickle": "no snapshot can be written (this torch build has no CUDA OOM observer)"}
    for value, words in cases.items():
        r = venv.check("""
            import json, torch, _outofcuda
            print(json.dumps(_outofcuda.status()["optimizations"]["oom_handler"]))
        """, env={"OUTOFCUDA_OOM_SNAPSHOT": value}, cwd=workdir)
        assert "OUTOFCUDA_OOM_SNAPSHOT" in r.stderr and words in r.stderr, (value, r.stderr)
        entry = json.loads(r.stdout)
        assert entry["applied"] is False and entry["value"] is None
        assert entry["code"] == "no_observer"


def test_gpu_checks_take_the_gpu_fixture():
    """Each GPU check asks for the `gpu` fixture (tests/gpu/conftest.py), which
    skips for the true reason (no GPU, or no CUDA in the test environment)
    and runs on a GPU machine; a module-level importorskip in the runner's own
    interpreter would skip them everywhere for a reason that is not the one."""
    import ast
    from pathlib import Path

    folder = Path(__file__).parent / "gpu"
    files = sorted(folder.glob("test_*.py"))
    assert folder / "test_oom.py" in files
    for path in files:
        tree = ast.parse(path.read_text())
        calls = [n.func.attr for n in ast.walk(tree)
                 if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)]
        assert "importorskip" not in calls, path.name
        tests = [n for n in tree.body if isinstance(n, ast.FunctionDef)
                 and n.name.startswith("test_")]
        assert tests, path.name
        for fn in tests:
            assert "gpu" in [a.arg for a in fn.args.args], f"{path.name}::{fn.name}"


def test_the_hook_reports_in_one_crossing(venv, tmp_path, workdir):
    """The exception hook gathers, ranks and writes the report in C: no module
    of the outofcuda package is imported for it. What it printed is the text
    of the report last_oom() then returns, which the exception carries."""
    r = _fake_cuda(venv, tmp_path, workdir, """
        import io
        torch.cuda._fake_cuda_init()
        errors = []

        def worker():
            e = torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 512.00 MiB. "
                                            "GPU 0 has a total capacity of 10.00 GiB")
            errors.append(e)
            raise e
        real, sys.stderr = sys.stderr, io.StringIO()
        th = threading.Thread(target=worker)
        th.start(); th.join()
        printed, sys.stderr = sys.stderr.getvalue(), real
        package = sorted(m for m in sys.modules if m == "outofcuda" or m.startswith("outofcuda."))
        import outofcuda
        rep = outofcuda.last_oom()
        print(json.dumps({"package": package, "printed": printed,
                          "text": outofcuda.oom.format_report(rep),
                          "carried": errors[0].outofcuda_report is rep,
                          "request": rep["request_bytes"], "again": outofcuda.last_oom() is rep}))
    """)
    out = last_json(r)
    assert out["package"] == []
    assert out["printed"].startswith(out["text"] + "\n\nException in thread"), out["printed"]
    assert out["text"].startswith("outofcuda: CUDA out of memory on cuda:0\n")
    assert out["request"] == 512 << 20
    assert out["carried"] is True and out["again"] is True


def test_two_gpus_out_of_memory_at_once_keep_their_own_figures(venv, tmp_path, workdir):
    """DataParallel's threads can run out of memory on two GPUs at once. The
    observer of GPU 0's OOM is held inside torch.cuda.memory_stats while GPU
    1's OOM runs its observer and its thread's report to the end; then GPU
    0's goes on. Each report, the one built in its thread, the one built when
    the main thread re-raises it as DataParallel does, and last_oom(),
    carries the figures of its own GPU."""
    r = _fake_cuda(venv, tmp_path, workdir, """
        import io, outofcuda
        torch.cuda._fake_cuda_init()
        gib = 1 << 30
        torch.cuda._fake_memory_stats.update({
            0: {"allocated_bytes.all.current": 10 * gib, "reserved_bytes.all.current": 11 * gib},
            1: {"allocated_bytes.all.current": 70 * gib, "reserved_bytes.all.current": 75 * gib}})
        inside, go_on = threading.Event(), threading.Event()
        stats = torch.cuda.memory_stats

        def slow_stats(device=None):
            if device == 0 and not go_on.is_set():
                inside.set()
                go_on.wait(60)
            return stats(device)
        torch.cuda.memory_stats = slow_stats
        errors = {}

        def replica(device, request, free):
            try:
                torch.cuda._fake_oom(device, request, 80 * gib, free)
            except torch.cuda.OutOfMemoryError as e:
                errors[device] = e
                raise  # threading.excepthook reports it in this thread

        def figures(rep):
            return {k: rep[k] for k in ("source", "device", "request_bytes", "free_bytes",
                                        "allocated_bytes", "reserved_bytes", "advice")}
        real, sys.stderr = sys.stderr, io.StringIO()
        a = threading.Thread(target=replica, args=(0, 2 * gib, gib))
        a.start()
        assert inside.wait(60), "GPU 0's observer never reached memory_stats"
        b = threading.Thread(target=replica, args=(1, 4 * gib, 3 * gib))
        b.start(); b.join()
        go_on.set(); a.join()
        out = {"thread": {d: figures(e.outofcuda_report) for d, e in errors.items()},
               "last": figures(outofcuda.last_oom()), "main": {}}
        # DataParallel raises a replica's error again in the main thread, as a
        # new exception whose text carries the original's.
        for d in (1, 0):
            e = torch.cuda.OutOfMemoryError(
                f"Caught OutOfMemoryError in replica {d} on device {d}.\\nOriginal Traceback "
                f"(most recent call last):\\n  ...\\ntorch.OutOfMemoryError: {errors[d]}")
            sys.excepthook(type(e), e, None)
            out["main"][d] = figures(e.outofcuda_report)
        sys.stderr = real
        print(json.dumps(out))
    """)
    out = last_json(r)
    gib = 1 << 30
    want = {"0": {"source": "observer", "device": 0, "request_bytes": 2 * gib, "free_bytes": gib,
                  "allocated_bytes": 10 * gib, "reserved_bytes": 11 * gib},
            "1": {"source": "observer", "device": 1, "request_bytes": 4 * gib,
                  "free_bytes": 3 * gib, "allocated_bytes": 70 * gib, "reserved_bytes": 75 * gib}}
    for where in ("thread", "main"):
        got = {d: {k: v for k, v in rep.items() if k != "advice"} for d, rep in out[where].items()}
        assert got == want, (where, out)
    # The ranked advice follows each OOM's own figures, wherever it is built.
    assert out["main"] == out["thread"]
    assert out["last"] == out["thread"]["0"]


def test_report_bytes_are_written_by_the_engine(venv, workdir):
    """One writer of byte counts: the report's figures read as the advice's
    (whole MiB under a GiB, two decimals of GiB from there)."""
    got = venv.json("""
import json, torch, outofcuda, _outofcuda
from outofcuda.oom import format_report
sizes = [0, (1 << 30) - (1 << 19), 1 << 30, 3 << 29, 80 << 30]
lines = []
for n in sizes:
    _outofcuda._oom_observer(0, n, 80 << 30, 1 << 29)
    text = format_report(outofcuda.last_oom())
    lines.append([ln for ln in text.splitlines() if ln.startswith("  requested")])
print(json.dumps([lines, [ln for ln in text.splitlines() if ln.startswith("  this process")]]))
""", cwd=workdir)
    assert got == [[["  requested          0 MiB"], ["  requested          1024 MiB"],
                    ["  requested          1.00 GiB"], ["  requested          1.50 GiB"],
                    ["  requested          80.00 GiB"]],
                   ["  this process       allocated unknown, reserved unknown, peak allocated "
                    "unknown"]]


GOLDEN_REPORTS = """
import json, _outofcuda, outofcuda.oom
G = 1 << 30
full = {"device": 1, "device_name": "NVIDIA H100 80GB HBM3",
        "message": "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 1 has a total capacity "
                   "of 79.10 GiB of which 512.00 MiB is free.",
        "request_bytes": 2 * G, "total_bytes": 80 * G, "free_bytes": 512 << 20,
        "limit_bytes": 72 * G, "allocated_bytes": 60 * G, "reserved_bytes": 70 * G,
        "peak_allocated_bytes": 75 * G, "fragmentation_bytes": 10 * G,
        "inactive_split_bytes": 3 << 29, "num_ooms": 1,
        "other_processes": [{"pid": 4242, "name": "python", "used_bytes": 5 * G},
                            {"pid": 7, "name": "", "used_bytes": 100 << 20}],
        "allocator_config": "expandable_segments:True", "expandable_segments": True,
        "memory_fraction": 0.9, "autocast": False, "snapshot": "/tmp/oom.pickle",
        "advice": ["Stop pid 4242.", "Train with outofcuda.auto_microbatch(step)."],
        "notes": ["a note"], "cell_frames": "released"}
bare = dict(full, device=None, device_name=None, message=None, other_processes=[],
            allocator_config="", memory_fraction=None, snapshot=None, notes=[], advice=[],
            cell_frames="kept", **{k: None for k in full if k.endswith("_bytes")})
print(json.dumps([outofcuda.oom.format_report(r).splitlines() for r in (full, bare)]))
"""


def test_the_report_text_word_for_word(venv, workdir):
    """The report's text, line for line (a golden text: its wording is the
    point), written by the engine from the typed fields of a report's dict."""
    full, bare = venv.json(GOLDEN_REPORTS, cwd=workdir)
    assert full == [
        "outofcuda: CUDA out of memory on cuda:1 (NVIDIA H100 80GB HBM3)",
        "  error              CUDA out of memory. Tried to allocate 2.00 GiB. GPU 1 has a total "
        "capacity of 79.10 GiB of which 512.00 MiB is free.",
        "  requested          2.00 GiB",
        "  device             80.00 GiB total, 512 MiB free (NVML)",
        "  this process       allocated 60.00 GiB, reserved 70.00 GiB, peak allocated 75.00 GiB",
        "  fragmentation      10.00 GiB reserved but unallocated, 1.50 GiB in inactive split "
        "blocks",
        "  other processes    pid 4242 (python) 5.00 GiB, pid 7 (?) 100 MiB",
        "  allocator          expandable_segments:True",
        "  memory fraction    0.90 (cap 72.00 GiB)",
        "  snapshot           /tmp/oom.pickle (open it at https://pytorch.org/memory_viz)",
        "  note               a note",
        "  cell frames        released, so %debug has no traceback "
        "(%env OUTOFCUDA_OOM_KEEP_FRAMES=1 keeps them)",
        "  what to try, most useful first:",
        "    1. Stop pid 4242.",
        "    2. Train with outofcuda.auto_microbatch(step)."]
    assert bare == [
        "outofcuda: CUDA out of memory on cuda:?",
        "  requested          unknown",
        "  device             unknown",
        "  this process       allocated unknown, reserved unknown, peak allocated unknown",
        "  fragmentation      unknown reserved but unallocated, unknown in inactive split blocks",
        "  allocator          PyTorch defaults",
        "  memory fraction    none",
        "  cell frames        kept for %debug (OUTOFCUDA_OOM_KEEP_FRAMES=1): they hold the "
        "cell's tensors until the next error",
        "  what to try, most useful first:"]


def test_a_long_message_is_cut_between_characters(venv, workdir):
    """The report keeps the first line of the OOM's message up to 399 bytes
    and prints its first 160 characters: neither cut splits a character."""
    got = venv.json("""
import json, torch, outofcuda, outofcuda.oom
text = "CUDA out of memory. Tried to allocate 2.00 GiB. " + "\u00e9" * 300 + "\\nsecond line"
rep = outofcuda.oom._record(torch.cuda.OutOfMemoryError(text))
error = [ln for ln in outofcuda.oom.format_report(rep).splitlines() if ln.startswith("  error")]
print(json.dumps([text, rep["message"], error]))
""", cwd=workdir)
    text, message, error = got
    # 48 bytes of ASCII, then 2-byte characters: the 399th byte would split one.
    assert len(message.encode()) == 398 and text.startswith(message)
    assert error == ["  error              " + message[:160]]


def test_what_counts_as_an_oom_is_the_engines(venv, workdir):
    """outofcuda.oom.is_oom asks the engine, whose rule the exception hooks use:
    torch's OOM types, or a plain RuntimeError with the text older paths raise."""
    got = venv.json("""
import json, torch
from outofcuda.oom import is_oom
class Sub(RuntimeError):
    pass
cases = [torch.OutOfMemoryError("x"), torch.cuda.OutOfMemoryError("x"),
         RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"),
         RuntimeError("CUBLAS_STATUS_ALLOC_FAILED when calling cublasCreate"),
         Sub("CUDA out of memory"), ValueError("CUDA out of memory"), RuntimeError("other"), 5]
print(json.dumps([is_oom(c) for c in cases]))
""", cwd=workdir)
    assert got == [True, True, True, True, False, False, False, False]
