"""Fuzzing the pure-C configuration code, and property tests that drive
arbitrary OUTOFCUDA_* values through a fresh interpreter.

test_libfuzzer_session builds fuzz/fuzz_config and fuzz/fuzz_allocconf with
clang (libFuzzer + ASan + UBSan, no Python linked), starts each from a copy of
its seed corpus in fuzz/corpus and runs both at once (two cores): at least one
million executions in total and no finding. No limit on how long that takes,
beyond a generous timeout that only guards against a hang."""
import json
import os
import re
import shutil
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import wait_for_setup
from kit import oc_headers

ROOT = Path(__file__).resolve().parent.parent
# A warning fits the engine's buffer for one (src/oc_core.h).
WARN_LEN = int(re.search(r"#define OC_WARN_LEN (\d+)", oc_headers())[1])
FUZZ = ROOT / "fuzz"
# Executions per target: config runs ~10x faster than the allocator merge.
RUNS = {"fuzz_config": 750_000, "fuzz_allocconf": 300_000}
HANG_GUARD_S = 900


def _require(name, how):
    wait_for_setup("tools")
    if shutil.which(name) is None:
        if os.environ.get("CI"):
            pytest.fail(f"{name} is required in CI ({how})")
        pytest.skip(f"{name} is not installed ({how})")


@pytest.fixture(scope="module")
def fuzzers(tmp_path_factory):
    _require("clang", "apt-get install clang libclang-rt-14-dev")
    out = tmp_path_factory.mktemp("fuzzers")
    r = subprocess.run([str(FUZZ / "build.sh"), str(out)], capture_output=True, text=True,
                       timeout=300)
    if r.returncode != 0 and "libclang_rt.fuzzer" in r.stderr and not os.environ.get("CI"):
        pytest.skip("clang's libFuzzer runtime is missing (apt-get install libclang-rt-14-dev)")
    assert r.returncode == 0, r.stderr
    return out


def _fuzz(binary, corpus_src, runs, work):
    """Runs one fuzzer from a copy of its seed corpus (libFuzzer writes new
    inputs into the corpus directory: the checked-in seeds stay untouched)."""
    corpus = work / (binary.name + "-corpus")
    shutil.copytree(corpus_src, corpus)
    cmd = [str(binary), f"-runs={runs}", "-max_len=2048",
           "-timeout=10", "-rss_limit_mb=1024", "-print_final_stats=1",
           f"-artifact_prefix={work}/{binary.name}-", str(corpus)]
    t0 = time.monotonic()
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=HANG_GUARD_S,
                       env={**os.environ, "ASAN_OPTIONS": "detect_leaks=1:abort_on_error=0",
                            "UBSAN_OPTIONS": "print_stacktrace=1:halt_on_error=1"})
    elapsed = time.monotonic() - t0
    m = re.search(r"stat::number_of_executed_units:\s*(\d+)", r.stderr)
    return r, (int(m.group(1)) if m else 0), elapsed


def test_libfuzzer_session(fuzzers, tmp_path):
    jobs = [(fuzzers / name, FUZZ / "corpus" / name.replace("fuzz_", ""), runs)
            for name, runs in RUNS.items()]
    t0 = time.monotonic()
    with ThreadPoolExecutor(max_workers=len(jobs)) as pool:
        results = list(pool.map(lambda j: _fuzz(*j, tmp_path), jobs))
    wall = time.monotonic() - t0
    total = 0
    for (binary, _, runs), (r, execs, elapsed) in zip(jobs, results):
        crashes = list(tmp_path.glob(binary.name + "-*"))
        assert r.returncode == 0 and not [c for c in crashes if c.is_file()], (
            f"{binary.name} found a problem (artifacts: {crashes}):\n{r.stderr[-6000:]}")
        assert execs == runs, f"{binary.name}: {execs} of {runs} executions in {elapsed:.0f} s"
        total += execs
        print(f"{binary.name}: {execs} executions in {elapsed:.1f} s")
    print(f"total: {total} executions in {wall:.1f} s")
    assert total >= 1_000_000


