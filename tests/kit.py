"""The helpers of both sides of the subprocess boundary, written once.

Parent side (the test): `last_json(r)` reads the JSON value a scenario printed
last; `Venv.json` (tests/conftest.py) runs a scenario and reads it in one call.

Child side (the scenario script): `CHILD` is plain Python source that a
script puts before its body (`CHILD + textwrap.dedent(body)`): bounded waits
that exit with a message naming what never came, the thread count, the
resident set size, a small model and the hang guard. It is a plain string, not
an f-string, so its braces are single, and it imports only the standard
library at its top (torch only inside `mlp`), so it changes nothing a scenario
measures about imports or sys.path.
"""
import json


def last_json(r, prefix=None, *, quiet=False, status=0):
    """The JSON value a finished scenario printed last. r must have exited with status (0);
    prefix: the value is the rest of the last stdout line starting with it
    (other lines may follow), else the whole last line; quiet: stderr must be
    empty too."""
    assert r.returncode == status, f"exit {r.returncode}\nstdout:\n{r.stdout}\nstderr:\n{r.stderr}"
    if quiet:
        assert r.stderr == "", r.stderr
    lines = r.stdout.strip().splitlines()
    if prefix is None:
        return json.loads(lines[-1])
    line = [ln for ln in lines if ln.startswith(prefix)][-1]
    return json.loads(line[len(prefix):])



def oc_headers():
    """The text of the engine's headers: src/oc.h and the two it includes
    (oc_core.h, the pure C part; oc_edge.h), where a #define may live."""
    from pathlib import Path

    src = Path(__file__).resolve().parent.parent / "src"
    paths = sorted(src.glob("*.h"))
    assert {p.name for p in paths} >= {"oc.h", "oc_core.h", "oc_edge.h"}, paths
    return "\n".join(p.read_text() for p in paths)


def oc_h_table(macro):
    """The names an X-macro table of the engine's headers lists (OC_REC_CODES,
    OC_REC_STATES, OC_OPTIMISATIONS, ...), in order: its definition runs
    while its lines end in a backslash; a row's other columns follow its
    name."""
    import re

    lines = oc_headers().splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith(f"#define {macro}(X)"))
    block = []
    for ln in lines[start:]:
        block.append(ln)
        if not ln.rstrip().endswith("\\"):
            break
    return re.findall(r'X\(\w+, "(\w+)"[,)]', "\n".join(block))


def assert_records(optimizations):
    """Every optimisation of status() carries a state and a code of the
    record's tables, and applied says the same as the state."""
    assert list(optimizations) == oc_h_table("OC_OPTIMISATIONS"), list(optimizations)
    codes, states = oc_h_table("OC_REC_CODES"), oc_h_table("OC_REC_STATES")
    for name, e in optimizations.items():
        assert e["state"] in states and e["code"] in codes, (name, e)
        assert e["applied"] is (e["state"] == "applied"), (name, e)
        assert set(e["notes"]) <= set(oc_h_table("OC_REC_NOTES")), (name, e)
        assert e.get("queued", False) is (e["state"] in ("queued", "interrupted")), (name, e)


def flags_script(extra):
    """A scenario that imports torch and prints, after `FLAGS=`, the flags
    outofcuda may change as torch's public getters read them, with extra
    (source of more `'key': value,` entries)."""
    return """
import json, os, sys, torch
b = torch.backends
print('FLAGS=' + json.dumps({
    'matmul_tf32': b.cuda.matmul.allow_tf32,
    'matmul_precision': torch.get_float32_matmul_precision(),
    'cudnn_tf32': b.cudnn.allow_tf32,
    'benchmark': b.cudnn.benchmark,
    'deterministic': b.cudnn.deterministic,
    'flash': b.cuda.flash_sdp_enabled(),
    'mem_efficient': b.cuda.mem_efficient_sdp_enabled(),
    'math': b.cuda.math_sdp_enabled(),
    'cudnn_sdp': b.cuda.cudnn_sdp_enabled(),
    'cuda_initialized': torch.cuda.is_initialized(),
""" + extra + """}))
"""


CHILD = r'''
import faulthandler, os, signal, sys, time


def guard(seconds):
    """A scenario that hangs fails fast with every thread's traceback instead
    of running into the runner's timeout; Ctrl-C raises KeyboardInterrupt
    however the test run was started (a background job without job control
    inherits SIGINT ignored)."""
    faulthandler.dump_traceback_later(seconds, exit=True)
    signal.signal(signal.SIGINT, signal.default_int_handler)


def wait_for(pred, timeout=10.0, poll=0.01):
    """True once pred() is, False when timeout seconds pass first."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(poll)
    return False


def need(pred, what, timeout=10.0, detail=None, poll=0.01):
    """Waits for pred; exits (status 3) with a message naming what never came,
    and detail() after it where given."""
    if not wait_for(pred, timeout, poll):
        more = f": {detail()}" if detail else ""
        sys.stderr.write(f"timed out after {timeout} s waiting for: {what}{more}\n")
        sys.stderr.flush()
        os._exit(3)


def threads():
    """How many threads this process has."""
    return len(os.listdir("/proc/self/task"))


def thread_names():
    """This process's thread names, sorted. A thread that ends between the
    listing and the read (torch's and Python's own come and go) is left out."""
    names = []
    for t in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{t}/comm") as f:
                names.append(f.read().strip())
        except FileNotFoundError:
            pass
    return sorted(names)


def rss():
    """Resident set size in bytes."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def mlp(*widths, acts=("Tanh",)):
    """Linear layers of these widths (12, 16, 3 when none are given) with the
    torch.nn activations `acts`, in turn, between them: mlp() is
    Linear(12, 16), Tanh, Linear(16, 3)."""
    import torch
    widths = widths or (12, 16, 3)
    layers = [torch.nn.Linear(widths[0], widths[1])]
    for i, (a, b) in enumerate(zip(widths[1:], widths[2:])):
        layers += [getattr(torch.nn, acts[i % len(acts)])(), torch.nn.Linear(a, b)]
    return torch.nn.Sequential(*layers)


def grads(model):
    """A copy of each parameter's gradient."""
    return [p.grad.detach().clone() for p in model.parameters()]


def rel_err(a, b):
    """The largest relative error of the tensors a against the tensors b."""
    return max(((x - y).abs().max() / y.abs().max().clamp_min(1e-30)).item()
               for x, y in zip(a, b))
'''


def damage_code(path, how):
    """Damages the code (the .text section) of the ELF file at path and keeps
    its size, as bit rot or a copy overwritten in place would: "zero" clears
    the section, "flip" inverts its first 40 bytes (code the loader runs when
    it maps the file). A size check cannot tell the result from the file."""
    import struct

    data = bytearray(path.read_bytes())
    (table,) = struct.unpack_from("<Q", data, 0x28)  # e_shoff
    entry, count, names_at = struct.unpack_from("<HHH", data, 0x3A)

    def section(i):  # sh_name, sh_type, sh_flags, sh_addr, sh_offset, sh_size
        return struct.unpack_from("<IIQQQQ", data, table + i * entry)

    names = section(names_at)[4]
    for i in range(count):
        name, _, _, _, offset, size = section(i)
        if data[names + name:names + name + 6] == b".text\0":
            end = offset + (size if how == "zero" else 40)
            data[offset:end] = bytes(0 if how == "zero" else b ^ 0xFF for b in data[offset:end])
            path.write_bytes(bytes(data))
            return
    raise AssertionError(f"{path} has no .text section")
