"""The pure-C configuration parser and allocator merge (driven through the
extension's test entry points), and bad environment values end to end."""
import json
from pathlib import Path

import pytest

PARSE = """
import json, sys, _outofcuda
cases = json.loads(sys.stdin.read())
print(json.dumps([_outofcuda._parse_config(c) for c in cases]))
"""


def parse_many(venv, cases):
    r = venv.run(PARSE, input=json.dumps(cases))
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_defaults_match_the_product_table(venv):
    (c,) = parse_many(venv, [{}])
    assert c == {
        "disable": False, "verbose": False, "tf32": True, "cudnn_benchmark": True,
        "cudnn_deterministic": False, "channels_last": True, "compile": False,
        "compile_mode": "reduce-overhead", "compile_fullgraph": False, "amp_dtype": "auto",
        "memory_fraction": "auto",  # sized by the device's memory when CUDA starts
        # no max_split_size_mb beside expandable segments (pytorch issue 123548):
        # it joins only where they end up off
        "alloc_conf": "garbage_collection_threshold:0.8,expandable_segments:True",
        "alloc_conf_no_expandable": "max_split_size_mb:128", "framework_override": False,
        "gc_collect": True, "flash_attn": True, "mem_eff_attn": True, "math_attn": True,
        "pin_memory": True, "num_workers": 4, "prefetch_factor": 2, "warnings": [],
        "summary": "off", "known_bugs": True, "oom_keep_frames": False,
        "known_bugs_off": [],
    }


@pytest.mark.parametrize("word,value", [("1", True), ("0", False), ("TRUE", True), ("false", False),
                                        ("Yes", True), ("no", False), (" on ", True), ("OFF", False)])
def test_boolean_words(venv, word, value):
    (c,) = parse_many(venv, [{"OUTOFCUDA_TF32": word}])
    assert c["tf32"] is value and c["warnings"] == []


def test_every_bad_value_gets_one_named_warning_and_the_default(venv):
    cases = [
        {"OUTOFCUDA_MEMORY_FRACTION": "1.7"}, {"OUTOFCUDA_MEMORY_FRACTION": "abc"},
        {"OUTOFCUDA_MEMORY_FRACTION": "-0.5"}, {"OUTOFCUDA_MEMORY_FRACTION": "nan"},
        {"OUTOFCUDA_TF32": "maybe"}, {"OUTOFCUDA_TF32": " "}, {"OUTOFCUDA_TF32": "x" * 10240},
        {"OUTOFCUDA_NUM_WORKERS": "-1"}, {"OUTOFCUDA_NUM_WORKERS": "4.5"},
        {"OUTOFCUDA_PREFETCH_FACTOR": "-1"}, {"OUTOFCUDA_AMP_DTYPE": "float64"},
        {"OUTOFCUDA_COMPILE_MODE": "fast"}, {"OUTOFCUDA_ALLOC_CONF": "expandable_segments"},
        {"OUTOFCUDA_ALLOC_CONF": "a:b,,c:d"}, {"OUTOFCUDA_ALLOC_CONF": "x:[1,2"},
        {"OUTOFCUDA_FRAMEWORK_OVERRIDE": "sometimes"},
    ]
    (defaults,) = parse_many(venv, [{}])
    for case, c in zip(cases, parse_many(venv, cases)):
        (name, value), = case.items()
        assert len(c["warnings"]) == 1, case
        msg = c["warnings"][0]
        assert name in msg and "expected" in msg and len(msg) < 320
        assert f"{name}='{value[:20]}" in msg
        key = name[len("OUTOFCUDA_"):].lower()
        assert c[key] == defaults[key], case


def test_good_values_are_taken(venv):
    (c,) = parse_many(venv, [{
        "OUTOFCUDA_MEMORY_FRACTION": " 0.5 ", "OUTOFCUDA_NUM_WORKERS": "0",
        "OUTOFCUDA_AMP_DTYPE": "BF16", "OUTOFCUDA_COMPILE_MODE": "max-autotune",
        "OUTOFCUDA_ALLOC_CONF": "roundup_power2_divisions:[256:1,512:2,>:4],backend:native",
    }])
    assert c["memory_fraction"] == 0.5 and c["num_workers"] == 0
    assert c["amp_dtype"] == "bfloat16" and c["compile_mode"] == "max-autotune"
    assert c["alloc_conf"].startswith("roundup_power2_divisions:[256:1")
    assert c["alloc_conf_no_expandable"] == ""  # the user's string replaces every default
    assert c["warnings"] == []
    (c,) = parse_many(venv, [{"OUTOFCUDA_MEMORY_FRACTION": " Auto "}])
    assert c["memory_fraction"] == "auto" and c["warnings"] == []


