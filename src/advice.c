/* advice.c - the ranked advice outofcuda gives: the actions that fit an
 * out-of-memory error (oom.c's report) and the hints of the exit summary
 * (summary.c). Pure C: no Python here, so the rules can be driven with
 * given figures (tests/test_advice.py) and fuzzed on their own. Each rule
 * that fits adds one item with a score (how much it would help, higher
 * first) and an order that breaks ties; the caller shows the top few. */
#ifndef OC_PURE_C
#define OC_PURE_C
#endif
#include "oc.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>

/* ---- the ranking ---- */

typedef struct {
    oc_advice_item *items;
    int n, max;
} advice_list;

/* Adds one item while there is room; a rule past `max` is dropped. */
#if defined(__GNUC__) || defined(__clang__)
__attribute__((format(printf, 4, 5)))
#endif
static void
add(advice_list *l, double score, int order, const char *fmt, ...)
{
    va_list ap;
    if (l->n >= l->max)
        return;
    l->items[l->n].score = score;
    l->items[l->n].order = order;
    va_start(ap, fmt);
    vsnprintf(l->items[l->n].text, sizeof l->items[0].text, fmt, ap);
    va_end(ap);
    l->n++;
}

static int by_score(const void *a, const void *b)
{
    const oc_advice_item *x = a, *y = b;
    if (x->score != y->score)
        return (x->score < y->score) - (x->score > y->score);
    return x->order - y->order;
}

void oc_fmt_bytes(unsigned long long b, char *buf, size_t sz)
{
    double mib = (double)b / (1024.0 * 1024.0);
    if (mib >= 1024.0)
        snprintf(buf, sz, "%.2f GiB", mib / 1024.0);
    else
        snprintf(buf, sz, "%.0f MiB", mib);
}

/* ---- out of memory: the actions that fit the figures ---- */

int oc_oom_advise(const oc_oom_figures *f, oc_advice_item *out, int max)
{
    advice_list l = {out, 0, max};
    unsigned long long cap = f->limit ? f->limit : f->total;
    unsigned long long frag = f->reserved > f->allocated ? f->reserved - f->allocated : 0;
    unsigned long long floor_bytes = f->request > (256ULL << 20) ? f->request : (256ULL << 20);
    char a[32], b[32];
    /* Each action scores the bytes it would give back, where known; ties
     * keep the order the rules are written in. */
    for (int i = 0; i < f->n_others && i < OC_OOM_OTHERS_MAX; i++) {
        if (f->others[i].used < floor_bytes)
            continue;
        oc_fmt_bytes(f->others[i].used, a, sizeof a);
        add(&l, (double)f->others[i].used, l.n,
            "Another process holds %s on this GPU: pid %u (%s). Stop it, or run on a free GPU "
            "(CUDA_VISIBLE_DEVICES).",
            a, f->others[i].pid, f->others[i].name[0] ? f->others[i].name : "name unknown");
    }
    if (frag > 0 && frag >= f->request &&
        (frag >= f->reserved / 10 || f->inactive_split >= f->request)) {
        oc_fmt_bytes(frag, a, sizeof a);
        if (!f->expandable && !f->no_expandable_here)
            add(&l, (double)frag, l.n,
                "%s is reserved by PyTorch but not allocated (fragmentation): set "
                "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True before starting Python.",
                a);
        else if (!f->expandable)
            add(&l, (double)frag, l.n,
                "%s is reserved by PyTorch but not allocated (fragmentation); expandable "
                "segments do not work on this platform (WSL): set "
                "PYTORCH_CUDA_ALLOC_CONF=max_split_size_mb:128 before starting Python, so that "
                "large cached blocks are not split for small requests.",
                a);
        else
            add(&l, (double)frag / 4.0, l.n,
                "%s is reserved but not allocated even with expandable segments: free large "
                "tensors you no longer need (del, then torch.cuda.empty_cache() once) before "
                "the next phase.",
                a);
    }
    if (f->fraction > 0.0 && f->fraction < 1.0 && f->total > 0 &&
        (double)f->total * (1.0 - f->fraction) >= (double)f->request) {
        unsigned long long held = (unsigned long long)((double)f->total * (1.0 - f->fraction));
        oc_fmt_bytes(held, a, sizeof a);
        add(&l, (double)held, l.n,
            "The memory fraction %.2f keeps %s of this GPU away from PyTorch: raise "
            "OUTOFCUDA_MEMORY_FRACTION (or torch.cuda.set_per_process_memory_fraction).",
            f->fraction, a);
    }
    if (f->exhausted) {
        add(&l, (double)(f->allocated ? f->allocated : 1), l.n,
            "Even the smallest micro-batch does not fit: the weights, gradients and optimiser "
            "state fill the GPU. Recompute activations (torch.utils.checkpoint), use 8-bit or "
            "sharded optimiser state (FSDP/ZeRO), or a smaller model.");
    } else {
        int own = cap == 0 || f->allocated == 0 || f->allocated * 2 >= cap;
        oc_fmt_bytes(f->allocated, b, sizeof b);
        add(&l, (double)(own ? (f->allocated ? f->allocated / 2 : 1) : f->request / 2), l.n,
            "%s%s: train with outofcuda.auto_microbatch(step) (same gradients, smaller "
            "micro-batches), search an inference batch with outofcuda.find_batch_size, or "
            "recompute activations with torch.utils.checkpoint.",
            f->allocated ? "This process's tensors hold " : "Activations grow with the batch",
            f->allocated ? b : "");
    }
    if (f->autocast == 0)
        add(&l, (double)(f->allocated ? f->allocated / 3 : 1), l.n,
            "Autocast is off: if the model runs in float32, run its forward pass under "
            "outofcuda.autocast_context() (torch.autocast) to keep activations in 16 bits.");
    if (l.n > 1)
        qsort(out, (size_t)l.n, sizeof *out, by_score);
    return l.n;
}

