"""Static checks on the C core: clang-tidy and cppcheck with the checked-in
configuration, the clang-format style, abi3audit on the built wheel, and a
few rules over names no compiler enforces (GIL pairing, no CUDA/NVML headers,
no dlopen of a relative path, every swallowed error through a macro that says
why, every environment variable's name held to the settings table, files
that call and share data only downward in oc.h's map).

The tools come from the system (`apt-get install clang-tidy cppcheck
clang-format`) and from pip (`abi3audit`); a test whose tool is missing is
skipped with the install line, so a developer machine without them still runs
the rest."""
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from conftest import wait_for_setup

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "src"
C_FILES = sorted(SRC.glob("*.c"))
# oc.h, which every C file includes, and the headers it includes (oc_core.h, oc_edge.h).
HEADERS = sorted(SRC.glob("*.h"))
FORMATTED = C_FILES + HEADERS + sorted((ROOT / "fuzz").glob("*.c"))
# The stand-in NVIDIA library the tests build is C of this project too.
FORMATTED += sorted((ROOT / "tests").glob("*/*.c"))
DEFINES = ["-DPy_LIMITED_API=0x03090000", "-D_GNU_SOURCE"]


def _tool(name, install=None):
    """The tool's path; skips when it is missing, except under CI (CI set),
    where a missing tool must fail rather than pass silently."""
    wait_for_setup("tools")
    # Tools pip installed sit beside this interpreter, which is not on PATH
    # when the tests run as `.venv-ci/bin/python3 -m pytest` (no activation).
    beside = Path(sys.executable).parent / name
    path = str(beside) if beside.is_file() else shutil.which(name)
    if path is None:
        how = install or f"apt-get install {name}"
        if os.environ.get("CI"):
            pytest.fail(f"{name} is required in CI ({how})")
        pytest.skip(f"{name} is not installed ({how})")
    return path


def _run(cmd, **kw):
    return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, **kw)


# ---- clang-tidy, cppcheck, clang-format ----

def test_clang_tidy_clean():
    tidy = _tool("clang-tidy")
    flags = ["-std=c11", *DEFINES, "-I" + sysconfig.get_paths()["include"]]

    def one(path):
        return path, _run([tidy, "--quiet", str(path), "--", *flags], timeout=300)

    # One process per file, two at a time: the CI machine has two cores.
    with ThreadPoolExecutor(max_workers=max(2, (os.cpu_count() or 2))) as pool:
        results = list(pool.map(one, C_FILES))
    failures = [f"{p.name}:\n{r.stdout}{r.stderr}" for p, r in results
                if r.returncode != 0 or ": warning:" in r.stdout or ": error:" in r.stdout]
    assert not failures, "clang-tidy (.clang-tidy) findings:\n" + "\n".join(failures)


def test_cppcheck_clean():
    cppcheck = _tool("cppcheck")
    r = _run([cppcheck, "--quiet", "--enable=warning,portability,performance", "--std=c11",
              "--library=python", "--library=posix", "--inline-suppr", "--error-exitcode=1",
              "--suppress=missingIncludeSystem", *DEFINES, str(SRC)], timeout=300)
    assert r.returncode == 0 and not r.stderr.strip(), f"cppcheck findings:\n{r.stderr}"


def test_clang_format_clean():
    fmt = _tool("clang-format")
    r = _run([fmt, "--style=file", "--dry-run", "--Werror", *map(str, FORMATTED)], timeout=120)
    files = sorted(set(re.findall(r"^(\S+?):\d+:\d+: (?:error|warning)", r.stderr, re.M)))
    assert r.returncode == 0, (
        "not in .clang-format style (fix with `clang-format -i --style=file FILE`): "
        + ", ".join(files) + "\n" + r.stderr[:3000])


# ---- abi3audit on the wheel ----

def test_abi3audit_strict(wheel, tmp_path):
    exe = _tool("abi3audit", "pip install abi3audit")
    r = subprocess.run([exe, "--strict", "--summary", str(wheel)], capture_output=True,
                       text=True, timeout=300, cwd=tmp_path)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    assert "2 extensions scanned" in out and "0 ABI violations" in out, out
    assert "cp39-abi3" in wheel.name


# ---- text rules over the C sources ----

def _functions(text):
    """Yields (name, body) for each top-level C function definition: a body
    starts at a line that is only '{' and ends at the next line that is '}'."""
    # The parameters hold balanced parentheses only (a function pointer's), so
    # a macro's call above a function never lends the function its name.
    params = r"[^;{}()]*(?:\([^;{}()]*\)[^;{}()]*)*"
    for m in re.finditer(rf"^(?:[^\n;{{}}#]*?\b(\w+)\s*\({params}\))\s*\n\{{\n(.*?)^\}}", text,
                         re.M | re.S):
        yield m.group(1), m.group(2)