OFF_WORDS = ["0", "off", "OFF", " none ", "False", "no"]


def test_every_setting_takes_the_same_off_words(venv):
    """Each OUTOFCUDA_* setting of the table takes every off word without a
    warning: a boolean (the known-bugs switch too) reads False, the summary "off", the worker count 0
    (torch's default), every other setting None (torch's own default)."""
    settings = venv.json("import json, _outofcuda; print(json.dumps(_outofcuda._settings()))")
    names = [s["name"] for s in settings if s["name"].startswith("OUTOFCUDA_")
             and s["kind"] not in ("text", "foreign")]
    assert len(names) >= 20, names
    cases = [{name: word} for name in names for word in OFF_WORDS]
    kinds = {s["name"]: s["kind"] for s in settings}
    for case, c in zip(cases, parse_many(venv, cases)):
        (name, _), = case.items()
        key = name[len("OUTOFCUDA_"):].lower()
        assert c["warnings"] == [], case
        if key not in c:  # read where it acts (OUTOFCUDA_DEBUG: oc_parse_bool)
            continue
        want = {"boolean": False, "known_bugs": False, "summary": "off"}.get(kinds[name], None)
        if name == "OUTOFCUDA_NUM_WORKERS":
            want = 0
        assert c[key] == want, (case, c[key])
        if name == "OUTOFCUDA_ALLOC_CONF":
            assert c["alloc_conf_no_expandable"] == ""  # no default joins either
    # The setting's own values come first: 0 workers is the number 0.
    (c,) = parse_many(venv, [{"OUTOFCUDA_NUM_WORKERS": "0", "OUTOFCUDA_MEMORY_FRACTION": "1"}])
    assert c["num_workers"] == 0 and c["memory_fraction"] == 1.0


def test_a_bad_value_names_the_off_words(venv):
    (c,) = parse_many(venv, [{"OUTOFCUDA_MEMORY_FRACTION": "1.7"}])
    assert "0, off, false, no or none" in c["warnings"][0]


def test_framework_override_is_a_boolean(venv):
    got = parse_many(venv, [{"OUTOFCUDA_FRAMEWORK_OVERRIDE": "1"},
                            {"OUTOFCUDA_FRAMEWORK_OVERRIDE": "off"}, {}])
    assert [c["framework_override"] for c in got] == [True, False, False]


MERGE = """
import json, sys, _outofcuda
out = []
for args in json.loads(sys.stdin.read()):
    try:
        out.append(list(_outofcuda._merge_alloc_conf(*args)))
    except ValueError as exc:
        out.append(str(exc))
print(json.dumps(out))
"""
DEFAULTS = "garbage_collection_threshold:0.8,expandable_segments:True"
NO_EXPANDABLE = "max_split_size_mb:128"


