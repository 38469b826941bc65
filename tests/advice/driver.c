/* Drives the pure-C advice rules (src/advice.c built with OC_PURE_C, no
 * Python): one case a line on stdin,
 *   oom request total limit allocated reserved inactive_split fraction
 *       expandable autocast exhausted n_others [pid name used]...
 *   hints util_samples util_sum under_low mem_samples mem_peak mem_total
 *       peak_allocated peak_reserved workers expandable frame_samples
 *       frame_waits paired_samples paired_wait_low cpus suggested_workers
 * (a name "-" stands for an unknown one; "oom wsl ..." and "hints wsl ..."
 * stand on a platform where expandable segments cannot work); per case, one
 * line per item in rank order, "<score> <order> <text>", then a line "--". */
#include "../../src/oc.h"

#include <stdio.h>
#include <string.h>

#define MAX_ITEMS 12

static int read_oom(const char *p, int wsl, oc_advice_item *items)
{
    oc_oom_figures f;
    int used = 0;
    memset(&f, 0, sizeof f);
    f.no_expandable_here = wsl;
    if (sscanf(p, "%llu %llu %llu %llu %llu %llu %lf %d %d %d %d%n", &f.request, &f.total, &f.limit,
               &f.allocated, &f.reserved, &f.inactive_split, &f.fraction, &f.expandable,
               &f.autocast, &f.exhausted, &f.n_others, &used) != 11)
        return -1;
    if (f.n_others < 0 || f.n_others > OC_OOM_OTHERS_MAX)
        return -1;
    p += used;
    for (int i = 0; i < f.n_others; i++) {
        if (sscanf(p, "%u %63s %llu%n", &f.others[i].pid, f.others[i].name, &f.others[i].used,
                   &used) != 3)
            return -1;
        if (strcmp(f.others[i].name, "-") == 0)
            f.others[i].name[0] = '\0';
        p += used;
    }
    return oc_oom_advise(&f, items, MAX_ITEMS);
}

static int read_hints(const char *p, int wsl, oc_advice_item *items)
{
    oc_summary_figures f;
    memset(&f, 0, sizeof f);
    f.no_expandable_here = wsl;
    if (sscanf(p, "%llu %lf %llu %llu %llu %llu %lld %lld %ld %d %llu %llu %llu %llu %ld %ld",
               &f.util_samples, &f.util_sum, &f.under_low, &f.mem_samples, &f.mem_peak,
               &f.mem_total, &f.peak_allocated, &f.peak_reserved, &f.workers, &f.expandable,
               &f.frame_samples, &f.frame_waits, &f.paired_samples, &f.paired_wait_low, &f.cpus,
               &f.suggested_workers) != 16)
        return -1;
    return oc_summary_hints(&f, items, MAX_ITEMS);
}

int main(void)
{
    char line[4096];
    while (fgets(line, sizeof line, stdin) != NULL) {
        oc_advice_item items[MAX_ITEMS];
        int n = -1;
        if (strncmp(line, "oom wsl ", 8) == 0)
            n = read_oom(line + 8, 1, items);
        else if (strncmp(line, "oom ", 4) == 0)
            n = read_oom(line + 4, 0, items);
        else if (strncmp(line, "hints wsl ", 10) == 0)
            n = read_hints(line + 10, 1, items);
        else if (strncmp(line, "hints ", 6) == 0)
            n = read_hints(line + 6, 0, items);
        if (n < 0) {
            printf("bad case\n--\n");
            continue;
        }
        for (int i = 0; i < n; i++)
            printf("%.17g %d %s\n", items[i].score, items[i].order, items[i].text);
        printf("--\n");
    }
    return 0;
}