def _strip_comments(text):
    """text without comments; string and character literals kept whole: a
    "https://..." or a "/*" inside one begins no comment."""
    return LITERALS.sub(lambda m: m[0] if m[0][0] in "\"'" else "\n" * m[0].count("\n"), text)


def gil_problems(text):
    """Functions that call PyGILState_Ensure more often than Release."""
    bad = []
    for name, body in _functions(_strip_comments(text)):
        ensure = len(re.findall(r"\bPyGILState_Ensure\s*\(", body))
        release = len(re.findall(r"\bPyGILState_Release\s*\(", body))
        if release < ensure:
            bad.append(f"{name}: {ensure} PyGILState_Ensure, {release} PyGILState_Release")
    # An Ensure outside any recognised function body is a problem too.
    total = len(re.findall(r"\bPyGILState_Ensure\s*\(", _strip_comments(text)))
    seen = sum(len(re.findall(r"\bPyGILState_Ensure\s*\(", b))
               for _, b in _functions(_strip_comments(text)))
    if total != seen:
        bad.append(f"{total - seen} PyGILState_Ensure outside a function body the check reads")
    return bad


HEADER_RE = re.compile(r'^\s*#\s*include\s*[<"]([^>"]*)[>"]', re.M)
FORBIDDEN_HEADER_RE = re.compile(r"(^|/)(cuda|cudnn|cublas|nccl|nvml|nvrtc|cupti|curand|cusparse|cufft)",
                                 re.I)


def header_problems(text):
    """#include lines naming a CUDA or NVIDIA header."""
    return [h for h in HEADER_RE.findall(_strip_comments(text)) if FORBIDDEN_HEADER_RE.search(h)]


def dlopen_problems(text):
    """dlopen calls whose path may be relative. A literal must be an absolute
    path or a bare soname (no '/'; the system loader searches only system
    directories for those); a computed path is accepted only inside a
    function that checks it starts with '/'."""
    bad = []
    for name, body in _functions(_strip_comments(text)):
        for m in re.finditer(r"\bdlopen\s*\(\s*([^,]*?)\s*,", body):
            arg = m.group(1)
            lit = re.fullmatch(r'"((?:[^"\\]|\\.)*)"', arg)
            if arg == "NULL":
                continue
            if lit:
                path = lit.group(1)
                if "/" in path and not path.startswith("/"):
                    bad.append(f"{name}: dlopen(\"{path}\") is a relative path")
                elif not path:
                    bad.append(f"{name}: dlopen(\"\")")
            elif not re.search(r"\[0\]\s*[!=]=\s*'/'", body):
                bad.append(f"{name}: dlopen({arg}) without a check that the path is absolute")
    if len(re.findall(r"\bdlopen\s*\(", _strip_comments(text))) != sum(
            len(re.findall(r"\bdlopen\s*\(", b)) for _, b in _functions(_strip_comments(text))):
        bad.append("dlopen outside a function body the check reads")
    return bad


CLEAR = re.compile(r"\bPyErr_Clear\s*\(")
# The functions that clear an exception bare, by file: the OUTOFCUDA_DEBUG
# traces and what they call (traced, their own clears would call the trace
# again), and the free-threading check both extensions make before either may
# trace. Every other swallowed error goes through OC_CLEAR, OC_CLEAR_ABSENT or
# OC_CLEAR_RECORDED (src/oc.h), or the boot's BOOT_CLEAR, whose name says why.
OWN_CLEARS = {
    "common.c": {"oc_clear_at", "oc_stderr_write", "oc_utf8"},
    "boot.c": {"boot_clear", "stderr_usable"},
    "oc.h": {"oc_free_threaded_interpreter"},
}


def bare_clears(text, own=()):
    """PyErr_Clear() calls outside the functions named in own."""
    code = _strip_comments(text)
    bad = [f"{name}: PyErr_Clear() x{n}" for name, body in _functions(code)
           if name not in own and (n := len(CLEAR.findall(body)))]
    outside = len(CLEAR.findall(code)) - sum(len(CLEAR.findall(b)) for _, b in _functions(code))
    if outside:
        bad.append(f"PyErr_Clear() x{outside} outside a function body the check reads")
    return bad