def merge_many(venv, cases):
    r = venv.run(MERGE, input=json.dumps(cases))
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_merge_user_keys_win_key_by_key(venv):
    got = merge_many(venv, [
        [DEFAULTS, ""],
        [DEFAULTS, "expandable_segments:False", None, NO_EXPANDABLE],
        [DEFAULTS, " max_split_size_mb : 512 , backend:cudaMallocAsync"],
        [DEFAULTS, "roundup_power2_divisions:[256:1,512:2,>:4]"],
        [DEFAULTS, "max_split_size_mb:1,max_split_size_mb:2"],
        [DEFAULTS, "", "2.0.1+cu118", NO_EXPANDABLE],
        [DEFAULTS, "", "2.1.0", NO_EXPANDABLE],
        [DEFAULTS + ",per_process_memory_fraction:0.9", "", "2.9.1"],
        [DEFAULTS + ",per_process_memory_fraction:0.9", "", "2.11.0"],
        [DEFAULTS, "max_split_size_mb:512,expandable_segments:True", None, NO_EXPANDABLE],
        [DEFAULTS, "expandable_segments:False"],
    ])
    assert got[0] == [DEFAULTS, ""]
    # expandable segments off: max_split_size_mb:128 joins
    assert got[1] == ["expandable_segments:False,garbage_collection_threshold:0.8,"
                      "max_split_size_mb:128", ""]
    # the user's max_split_size_mb: the defaults' expandable segments stay out
    assert got[2] == ["max_split_size_mb:512,backend:cudaMallocAsync,"
                      "garbage_collection_threshold:0.8", ""]
    assert got[3][0] == "roundup_power2_divisions:[256:1,512:2,>:4]," + DEFAULTS
    assert got[4][0].startswith("max_split_size_mb:2,") and got[4][0].count("max_split") == 1
    # 2.0 has no expandable segments: max_split_size_mb:128 applies there
    assert got[5] == ["garbage_collection_threshold:0.8,max_split_size_mb:128",
                      "expandable_segments"]
    assert got[6] == [DEFAULTS, ""]
    assert got[7] == [DEFAULTS, "per_process_memory_fraction"]
    assert got[8] == [DEFAULTS + ",per_process_memory_fraction:0.9", ""]
    # a combination the user wrote is kept
    assert got[9] == ["max_split_size_mb:512,expandable_segments:True,"
                      "garbage_collection_threshold:0.8", ""]
    assert got[10] == ["expandable_segments:False,garbage_collection_threshold:0.8", ""]


def test_merge_keeps_the_keys_each_release_was_recorded_to_parse(venv):
    # A default key joins on the releases whose parser knows it (the records,
    # tests/releases.json) and is dropped on the others.
    from fake_torch import RECORDS
    from test_gating import KNOWN_KEYS
    cases = [[f"{k}:{'native' if k == 'backend' else 1}", "", f"{series}.0"]
             for series in RECORDS["releases"] for k in KNOWN_KEYS]
    got = [not dropped for _, dropped in merge_many(venv, cases)]
    assert got == [k in RECORDS["releases"][s]["allocator_keys"]
                   for s in RECORDS["releases"] for k in KNOWN_KEYS]


def test_merge_rejects_malformed_strings(venv):
    got = merge_many(venv, [[DEFAULTS, "nocolon"], [DEFAULTS, "a:[1"], [DEFAULTS, "a:1]"],
                            [DEFAULTS, "A:1"], [DEFAULTS, "a:1;rm"], [DEFAULTS, "k:" + "9" * 300]])
    assert all(isinstance(g, str) and g.startswith("bad allocator configuration") for g in got)


def test_allocator_strings_are_read_by_the_engine(venv):
    """The doctor reads allocator strings through the engine (one parser and one
    max_split_size_mb rule with the merge), and the variables in torch's order."""
    got = venv.json("""
import json, _outofcuda
out = [_outofcuda._alloc_items(c) for c in (
    "", " max_split_size_mb : 512 , backend:cudaMallocAsync,max_split_size_mb:64",
    "roundup_power2_divisions:[256:1,>:4],expandable_segments:True",
    "max_split_size_mb:128,expandable_segments:True", "max_split_size_mb:128,expandable_segments:False")]
try:
    _outofcuda._alloc_items("a:[1")
except ValueError as exc:
    out.append(str(exc))
out.append(_outofcuda._alloc_vars())
print(json.dumps(out))
""")
    assert got[0] == [[], None]
    assert got[1] == [[["max_split_size_mb", "64"], ["backend", "cudaMallocAsync"]],
                      "no_expandable"]
    assert got[2] == [[["roundup_power2_divisions", "[256:1,>:4]"],
                       ["expandable_segments", "True"]], None]
    assert got[3][1] == "inside_expandable" and got[4][1] is None
    assert got[5].startswith("bad allocator configuration")
    assert got[6] == ["PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF", "PYTORCH_ALLOC_CONF"]