/* ---- the exit summary: hints for one device ---- */

#define MIN_UTIL_SAMPLES 5 /* fewer say nothing about a run */
#define FRAG_MIN_RESERVED (256LL << 20)

int oc_summary_starved(const oc_summary_figures *d)
{
    return d->frame_samples >= OC_SUMMARY_MIN_FRAME_SAMPLES &&
           (double)d->frame_waits >= OC_SUMMARY_STARVED_SHARE * (double)d->frame_samples;
}

/* The fix for a loop that waited on its data: from the waited DataLoader's
 * num_workers and what smart_dataloader would pick on the cores here. */
static void starved_fix(const oc_summary_figures *d, char *buf, size_t sz)
{
    long s = d->suggested_workers;
    if (d->workers == 0 && s > 0)
        snprintf(buf, sz,
                 "this DataLoader has num_workers=0: num_workers=%ld (%ld cores here) or "
                 "outofcuda.smart_dataloader",
                 s, d->cpus);
    else if (d->workers == 0)
        snprintf(buf, sz,
                 "this DataLoader has num_workers=0 and workers are off here "
                 "(OUTOFCUDA_NUM_WORKERS=0 or one core): make __getitem__ and the transforms "
                 "cheaper, or preprocess the data once");
    else if (d->workers > 0 && d->workers < s)
        snprintf(buf, sz,
                 "this DataLoader has num_workers=%ld: num_workers=%ld (%ld cores here) with "
                 "pin_memory=True, or outofcuda.smart_dataloader",
                 d->workers, s, d->cpus);
    else if (d->workers > 0)
        snprintf(buf, sz,
                 "this DataLoader's %ld workers do not keep up on %ld cores: make __getitem__ and "
                 "the transforms cheaper (profile them), or preprocess the data once",
                 d->workers, d->cpus);
    else
        snprintf(buf, sz,
                 "raise the loader's num_workers (%ld cores here) or use "
                 "outofcuda.smart_dataloader",
                 d->cpus);
}

/* The input-pipeline hint, only where the main thread was measured waiting
 * on its data; with a GPU part it says how often the GPU was under 50 % busy
 * meanwhile. */