@pytest.mark.parametrize("path", C_FILES + HEADERS, ids=lambda p: p.name)
def test_c_source_rules(path):
    text = path.read_text()
    problems = gil_problems(text) + header_problems(text) + dlopen_problems(text)
    problems += bare_clears(text, OWN_CLEARS.get(path.name, ()))
    assert not problems, f"{path.name}: " + "; ".join(problems)


def test_the_functions_that_clear_bare_are_there():
    """OWN_CLEARS names functions that exist and clear: a rename cannot leave
    the rule excusing a name nobody uses."""
    for file, names in OWN_CLEARS.items():
        code = _strip_comments((SRC / file).read_text())
        clearing = {name for name, body in _functions(code) if CLEAR.search(body)}
        assert names <= clearing, (file, names - clearing)


def test_c_source_rules_catch_violations():
    """The text rules above reject what they are meant to reject."""
    unpaired = "static void f(void)\n{\n    PyGILState_STATE s = PyGILState_Ensure();\n    g();\n}\n"
    paired = ("static void f(void)\n{\n    PyGILState_STATE s = PyGILState_Ensure();\n"
              "    if (x) {\n        PyGILState_Release(s);\n        return;\n    }\n"
              "    PyGILState_Release(s);\n}\n")
    assert gil_problems(unpaired) and not gil_problems(paired)
    assert header_problems('#include <cuda_runtime.h>\n#include "nvml.h"\n') == [
        "cuda_runtime.h", "nvml.h"]
    assert header_problems("#include <nvidia/gdk/nvml.h>\n")
    assert not header_problems("#include <dlfcn.h>\n/* #include <cuda.h> */\n")
    rel = 'static void *f(void)\n{\n    return dlopen("./libnvidia-ml.so.1", RTLD_NOW);\n}\n'
    bare = 'static void *f(void)\n{\n    return dlopen("libnvidia-ml.so.1", RTLD_NOW);\n}\n'
    absolute = 'static void *f(void)\n{\n    return dlopen("/usr/lib/libx.so", RTLD_NOW);\n}\n'
    computed = "static void *f(const char *p)\n{\n    return dlopen(p, RTLD_NOW);\n}\n"
    checked = ("static void *f(const char *p)\n{\n    if (p[0] != '/')\n        return NULL;\n"
               "    return dlopen(p, RTLD_NOW);\n}\n")
    assert dlopen_problems(rel) and dlopen_problems(computed)
    assert not dlopen_problems(bare) and not dlopen_problems(absolute)
    assert not dlopen_problems(checked)
    bare = "static void f(void)\n{\n    PyErr_Clear(); /* absence: a comment is no reason */\n}\n"
    traced = "static void f(void)\n{\n    OC_CLEAR_ABSENT(); /* a missing attribute */\n}\n"
    assert bare_clears(bare) == ["f: PyErr_Clear() x1"]
    assert not bare_clears(traced) and not bare_clears(bare, own={"f"})
    assert bare_clears(bare, own={"g"}) and bare_clears("#define QUIET() PyErr_Clear()\n")
    assert not bare_clears("/* PyErr_Clear() */\n")


def unread_bodies(text):
    """How many top-level bodies the function splitter does not read: every
    body ends at a line that is only '}', whatever style its opening has."""
    text = _strip_comments(text)
    return len(re.findall(r"^\}$", text, re.M)) - len(list(_functions(text)))


def _count(pattern, text):
    return len(re.findall(pattern, _strip_comments(text)))


def test_rules_read_the_whole_tree():
    """The rules above see all the code: every function body of every C file
    (a style change that hid a body would silently weaken them), and every
    PyGILState_Ensure and dlopen of the tree, each inside a body they check."""
    ensure, dlopen = r"\bPyGILState_Ensure\s*\(", r"\bdlopen\s*\("
    totals = {"functions": 0, "ensure": 0, "ensure_read": 0, "release": 0, "dlopen": 0,
              "dlopen_read": 0}
    for path in C_FILES + HEADERS:
        text = path.read_text()
        assert unread_bodies(text) == 0, f"{path.name}: function bodies the rules do not read"
        bodies = [b for _, b in _functions(_strip_comments(text))]
        totals["functions"] += len(bodies)
        totals["ensure"] += _count(ensure, text)
        totals["ensure_read"] += sum(len(re.findall(ensure, b)) for b in bodies)
        totals["release"] += _count(r"\bPyGILState_Release\s*\(", text)
        totals["dlopen"] += _count(dlopen, text)
        totals["dlopen_read"] += sum(len(re.findall(dlopen, b)) for b in bodies)
    # The native monitor thread takes the GIL and nvml.c opens NVML: if
    # either count is 0 the rules check nothing at all.
    assert totals["ensure"] > 0 and totals["ensure_read"] == totals["ensure"], totals
    assert totals["release"] >= totals["ensure"], totals
    assert totals["dlopen"] > 0 and totals["dlopen_read"] == totals["dlopen"], totals
    assert totals["functions"] >= 100, totals