@pytest.mark.parametrize("target", sorted(RUNS))
def test_seed_corpus_replays_clean(fuzzers, target):
    """Every checked-in seed runs through its target without a finding (and
    the corpus is not empty, so the session never starts from nothing)."""
    seeds = sorted((FUZZ / "corpus" / target.replace("fuzz_", "")).iterdir())
    assert len(seeds) >= 5
    r = subprocess.run([str(fuzzers / target), *map(str, seeds)], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr[-4000:]


def test_fuzzer_detects_a_broken_invariant(fuzzers, tmp_path):
    """The harness can fail: the config target rebuilt with an invariant that
    the defaults break (fraction < 0.96, while the default is auto, held
    as -1) must report a crash on its first input."""
    src = tmp_path / "broken.c"
    text = (FUZZ / "fuzz_config.c").read_text()
    good = (": !(c->memory_fraction == OC_FRACTION_AUTO ||\n"
            "                (c->memory_fraction > 0.0 && c->memory_fraction <= 1.0)))")
    assert good in text
    src.write_text(text.replace(good, ": c->memory_fraction < 0.96)").replace(
        '#include "../src/oc.h"', f'#include "{ROOT}/src/oc.h"'))
    exe = tmp_path / "broken"
    b = subprocess.run(["clang", "-std=c11", "-O1", "-DOC_PURE_C=", "-D_GNU_SOURCE",
                        "-fsanitize=fuzzer,address", "-o", str(exe), str(src),
                        str(ROOT / "src" / "config.c"), str(ROOT / "src" / "allocconf.c"),
                        str(ROOT / "src" / "settings.c"), str(ROOT / "src" / "kbtable.c"),
                        "-lm"],
                       capture_output=True, text=True, timeout=120)
    assert b.returncode == 0, b.stderr
    seed = FUZZ / "corpus" / "config" / "defaults"
    r = subprocess.run([str(exe), f"-artifact_prefix={tmp_path}/", str(seed)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "deadly signal" in r.stderr, r.stderr[-2000:]


# ---- property tests: arbitrary environment values, fresh interpreter ----

def _loader_names():
    """The variables of the settings table (src/settings.c) that the loader
    parses into the configuration (those with a field)."""
    text = (ROOT / "src" / "settings.c").read_text()
    return [m.group(1) for m in re.finditer(r'\{"(OUTOFCUDA_\w+)",[^}]*?\}', text, re.S)
            if "OC_NO_FIELD" not in m.group(0)]


NAMES = _loader_names()
# Anything an environment can hold: no NUL, no lone surrogates.
ANY_TEXT = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"),
                   max_size=80)
NEAR_VALID = st.sampled_from([
    "1", "0", " TRUE ", "off", "yes\n", "2", "-1", "0.5", "1.0000001", "nan", "inf", "1e-300",
    "bf16", "FLOAT16", "reduce-overhead", "max-autotune ", "1024", "1025", "  7 ",
    "expandable_segments:True", "max_split_size_mb:64,backend:cudaMallocAsync",
    "roundup_power2_divisions:[256:1,>:4]", "foo:1", "a:[", ",", "x" * 5000,
    "__import__('os').system('id')", "$(id)", "/tmp/libx.so",
])
ENVS = st.dictionaries(st.sampled_from(NAMES), st.one_of(ANY_TEXT, NEAR_VALID), max_size=6)

CHILD_CONFIG = """
import json, os
import _outofcuda
cfg = _outofcuda.config()
ref = _outofcuda._parse_config({k: v for k, v in os.environ.items() if k.startswith("OUTOFCUDA_")})
print(json.dumps({"cfg": cfg, "ref": ref}))
"""

CHILD_TORCH = """
import json, torch, _outofcuda
x = torch.ones(3, 3) @ torch.ones(3, 3)
print(json.dumps({"status": _outofcuda.status(), "cfg": _outofcuda.config(), "sum": float(x.sum())}))
"""

BAD_STDERR = ("Traceback", "Error processing line", "Fatal Python error", "Segmentation",
              "AddressSanitizer", "core dumped")


OFF_WORDS = {"0", "off", "false", "no", "none"}


def _check_config(cfg, env):
    # None: the setting was turned off by an off word (torch's own default).
    def off(key):
        if cfg[key] is not None:
            return False
        assert env.get(f"OUTOFCUDA_{key.upper()}", "").strip().lower() in OFF_WORDS, (key, env)
        return True
    assert off("memory_fraction") or cfg["memory_fraction"] == "auto" or (
        0 < cfg["memory_fraction"] <= 1)
    assert 0 <= cfg["num_workers"] <= 1024
    assert off("prefetch_factor") or 1 <= cfg["prefetch_factor"] <= 1024
    assert off("amp_dtype") or cfg["amp_dtype"] in ("auto", "float16", "bfloat16")
    assert off("compile_mode") or cfg["compile_mode"] in (
        "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
    assert len(cfg["warnings"]) <= len(env)
    for w in cfg["warnings"]:
        # A value (`ignoring NAME=...`) or an entry of the known-bugs list.
        m = re.match(r"outofcuda: ignoring (?:(OUTOFCUDA_[A-Z0-9_]+)=|.* in (OUTOFCUDA_KNOWN_BUGS): )",
                     w, re.S)
        assert len(w) < WARN_LEN and m, w
        assert (m[1] or m[2]) in env, w


@settings(max_examples=40, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(env=ENVS)
def test_property_config_from_environment(venv, env):
    """Whatever the values: the interpreter starts, the real environment and
    the dict parser agree, every value stays in range, and each warning names
    a variable that was set."""
    r = venv.run(CHILD_CONFIG, env=env, timeout=60)
    assert r.returncode == 0, r.stderr
    assert not any(s in r.stderr for s in BAD_STDERR), r.stderr
    out = json.loads(r.stdout)
    assert out["cfg"] == out["ref"]
    _check_config(out["cfg"], env)


@settings(max_examples=6, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(env=ENVS)
def test_property_import_torch_survives(venv, env, tmp_path_factory):
    """Whatever the values: `import torch` works, torch computes, the hook
    records no error, and nothing is left in the working directory."""
    cwd = tmp_path_factory.mktemp("prop")
    r = venv.run(CHILD_TORCH, env=env, cwd=cwd, timeout=120)
    assert r.returncode == 0, r.stderr
    assert not any(s in r.stderr for s in BAD_STDERR), r.stderr
    out = json.loads(r.stdout)
    assert out["sum"] == 27.0
    disabled = out["cfg"]["disable"]
    assert out["status"]["hook"]["error"] is None
    assert out["status"]["hook"]["fired"] is (not disabled)
    _check_config(out["cfg"], env)
    assert list(cwd.iterdir()) == []