def test_bad_environment_values_end_to_end(venv, workdir):
    r = venv.run("""
import torch, _outofcuda, json
print(json.dumps(_outofcuda.status()))
print(torch.backends.cudnn.benchmark, torch.backends.cuda.flash_sdp_enabled())
""", env={"OUTOFCUDA_MEMORY_FRACTION": "1.7", "OUTOFCUDA_TF32": "maybe",
          "OUTOFCUDA_NUM_WORKERS": "x" * 10240}, cwd=workdir)
    assert r.returncode == 0, r.stderr
    warnings = [ln for ln in r.stderr.splitlines() if "UserWarning" in ln]
    assert len(warnings) == 3
    assert any("OUTOFCUDA_MEMORY_FRACTION='1.7'" in w for w in warnings)
    assert any("OUTOFCUDA_TF32='maybe'" in w for w in warnings)
    st = json.loads(r.stdout.splitlines()[0])
    assert len(st["config_warnings"]) == 3
    # The defaults were used (TF32 on, not off), and on this CPU-only build
    # every flag stays torch's default for that reason alone.
    assert r.stdout.splitlines()[1] == "False True"
    for name in ("tf32", "cudnn_benchmark", "sdpa"):
        assert st["optimizations"][name]["code"] == "no_cuda", name


NAMES = ["OUTOFCUDA_DISABLE", "OUTOFCUDA_VERBOSE", "OUTOFCUDA_TF32", "OUTOFCUDA_CUDNN_BENCHMARK",
         "OUTOFCUDA_CUDNN_DETERMINISTIC", "OUTOFCUDA_CHANNELS_LAST", "OUTOFCUDA_COMPILE",
         "OUTOFCUDA_COMPILE_MODE", "OUTOFCUDA_COMPILE_FULLGRAPH", "OUTOFCUDA_AMP_DTYPE",
         "OUTOFCUDA_MEMORY_FRACTION", "OUTOFCUDA_ALLOC_CONF", "OUTOFCUDA_GC_COLLECT",
         "OUTOFCUDA_FLASH_ATTN", "OUTOFCUDA_MEM_EFF_ATTN", "OUTOFCUDA_MATH_ATTN",
         "OUTOFCUDA_PIN_MEMORY", "OUTOFCUDA_NUM_WORKERS", "OUTOFCUDA_PREFETCH_FACTOR",
         "OUTOFCUDA_SUMMARY"]


def test_empty_value_means_unset(venv, workdir):
    """`OUTOFCUDA_X=` is "not set": the default, silently, for every variable."""
    (defaults, empty) = parse_many(venv, [{}, {name: "" for name in NAMES}])
    assert empty == defaults
    env = {name: "" for name in NAMES + ["OUTOFCUDA_OOM_SNAPSHOT"]}
    r = venv.run("import torch, _outofcuda; print(_outofcuda.status()['hook']['fired'])",
                 env=env, cwd=workdir)
    assert r.returncode == 0 and r.stdout.split() == ["True"], r.stderr
    assert r.stderr == ""


RECORD_WARNINGS = """
import json, warnings
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    import torch
print(json.dumps([{"category": w.category.__name__, "user": issubclass(w.category, UserWarning),
                   "filename": w.filename, "lineno": w.lineno, "message": str(w.message)}
                  for w in caught]))
"""


def _bad_bytes_env(tmp):
    # Lone surrogates become the raw bytes 0xff/0xfe in the child's environment
    # (os.fsencode): values that are not UTF-8.
    return {"OUTOFCUDA_OOM_SNAPSHOT": f"{tmp}/missing\udcff/oom.pickle",
            "OUTOFCUDA_TF32": "maybe\udcfe"}


def test_warnings_are_filterable_entries_with_readable_text(venv, workdir):
    """Each warning, non-UTF-8 values included, is a real `warnings` entry of
    the module "outofcuda" at the program's line (not importlib's), with the bad bytes
    shown as \\xNN; nothing reaches stderr on its own."""
    r = venv.run(RECORD_WARNINGS, env=_bad_bytes_env(workdir), cwd=workdir)
    assert r.returncode == 0, r.stderr
    assert r.stderr == ""
    caught = [w for w in json.loads(r.stdout) if w["message"].startswith("outofcuda")]
    texts = [w["message"] for w in caught]
    assert len(caught) == 2, texts
    # located at the program's `import torch` (line 5 of RECORD_WARNINGS), not
    # at importlib's bootstrap nor at a made-up "outofcuda:0"
    assert all(w["user"] and (w["filename"], w["lineno"]) == ("<string>", 5)
               for w in caught), caught
    assert any("OUTOFCUDA_TF32='maybe\\xfe'" in t for t in texts), texts
    assert any("OUTOFCUDA_OOM_SNAPSHOT=" in t and "missing\\xff" in t for t in texts), texts