def test_unread_bodies_catches_a_hidden_function():
    seen = "static void f(void)\n{\n    g();\n}\n"
    same_line = "static void h(void) {\n    PyGILState_Ensure();\n}\n"
    assert unread_bodies(seen) == 0
    assert unread_bodies(seen + same_line) == 1


def _file_map():
    """The C files in the order oc.h's map gives them."""
    return re.findall(r"^ \*   (\w+\.c)\b", (SRC / "oc.h").read_text(), re.M)


def _calls_between_files():
    """(caller file, callee file, name) for every call of a function or use of a
    table that one C file defines and another names (comments dropped)."""
    texts = {p.name: p.read_text() for p in SRC.glob("*.c")}
    owner = {}
    for name, text in texts.items():
        for m in re.finditer(r"^(?!static)[A-Za-z][\w \*]*?\b(oc_\w+)\s*(?:\(|\[\]\s*=)", text,
                             re.M):
            owner[m.group(1)] = name
    out = []
    for name, text in texts.items():
        code = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
        for fn, home in owner.items():
            if home != name and re.search(rf"\b{fn}\b", code):
                out.append((name, home, fn))
    return out


def test_c_files_read_top_down_as_oc_h_maps_them():
    order = _file_map()
    assert sorted(order) == sorted(p.name for p in SRC.glob("*.c")), order
    upward = [c for c in _calls_between_files() if order.index(c[1]) < order.index(c[0])]
    assert not upward, f"calls to a file above the caller in oc.h's map: {upward}"
    assert ("bridge.c", "oom.c", "oc_oom_at_cuda_init") in _calls_between_files()


# ---- state: each file keeps its own ----

LITERALS = re.compile(r"/\*.*?\*/|//[^\n]*|\"(?:[^\"\\\n]|\\.)*\"|'(?:[^'\\\n]|\\.)*'", re.S)
# A macro used on a line of its own at file scope (OC_EDGE_NOARGS(fn)).
MACRO_LINE = re.compile(r"\s*[A-Z][A-Z0-9_]*\([^\n]*\)[ \t]*\n")
ATTRIBUTE = re.compile(r"__attribute__\s*\(\((?:[^()]|\([^()]*\))*\)\)")
# The C library's own variables, which no file of the engine defines.
LIBC_VARIABLES = {"environ"}


def _code(text):
    """text as the compiler reads its declarations: no comments, string and
    character literals emptied, no preprocessor lines."""
    def blank(m):
        t = m.group(0)
        return '""' if t[0] == '"' else "''" if t[0] == "'" else "\n" * t.count("\n") or " "
    return re.sub(r"^[ \t]*#(?:[^\n]*\\\n)*[^\n]*", "", LITERALS.sub(blank, text), flags=re.M)


def _file_scope(code):
    """The declarations at file scope, each up to its ';' (brace groups
    included); function bodies are skipped."""
    out, depth, start, body = [], 0, 0, False
    for i, c in enumerate(code):
        if c == "{":
            if depth == 0:
                head = code[start:i]
                body = bool(re.search(r"\)\s*$", head)) and "=" not in head
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0 and body:
                start, body = i + 1, False
        elif c == ";" and depth == 0:
            out.append(code[start:i])
            start = i + 1
    return out


def _split_commas(decl):
    parts, depth, cur = [], 0, ""
    for c in decl:
        depth += c in "([" and 1 or c in ")]" and -1 or 0
        if c == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += c
    return parts + [cur]


def file_variables(text):
    """(name, declaration) for each variable declared at file scope, the
    declaration without its initialiser, in one line."""
    out = []
    for decl in _file_scope(_code(text)):
        while MACRO_LINE.match(decl):
            decl = decl[MACRO_LINE.match(decl).end():]
        while re.search(r"\{[^{}]*\}", decl):
            decl = re.sub(r"\{[^{}]*\}", " ", decl)
        decl = " ".join(ATTRIBUTE.sub("", decl).split("=")[0].split())
        if not decl or decl.startswith("typedef ") or re.fullmatch(r"(struct|union|enum)( \w+)?", decl):
            continue
        pointer = re.search(r"\(\s*\*\s*(\w+)", decl)
        if "(" in decl and (pointer is None or pointer.start() != decl.index("(")):
            continue  # a function's prototype
        if pointer is not None:  # a pointer to a function
            out.append((pointer.group(1), decl))
            continue
        for part in _split_commas(decl):
            out.append((re.search(r"(\w+)\s*(?:\[[^\]]*\]\s*)*$", part).group(1), decl))
    return out


