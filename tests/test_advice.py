"""The ranked advice in pure C (src/advice.c, no Python): the OOM actions
oc_oom_advise ranks for the report, and the exit summary's hints
(oc_summary_hints). tests/advice/driver.c is built with gcc under ASan and
UBSan and fed figures; each case checks the ranking and the scores."""
import pytest

from conftest import pure_c_driver

MiB, GiB = 1 << 20, 1 << 30


@pytest.fixture(scope="module")
def advise(tmp_path_factory):
    build = pure_c_driver(tmp_path_factory.mktemp("advice"), "advice/driver.c", "advice.c")

    def run(*cases):
        out, items = [], []
        for line in build(cases).splitlines():
            if line == "--":
                out.append(items)
                items = []
            else:
                score, order, text = line.split(" ", 2)
                items.append((float(score), int(order), text))
        assert len(out) == len(cases), out
        return out
    return run


def oom(request=0, total=0, limit=0, allocated=0, reserved=0, inactive_split=0, fraction=0.0,
        expandable=0, autocast=-1, exhausted=0, others=(), wsl=False):
    flat = [x for o in others for x in o]
    return ("oom wsl" if wsl else "oom", request, total, limit, allocated, reserved,
            inactive_split, fraction, expandable, autocast, exhausted, len(others), *flat)


def hints(util_samples=0, util_sum=0.0, under_low=0, mem_samples=0, mem_peak=0, mem_total=0,
          peak_allocated=-1, peak_reserved=-1, workers=-1, expandable=0, wsl=False,
          frames=0, waits=0, paired=0, paired_low=0, cpus=8, suggested=8):
    return ("hints wsl" if wsl else "hints", util_samples, util_sum, under_low, mem_samples,
            mem_peak, mem_total, peak_allocated, peak_reserved, workers, expandable,
            frames, waits, paired, paired_low, cpus, suggested)


def heads(items):
    return [text.split(" ", 3)[:3] for _, _, text in items]


# ---- OOM actions ----