def test_warnings_filtered_by_module_leave_stderr_clean(venv, workdir):
    env = _bad_bytes_env(workdir)
    shown = venv.run("import torch", env=env, cwd=workdir)
    assert shown.returncode == 0
    lines = shown.stderr.splitlines()
    assert len(lines) == 2 and all(ln.startswith("<string>:1: UserWarning: outofcuda: ")
                                   for ln in lines), shown.stderr
    assert "\\xff" in shown.stderr and "\\xfe" in shown.stderr
    quiet = venv.run("import torch, _outofcuda; print(len(_outofcuda.status()['config_warnings']))",
                     args=["-W", "ignore:::outofcuda"], env=env, cwd=workdir)
    assert quiet.returncode == 0 and quiet.stderr == "", quiet.stderr
    assert quiet.stdout.split() == ["1"]


@pytest.mark.parametrize("word,value", [("0", False), ("off", False), ("1", True), ("", True)])
def test_known_bugs_switch(venv, word, value):
    (c,) = parse_many(venv, [{"OUTOFCUDA_KNOWN_BUGS": word}])
    assert c["known_bugs"] is value and c["warnings"] == []


def _known_bug_ids(venv):
    r = venv.run("import json, _outofcuda; "
                 "print(json.dumps([b['id'] for b in _outofcuda.status()['known_bugs']]))")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_known_bugs_bad_value_warns_and_keeps_the_guard(venv):
    (c,) = parse_many(venv, [{"OUTOFCUDA_KNOWN_BUGS": "maybe"}])
    assert c["known_bugs"] is True and c["known_bugs_off"] == []
    assert len(c["warnings"]) == 1 and "'maybe' in OUTOFCUDA_KNOWN_BUGS" in c["warnings"][0]


def test_known_bugs_takes_the_ids_of_rows_to_turn_off(venv):
    """A list of row ids (src/kbtable.c) turns those rows off, the others
    stay on."""
    good, spaced = parse_many(venv, [
        {"OUTOFCUDA_KNOWN_BUGS": "tf32-mixed-api"},
        {"OUTOFCUDA_KNOWN_BUGS": " cudnn-sdpa-nan-grad-sm90 , alloc-conf-generic-ignored"}])
    assert good["known_bugs"] is True and good["known_bugs_off"] == ["tf32-mixed-api"]
    assert spaced["known_bugs_off"] == ["cudnn-sdpa-nan-grad-sm90", "alloc-conf-generic-ignored"]
    assert good["warnings"] == spaced["warnings"] == []


@pytest.mark.parametrize("value,off,named", [
    ("tf32-mixed-api,cudnn-sdpa-nan-grad", ["tf32-mixed-api"], "cudnn-sdpa-nan-grad"),
    ("cudnn-sdpa-nan-grad-sm9, torchrun-gpu0-context,fsdp2", ["torchrun-gpu0-context"],
     "cudnn-sdpa-nan-grad-sm9,fsdp2"),
    ("tf32-mixed-api,", ["tf32-mixed-api"], ""),
    (",", [], ","),
    # a terminal gets no escape sequence and no text turned right to left
    ("tf32-mixed-api,\x1b[2J\u202eirg", ["tf32-mixed-api"], "\\x1b[2J\\u202eirg"),
])
def test_a_misspelt_known_bug_id_is_named_and_the_others_still_turn_off(venv, value, off, named):
    """An entry that is no row id leaves the rows the list does name off
    (a typo must not undo the rest of the list), and gets one warning that
    names the entry, escaped, and every id of the table (the off words once)."""
    (c,) = parse_many(venv, [{"OUTOFCUDA_KNOWN_BUGS": value}])
    assert (c["known_bugs"], c["known_bugs_off"]) == (True, off)
    (w,) = c["warnings"]
    assert f"'{named}' in OUTOFCUDA_KNOWN_BUGS" in w, w
    ids = _known_bug_ids(venv)
    assert len(ids) >= 8 and w.endswith(": " + ", ".join(ids)), w
    assert w.count("on/off") == 1 and "no or none" not in w, w
    assert "\x1b" not in w and "\u202e" not in w