def shared_state_problems(texts, header):
    """Where one C file could reach another's state other than through a
    function: a variable at file scope that is not static, an extern one in a
    C file, oc.h sharing anything but a method table, and every use of such a
    variable outside its own file."""
    problems, tables, shared = [], set(), {}
    for decl_name, decl in file_variables(header):
        if re.fullmatch(r"extern PyMethodDef \w+\[\]", decl):
            tables.add(decl_name)
        else:
            problems.append(f"oc.h: {decl}")
    for name, text in texts.items():
        for var, decl in file_variables(text):
            if re.match(r"(.* )?extern ", decl):
                if var not in LIBC_VARIABLES:
                    problems.append(f"{name}: {decl}")
            elif not re.match(r"(.* )?static ", decl) and var not in tables:
                shared[var] = name
                problems.append(f"{name}: {var} is not static")
    for name, text in texts.items():
        code = _code(text)
        problems += [f"{name} uses {home}'s {var}" for var, home in shared.items()
                     if home != name and re.search(rf"\b{var}\b", code)]
    return problems




def test_each_file_keeps_its_own_state():
    """Data follows the order calls do: no file names another's variable;
    what another file needs goes through a function of the lower file. The
    rule reads every file: each keeps state of its own, and the headers share
    only the method tables module.c gathers."""
    texts = {p.name: p.read_text() for p in C_FILES}
    header = "\n".join(p.read_text() for p in HEADERS)
    assert shared_state_problems(texts, header) == []
    owners = {name for name, text in texts.items() if file_variables(text)}
    assert {"common.c", "watcher.c", "bridge.c", "report.c", "summary.c", "api.c", "knownbugs.c",
            "frameworks.c", "platform.c", "oom.c"} <= owners, owners
    tables = [v for v, decl in file_variables(header) if "PyMethodDef" in decl]
    assert len(tables) == len(re.findall(r"^extern PyMethodDef ", header, re.M)) >= 10, tables


def test_state_rule_catches_violations():
    header = "extern PyMethodDef oc_a_methods[];\nextern int oc_count;\n"
    a = ("static int mine, *also;\nstatic struct {\n    int x;\n} own;\nint oc_count = 0;\n"
         "static const char text[] = \"{;\";\nenum { ONE, TWO };\nvoid f(void);\nOC_EDGE_NOARGS(f)\n"
         "static int (*hook)(void *);\nint start(void *(*fn)(void *));\n"
         "PyMethodDef oc_a_methods[] = {\n    {NULL, NULL, 0, NULL},\n};\n"
         "void f(void)\n{\n    static int scratch;\n    mine = own.x + scratch;\n}\n")
    b = ('extern int oc_hidden;\nvoid g(void)\n{\n    oc_count++; /* oc_count */\n'
         '    h("oc_count");\n}\n')
    assert sorted(shared_state_problems({"a.c": a, "b.c": b}, header)) == sorted([
        "oc.h: extern int oc_count", "a.c: oc_count is not static", "b.c: extern int oc_hidden",
        "b.c uses a.c's oc_count"])
    fixed = a.replace("int oc_count = 0;", "static int count;")
    assert shared_state_problems({"a.c": fixed, "b.c": "int g(void);\n"},
                                 "extern PyMethodDef oc_a_methods[];\n") == []
    assert [v for v, _ in file_variables(a)] == ["mine", "also", "own", "oc_count", "text",
                                                 "hook", "oc_a_methods"]


# ---- the edge: every C function CPython calls goes through a wrapper ----

# Slots that may stay bare: they cannot raise, so no interrupt can be handed
# back through them (src/oc_edge.h).
BARE_SLOTS = {"Py_tp_dealloc", "Py_tp_traverse", "Py_tp_clear", "Py_tp_free"}
# Slots that hold data or a table (whose entries are checked in their own right).
DATA_SLOTS = {"Py_tp_methods", "Py_tp_getset", "Py_tp_members", "Py_tp_doc", "Py_tp_base",
              "Py_tp_bases", "Py_mod_gil", "Py_mod_multiple_interpreters"}
SENTINELS = {"PyMethodDef": "{NULL, NULL, 0, NULL}",
             "PyGetSetDef": "{NULL, NULL, NULL, NULL, NULL}", "PyType_Slot": "{0, NULL}",
             "PyModuleDef_Slot": "{0, NULL}"}