static void add_starved(advice_list *l, const oc_summary_figures *d)
{
    char fix[300];
    double waited = (double)d->frame_waits / (double)d->frame_samples;
    starved_fix(d, fix, sizeof fix);
    if (d->paired_samples >= MIN_UTIL_SAMPLES)
        add(l, waited / (2 * OC_SUMMARY_STARVED_SHARE), 0,
            "input pipeline: the GPU was under %d %% busy in %.0f %% of the run while the main "
            "thread waited for the next batch (it waited %.0f %% of the run); %s",
            OC_SUMMARY_LOW_UTIL, 100.0 * (double)d->paired_wait_low / (double)d->paired_samples,
            100.0 * waited, fix);
    else
        add(l, waited / (2 * OC_SUMMARY_STARVED_SHARE), 0,
            "input pipeline: the main thread waited for the next batch %.0f %% of the run; %s",
            100.0 * waited, fix);
}

int oc_summary_hints(const oc_summary_figures *d, oc_advice_item *out, int max)
{
    advice_list l = {out, 0, max};
    int starved = oc_summary_starved(d);
    /* Each hint scores how far past its threshold the figure is; ties go to
     * utilisation, then fragmentation, then memory. Low utilisation is put
     * on the input pipeline only where the main thread was seen waiting on
     * its data: a loop that never waited is not blamed on its DataLoader. */
    if (starved)
        add_starved(&l, d);
    if (!starved && d->util_samples >= MIN_UTIL_SAMPLES) {
        double mean = d->util_sum / (double)d->util_samples;
        double low = (double)d->under_low / (double)d->util_samples;
        if (mean < OC_SUMMARY_LOW_UTIL || low >= 0.5) {
            char what[240];
            if (d->frame_samples >= OC_SUMMARY_MIN_FRAME_SAMPLES)
                snprintf(what, sizeof what,
                         "the main thread waited for data in only %.0f %% of the run: look "
                         "for host-side syncs (.item(), .cpu(), printing tensors) and many "
                         "small kernels with torch.profiler",
                         100.0 * (double)d->frame_waits / (double)d->frame_samples);
            else
                snprintf(what, sizeof what,
                         "the wait for data was not measured: check the DataLoader "
                         "(num_workers, pin_memory) and host-side syncs with torch.profiler");
            add(&l, (low > 1.0 - mean / 100.0 ? low : 1.0 - mean / 100.0) / 0.5, 0,
                "low utilisation: the GPU was under %d %% busy in %.0f %% of samples "
                "(mean %.0f %%); %s",
                OC_SUMMARY_LOW_UTIL, 100.0 * low, mean, what);
        }
    }
    if (d->mem_samples > 0 && d->mem_total > 0 &&
        (double)d->mem_peak < 0.5 * (double)d->mem_total) {
        double unused = 1.0 - (double)d->mem_peak / (double)d->mem_total;
        add(&l, unused / 0.5, 2,
            "bigger batch: device memory peaked at %.2f of %.2f GiB (%.1f %%); a larger "
            "batch would keep the GPU busier (outofcuda.find_batch_size finds the largest "
            "that fits)",
            (double)d->mem_peak / OC_GIB, (double)d->mem_total / OC_GIB, 100.0 * (1.0 - unused));
    }
    if (d->peak_reserved >= FRAG_MIN_RESERVED && d->peak_allocated >= 0) {
        double frag = (double)(d->peak_reserved - d->peak_allocated) / (double)d->peak_reserved;
        if (frag >= 0.25)
            add(&l, frag / 0.25, 1,
                "fragmentation: torch reserved %.2f GiB at peak for %.2f GiB of tensors "
                "(%.0f %% cached but unused); %s",
                (double)d->peak_reserved / OC_GIB, (double)d->peak_allocated / OC_GIB, 100.0 * frag,
                d->expandable           ? "expandable_segments is on: vary tensor shapes less (pad "
                                          "to fixed sizes)"
                : d->no_expandable_here ? "expandable segments do not work on this platform "
                                          "(WSL): set max_split_size_mb:128 (OUTOFCUDA_ALLOC_CONF)"
                                        : "set expandable_segments:True (OUTOFCUDA_ALLOC_CONF)");
    }
    if (l.n > 1)
        qsort(out, (size_t)l.n, sizeof *out, by_score);
    return l.n;
}