def test_oom_actions_ranked_by_the_bytes_each_gives_back(advise):
    [items] = advise(oom(request=1 * GiB, total=80 * GiB, allocated=40 * GiB,
                         reserved=60 * GiB, fraction=0.5, autocast=0,
                         others=[(4242, "python", 8 * GiB)]))
    texts = [t for _, _, t in items]
    assert [s for s, _, _ in items] == [40 * GiB, 20 * GiB, 20 * GiB, 40 * GiB // 3, 8 * GiB]
    assert texts[0].startswith("The memory fraction 0.50 keeps 40.00 GiB of this GPU")
    # 20 GiB each: the tie goes to the rule written first (fragmentation).
    assert texts[1].startswith("20.00 GiB is reserved by PyTorch but not allocated")
    assert texts[2].startswith("This process's tensors hold 40.00 GiB: train with "
                               "outofcuda.auto_microbatch(step)")
    assert texts[3].startswith("Autocast is off")
    assert texts[4] == ("Another process holds 8.00 GiB on this GPU: pid 4242 (python). Stop it, "
                        "or run on a free GPU (CUDA_VISIBLE_DEVICES).")


def test_oom_small_processes_are_left_out_and_unknown_names_said(advise):
    [items] = advise(oom(request=100 * MiB, total=16 * GiB, allocated=12 * GiB,
                         others=[(1, "small", 255 * MiB), (2, "-", 1023 * MiB)]))
    assert [t for _, _, t in items][0].startswith(
        "This process's tensors hold 12.00 GiB")
    assert items[1][2].startswith("Another process holds 1023 MiB on this GPU: pid 2 "
                                  "(name unknown)")
    assert len(items) == 2


def test_oom_with_expandable_segments_counts_fragmentation_a_quarter(advise):
    [on, off] = advise(oom(request=1 * GiB, total=80 * GiB, allocated=8 * GiB,
                           reserved=48 * GiB, expandable=1),
                       oom(request=1 * GiB, total=80 * GiB, allocated=8 * GiB,
                           reserved=48 * GiB, expandable=0))
    assert on[0][0] == 10 * GiB and on[0][2].startswith(
        "40.00 GiB is reserved but not allocated even with expandable segments")
    assert off[0][0] == 40 * GiB and "expandable_segments:True" in off[0][2]
    # A process holding under half the GPU: the micro-batch action scores half the request.
    assert on[1][0] == off[1][0] == GiB // 2


def test_where_expandable_segments_cannot_work_no_advice_names_them(advise):
    # WSL (src/platform.c): fragmentation is still said, with the cure that works there
    [oom_off, oom_on, summary] = advise(
        oom(request=1 * GiB, total=80 * GiB, allocated=8 * GiB, reserved=48 * GiB, wsl=True),
        oom(request=1 * GiB, total=80 * GiB, allocated=8 * GiB, reserved=48 * GiB,
            expandable=1, wsl=True),
        hints(mem_samples=10, mem_peak=79 * GiB, mem_total=80 * GiB, peak_allocated=4 * GiB,
              peak_reserved=16 * GiB, wsl=True))
    assert oom_off[0][0] == 40 * GiB
    assert oom_off[0][2].startswith("40.00 GiB is reserved by PyTorch but not allocated "
                                    "(fragmentation); expandable segments do not work on this "
                                    "platform (WSL): set PYTORCH_CUDA_ALLOC_CONF=max_split_size_mb:128")
    # a user who set them anyway is told what the figures say, as elsewhere
    assert oom_on[0][2].startswith("40.00 GiB is reserved but not allocated even with expandable")
    frag = [t for _, _, t in summary if t.startswith("fragmentation")]
    assert frag and frag[0].endswith("expandable segments do not work on this platform (WSL): "
                                     "set max_split_size_mb:128 (OUTOFCUDA_ALLOC_CONF)"), summary
    for items in (oom_off, summary):
        assert not any("expandable_segments:True" in t for _, _, t in items), items


def test_oom_exhausted_split_and_unknown_figures(advise):
    [exhausted, unknown] = advise(oom(allocated=30 * GiB, total=40 * GiB, exhausted=1),
                                  oom())
    assert heads(exhausted) == [["Even", "the", "smallest"]]
    assert exhausted[0][0] == 30 * GiB
    assert [(s, t.split(":")[0]) for s, _, t in unknown] == [(1, "Activations grow with the batch")]


# ---- exit-summary hints ----

def test_summary_hints_ranked_by_how_far_past_the_threshold(advise):
    [items] = advise(hints(util_samples=10, util_sum=200, under_low=8, mem_samples=10,
                           mem_peak=1 * GiB, mem_total=80 * GiB, peak_allocated=1 * GiB,
                           peak_reserved=2 * GiB, workers=1, frames=10, waits=0))
    assert [(round(s, 4), o) for s, o, _ in items] == [(2.0, 1), (1.975, 2), (1.6, 0)]
    assert items[0][2] == ("fragmentation: torch reserved 2.00 GiB at peak for 1.00 GiB of "
                           "tensors (50 % cached but unused); set expandable_segments:True "
                           "(OUTOFCUDA_ALLOC_CONF)")
    assert items[1][2].startswith("bigger batch: device memory peaked at 1.00 of 80.00 GiB (1.2 %)")
    # Low utilisation, but the main thread never waited on its data: not
    # blamed on the DataLoader, whatever its num_workers.
    assert items[2][2].startswith("low utilisation: the GPU was under 50 % busy in 80 % of "
                                  "samples (mean 20 %); the main thread waited for data in only "
                                  "0 % of the run")
    assert "num_workers" not in items[2][2]


def test_summary_hints_ties_and_thresholds(advise):
    # Same score 1.0 for utilisation (half the samples low) and fragmentation
    # (a quarter unused): utilisation first, by order.
    [tie, quiet, unmeasured, on] = advise(
        hints(util_samples=10, util_sum=600, under_low=5, peak_allocated=768 * MiB,
              peak_reserved=1 * GiB, workers=8, frames=10, waits=0),
        hints(util_samples=4, util_sum=0, under_low=4, mem_samples=1, mem_peak=60,
              mem_total=100, peak_allocated=0, peak_reserved=255 * MiB),
        hints(util_samples=5, util_sum=100, under_low=5, workers=0, frames=4, waits=4),
        hints(peak_allocated=0, peak_reserved=1 * GiB, expandable=1))
    assert [(s, o) for s, o, _ in tie] == [(1.0, 0), (1.0, 1)]
    assert tie[0][2].startswith("low utilisation:")
    assert quiet == []
    # Four stack samples measure nothing: no blame, and it says so.
    assert "the wait for data was not measured" in unmeasured[0][2]
    assert on[0][2].endswith("expandable_segments is on: vary tensor shapes less (pad to "
                             "fixed sizes)")


def test_summary_blames_the_input_pipeline_only_on_a_measured_wait(advise):
    cases = [
        # waited 40 % of 100 samples, GPU under 50 % in 30 of 50 paired samples
        hints(util_samples=50, util_sum=1000, under_low=45, frames=100, waits=40, paired=50,
              paired_low=30, workers=0, cpus=16, suggested=8),
        # no GPU part: the wait alone
        hints(frames=20, waits=18, workers=0, cpus=4, suggested=4),
        hints(frames=20, waits=18, workers=2, cpus=16, suggested=8),
        hints(frames=20, waits=18, workers=8, cpus=8, suggested=8),
        hints(frames=20, waits=18, workers=-1, cpus=8, suggested=8),
        hints(frames=20, waits=18, workers=0, cpus=1, suggested=0),
        # just under the threshold (10 %), and too few samples
        hints(frames=100, waits=9, workers=0),
        hints(frames=4, waits=4, workers=0),
    ]
    gpu, cpu0, few, many, unknown, one_core, under, short = advise(*cases)
    assert [(s, o) for s, o, _ in gpu[:1]] == [(2.0, 0)]
    assert gpu[0][2] == ("input pipeline: the GPU was under 50 % busy in 60 % of the run while "
                         "the main thread waited for the next batch (it waited 40 % of the run); "
                         "this DataLoader has num_workers=0: num_workers=8 (16 cores here) or "
                         "outofcuda.smart_dataloader")
    # Starved: the low-utilisation hint is not given besides.
    assert [t.split(":")[0] for _, _, t in gpu] == ["input pipeline"]
    assert cpu0 == [(4.5, 0, "input pipeline: the main thread waited for the next batch 90 % of "
                             "the run; this DataLoader has num_workers=0: num_workers=4 (4 cores "
                             "here) or outofcuda.smart_dataloader")]
    assert "num_workers=2: num_workers=8 (16 cores here) with pin_memory=True" in few[0][2]
    assert "8 workers do not keep up on 8 cores" in many[0][2]
    assert "raise the loader's num_workers (8 cores here)" in unknown[0][2]
    assert "workers are off here" in one_core[0][2]
    assert under == [] and short == []