EDGE_ENTRY = {"PyMethodDef": "OC_METHOD", "PyGetSetDef": "OC_GETTER", "PyType_Slot": "OC_SLOT",
              "PyModuleDef_Slot": "OC_SLOT"}


def _until(code, start, stop):
    """Index of the first `stop` character at bracket depth 0 from start,
    outside string and character literals."""
    depth, i = 0, start
    while i < len(code):
        c = code[i]
        if c in "\"'":
            j = i + 1
            while code[j] != c:
                j += 2 if code[j] == "\\" else 1
            i = j + 1
            continue
        if c in stop and depth == 0:
            return i
        depth += (c in "([{") - (c in ")]}")
        i += 1
    return i


def _split_top(text):
    """text split at its commas outside brackets and literals, each part stripped."""
    parts, i = [], 0
    while i < len(text):
        j = _until(text, i, ",")
        parts.append(text[i:j].strip())
        i = j + 1
    return [p for p in parts if p]


def _entries(code, kind):
    """(variable, entry) for every entry of every `kind name[] = {...}` table,
    and the initialiser of every `kind name = ...` in code."""
    for m in re.finditer(rf"\b{kind}\s+(\w+)\s*(\[\s*\])?\s*=\s*", code):
        init = code[m.end():_until(code, m.end(), ";")].strip()
        if m.group(2):
            for entry in _split_top(init[1:-1]):
                yield m.group(1), entry
        else:
            yield m.group(1), init


def edge_problems(text):
    """What CPython would call in a C file of the engine without the edge
    (src/oc_edge.h): a function or callback definition not made by OC_METHOD, a
    getter not by OC_GETTER, a type or module slot holding a function not by
    OC_SLOT (BARE_SLOTS aside), an export slot or a pending call that is not
    an edge_ wrapper, and a PyMethodDef built at run time."""
    code = _strip_comments(text)
    bad = []
    for kind, macro in EDGE_ENTRY.items():
        for name, entry in _entries(code, kind):
            flat = re.sub(r"\s+", " ", entry)
            slot = re.match(r"\{\s*(\w+)\s*,", flat)
            if (flat.startswith(macro + "(") or flat == SENTINELS[kind]
                    or ("Slot" in kind and slot and slot.group(1) in BARE_SLOTS | DATA_SLOTS)):
                continue
            bad.append(f"{name}: {flat[:60]}")
    for m in re.finditer(r"\bPySlot_FUNC\s*\(\s*\w+\s*,\s*(\w+)", code):
        if not m.group(1).startswith("edge_"):
            bad.append(f"PySlot_FUNC({m.group(1)})")
    for m in re.finditer(r"\bPy_AddPendingCall\s*\(\s*(\w+)", code):
        if not m.group(1).startswith("edge_"):
            bad.append(f"Py_AddPendingCall({m.group(1)})")
    for name, body in _functions(code):
        if re.search(r"\bml_(meth|flags)\b|\bPyMethodDef\s+\w+\s*[\[=;]", body):
            bad.append(f"{name}: a PyMethodDef built at run time")
    return bad


def misnamed_functions(text):
    """The C functions of method tables and callbacks (OC_METHOD) not named
    py_<name>: one convention for every C function Python calls."""
    return [f for f in re.findall(r"\bOC_METHOD\(\s*[^,]+,\s*(\w+)", _strip_comments(text))
            if not f.startswith("py_")]


def test_every_function_cpython_calls_goes_through_the_edge():
    """A Ctrl-C set aside while an engine function or callback runs is raised
    as it returns only through its edge_ wrapper (src/oc_edge.h); and CPython checks
    the arguments of a function only where its table entry carries the
    function's own calling convention, which OC_METHOD takes from the wrapper.
    Function objects are made only from the definitions checked here
    (PyModule_AddFunctions, PyCFunction_NewEx). The boot, a separate extension
    that never sets an interrupt aside, is not the engine."""
    engine = [p for p in C_FILES if p.name != "boot.c"]
    bad = [f"{p.name}: {b}" for p in engine for b in edge_problems(p.read_text())]
    assert not bad, "called around the edge:\n" + "\n".join(bad)
    misnamed = [f"{p.name}: {f}" for p in engine for f in misnamed_functions(p.read_text())]
    assert not misnamed, f"Python-facing C functions not named py_<name>: {misnamed}"
    code = "".join(_strip_comments(p.read_text()) for p in engine)
    counts = {"methods": len(re.findall(r"\bOC_METHOD\(", code)),
              "slots": len(re.findall(r"\bOC_SLOT\(", code)),
              "getters": len(re.findall(r"\bOC_GETTER\(", code)),
              "callbacks": len(re.findall(r"\bPyCFunction_NewEx\(", code)),
              "pending": len(re.findall(r"\bPy_AddPendingCall\(", code))}
    # The rule reads the tables: the engine has about fifty functions, the
    # loader proxy's slots and getter, the callbacks for torch and atexit.
    assert counts["methods"] >= 50 and counts["slots"] >= 6 and counts["getters"] >= 1, counts
    assert counts["callbacks"] >= 4 and counts["pending"] >= 1, counts
    makers = re.findall(r"\b(PyCFunction_New|PyCMethod_New|PyDescr_New\w*)\s*\(", code)
    assert not makers, f"function objects made from definitions the rule does not read: {makers}"