# ---- the one table of variables (src/settings.c) ----

ENVIRONMENT_DOC = Path(__file__).resolve().parent.parent / "docs" / "environment.md"


def _doc_rows(header):
    """{first column: second column} of docs/environment.md's table under `header`."""
    lines = ENVIRONMENT_DOC.read_text().splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith(header))
    rows = {}
    for ln in lines[start + 2:]:
        if not ln.startswith("|"):
            break
        cells = [c.strip() for c in ln.strip("|").split("|")]
        rows[cells[0].strip("`")] = cells[1].strip("`")
    return rows


def test_docs_list_exactly_the_variables_of_the_table(venv, workdir):
    r = venv.check("import json, _outofcuda; print(json.dumps(_outofcuda._settings()))",
                   cwd=workdir)
    table = json.loads(r.stdout)
    own = {s["name"]: s for s in table if s["kind"] != "foreign"}
    foreign = {s["name"] for s in table if s["kind"] == "foreign"}
    rows = _doc_rows("| variable | default | meaning |")
    assert set(rows) == set(own), (set(rows) ^ set(own))
    for name, s in own.items():
        assert rows[name] == (s["default"] if s["default"] is not None else "unset"), name
    assert set(_doc_rows("| variable | what outofcuda does with it |")) == foreign
    # The words a word setting takes come from the table too (compile_model checks its mode
    # against them); other kinds have none.
    words = {s["name"]: s["words"] for s in table}
    assert words["OUTOFCUDA_COMPILE_MODE"] == ["default", "reduce-overhead", "max-autotune",
                                               "max-autotune-no-cudagraphs"]
    assert words["OUTOFCUDA_TF32"] is None
    # config() shows every setting the loader parses, from the same table.
    cfg = json.loads(venv.check("import json, _outofcuda; print(json.dumps(_outofcuda.config()))",
                                cwd=workdir).stdout)
    loaded = {k for k in cfg if k not in ("warnings", "alloc_conf_no_expandable",
                                          "known_bugs_off")}
    assert {f"OUTOFCUDA_{k.upper()}" for k in loaded} <= set(own)


def test_a_misspelt_variable_warns_naming_the_closest(venv, workdir):
    """OUTOFCUDA_TF23=0 is a typo of OUTOFCUDA_TF32: silence would leave TF32
    on while the user believes it off. The names come from the table."""
    env = {"OUTOFCUDA_TF23": "0", "OUTOFCUDA_NO_SUCH_THING_AT_ALL": "1",
           # the build's and the test harness's own: never read at run time, never warned about
           "OUTOFCUDA_BUILD_WERROR": "1", "OUTOFCUDA_TEST_VENV": "/nowhere"}
    r = venv.run("import torch, _outofcuda, json; "
                 "print(json.dumps(_outofcuda.status()['config_warnings']))", env=env, cwd=workdir)
    assert r.returncode == 0, r.stderr
    warnings = json.loads(r.stdout)
    assert ("outofcuda: ignoring OUTOFCUDA_TF23: not a variable outofcuda reads; did you mean "
            "OUTOFCUDA_TF32?") in warnings
    assert ("outofcuda: ignoring OUTOFCUDA_NO_SUCH_THING_AT_ALL: not a variable outofcuda reads"
            in warnings)
    assert "did you mean OUTOFCUDA_TF32?" in r.stderr
    assert len(warnings) == 2 and "BUILD_" not in r.stderr and "TEST_" not in r.stderr, warnings
    doctor = venv.run(None, args=("-m", "outofcuda", "doctor"), env=env, cwd=workdir)
    assert "did you mean OUTOFCUDA_TF32?" in " ".join(doctor.stdout.split()), doctor.stdout