EDGE_GOOD = r"""
OC_EDGE_O(py_f)
static PyMethodDef t[] = {
    OC_METHOD("f", py_f, "f(x, /)\n--\n\nA, b; c {d}."),
    {NULL, NULL, 0, NULL},
};
static PyMethodDef cb = OC_METHOD("cb", py_cb, NULL);
static PyType_Slot s[] = {
    {Py_tp_dealloc, (void *)d},
    OC_SLOT(r),
    {Py_tp_methods, t},
    {0, NULL},
};
static PyGetSetDef g[] = {OC_GETTER("x", gx, NULL), {NULL, NULL, NULL, NULL, NULL}};
static PyModuleDef_Slot ms[] = {OC_SLOT(module_exec), {0, NULL}};
static int f(void)
{
    return Py_AddPendingCall(edge_later, NULL);
}
"""
EDGE_BARE = [
    'static PyMethodDef t[] = {\n    {"f", f, METH_O, "A, b."},\n    {NULL, NULL, 0, NULL},\n};\n',
    'static PyMethodDef cb = {"cb", cb, METH_NOARGS, NULL};\n',
    "static PyType_Slot s[] = {{Py_tp_repr, (void *)r}, {0, NULL}};\n",
    'static PyGetSetDef g[] = {{"x", gx, NULL, NULL, NULL}, {NULL, NULL, NULL, NULL, NULL}};\n',
    "static PyModuleDef_Slot ms[] = {{Py_mod_exec, (void *)module_exec}, {0, NULL}};\n",
    "static PySlot es[] = {PySlot_FUNC(Py_mod_exec, module_exec), PySlot_END};\n",
    "static int f(void)\n{\n    return Py_AddPendingCall(later, NULL);\n}\n",
    "static void f(PyMethodDef *def)\n{\n    def->ml_meth = g;\n}\n",
    "static PyObject *f(void)\n{\n    PyMethodDef d = {0};\n    return NULL;\n}\n",
]


def test_the_edge_rule_catches_violations():
    assert edge_problems(EDGE_GOOD) == []
    for text in EDGE_BARE:
        assert edge_problems(text), text
    assert misnamed_functions(EDGE_GOOD) == []
    assert misnamed_functions('OC_METHOD("status", oc_status, NULL),') == ["oc_status"]


def _table():
    """{name: row text} of src/settings.c's table."""
    return {m[1]: m[0] for m in re.finditer(r'^\s*\{"([A-Z][A-Z0-9_]*)", OC_SET_\w+,[^}]*\}',
                                            (SRC / "settings.c").read_text(), re.M | re.S)}


# The engine's functions whose argument at this index is a variable's name
# (asked_by: bridge.c's); any other name is written through OC_VAR()
# (src/oc_core.h).
VAR_TAKERS = {"oc_env": 0, "oc_env_rank": 0, "oc_config_off": 1, "oc_record_off": 1,
              "asked_by": 0}
STRING = r'"(?:[^"\\\n]|\\.)*"'
QUOTED = re.compile(rf"{STRING}|'(?:[^'\\\n]|\\.)*'")


def _call_args(code, fn):
    """(argument, its offset) lists of each call of fn in code, split at the
    commas outside brackets and quotes."""
    for m in re.finditer(rf"\b{fn}\s*\(", code):
        args, depth, i, start = [], 0, m.end(), m.end()
        while i < len(code):
            q = QUOTED.match(code, i)
            if q:
                i = q.end()
                continue
            c = code[i]
            if c in "([{":
                depth += 1
            elif c in ")]}" and depth:
                depth -= 1
            elif c in ")]}" or (c == "," and depth == 0):
                args.append((code[start:i], start))
                start = i + 1
                if c != ",":
                    break
            i += 1
        yield args


def variable_name_problems(texts, table):
    """texts: {file name: C source}; table: the names of the settings table.
    Every name a variable-name argument or OC_VAR() gives is in the table, a
    literal that is a table name is written as one of those, and getenv() is
    called only in settings.c (oc_env) and the boot (which links nothing of
    the engine). Returns (problems, names read)."""
    bad, named = [], set()
    for file, text in texts.items():
        code = _strip_comments(text)
        if file not in ("settings.c", "boot.c") and re.search(r"\bgetenv\s*\(", code):
            bad.append(f"{file}: getenv() outside settings.c's oc_env()")
        as_names = {}  # offset of a literal given as a name: the name
        for m in re.finditer(rf"\bOC_VAR\s*\(\s*({STRING})\s*\)", code):
            as_names[m.start(1)] = m[1][1:-1]
        for fn, index in VAR_TAKERS.items():
            for args in _call_args(code, fn):
                arg, at = args[index] if index < len(args) else ("", 0)
                if re.fullmatch(rf"\s*{STRING}\s*", arg):
                    as_names[at + len(arg) - len(arg.lstrip())] = arg.strip()[1:-1]
        bad += [f"{file}: {name} is not in src/settings.c's table"
                for name in as_names.values() if name not in table]
        named |= set(as_names.values())
        if file == "settings.c":  # the table's own rows
            as_names.update((m.start(1), m[1][1:-1])
                            for m in re.finditer(rf"^\s*\{{({STRING}), OC_SET_", code, re.M))
        bad += [f"{file}: {m[0]} written bare (OC_VAR() or a function that takes a name)"
                for m in re.finditer(STRING, code)
                if m[0][1:-1] in table and m.start() not in as_names]
    return bad, named


def test_the_environment_is_read_through_the_table():
    """Every read of the environment goes through oc_env() (src/settings.c),
    whose table names every variable; the boot, which links nothing of the
    engine, reads its own two, which must be in the table too. Each variable
    the loader does not parse into the configuration (no field) is read by
    its name somewhere: a row nothing reads would be stale."""
    table = _table()
    texts = {p.name: p.read_text() for p in C_FILES + HEADERS}
    problems, named = variable_name_problems(texts, table)
    assert not problems, "\n".join(problems)
    unread = {n for n, row in table.items() if "OC_NO_FIELD" in row} - named
    assert not unread, f"variables of the table that no code names: {unread}"
    assert {"OUTOFCUDA_DISABLE", "OUTOFCUDA_DEBUG", "LOCAL_RANK", "RANK"} <= named


def test_variable_name_rule_catches_violations():
    table = {"OUTOFCUDA_TF32", "LOCAL_RANK"}
    ok = ('int f(void)\n{\n    const char *v = oc_env("LOCAL_RANK"), *w = OC_VAR( "OUTOFCUDA_TF32");\n'
          '    if (oc_config_off(oc_config_get(), "OUTOFCUDA_TF32") || v == w)\n'
          '        oc_record_off(OC_OPT_TF32, "OUTOFCUDA_TF32");\n'
          '    return strcmp(w, "CUBLAS_STATUS_ALLOC_FAILED") + (int)oc_env_rank(name) + \',\';\n}\n')
    assert variable_name_problems({"a.c": ok}, table) == (
        [], {"LOCAL_RANK", "OUTOFCUDA_TF32"})
    for wrong in ('oc_env("LOCAL_RANKS")', 'OC_VAR("OUTOFCUDA_TF33")',
                  'oc_config_off(cfg, "OUTOFCUDA_TF3")', 'asked_by("TF32")',
                  'oc_record_off(OC_OPT_TF32, "OUTOFCUDA_F32")', 'x = "LOCAL_RANK"',
                  'strcmp(name, "OUTOFCUDA_TF32")', 'getenv(name)'):
        problems, _ = variable_name_problems({"a.c": f"int g(void)\n{{\n    {wrong};\n}}\n"},
                                             table)
        assert len(problems) == 1, (wrong, problems)
    assert not variable_name_problems({"settings.c": 'x = getenv(name);'}, table)[0]
    assert not variable_name_problems({"a.c": '/* "LOCAL_RANK" */'}, table)[0]
    # A "//" or "/*" inside a literal begins no comment: what follows is read.
    assert variable_name_problems({"a.c": 'int h(void)\n{\n    u = "https://x", v = "LOCAL_RANK";'
                                          '\n}\n'}, table)[0]
    assert bare_clears('static void f(void)\n{\n    g("a/*b");\n    PyErr_Clear();\n'
                       '    h("*/");\n}\n')
