/* Drives the pure-C known-bugs table (src/kbtable.c built with OC_PURE_C,
 * no Python) from stdin, one case a line:
 *   facts TORCH CUDA_BUILD CUDA CUDNN NCCL AARCH64 OTHER_CUDNN LOCAL_RANK FOREIGN N_CC CC... ENV
 * where ENV is "-" (nothing set) or NAME=VALUE pairs joined by ';'; one line
 * out per case and row: "<row id> <decision> <why>".
 *   off VALUE          -> "<rc> <bits> <unknown>" (oc_known_bugs_parse_off)
 *   foreign RANK NVIS N CTX... -> "<device>" (oc_kb_foreign_device)
 *   rows               -> one line per row: "<id> <needs> <action>" */
#include "../../src/oc.h"

#include <stdio.h>
#include <string.h>

static char env_text[2048];

/* ENV holds "NAME=VALUE;NAME=VALUE": the value of name, or NULL. */
static const char *one_env(const char *name, void *ctx)
{
    static char value[2048];
    size_t n = strlen(name);
    const char *p = env_text;
    (void)ctx;
    while (*p) {
        const char *end = strchr(p, ';');
        size_t len = end ? (size_t)(end - p) : strlen(p);
        if (len > n && strncmp(p, name, n) == 0 && p[n] == '=') {
            snprintf(value, sizeof value, "%.*s", (int)(len - n - 1), p + n + 1);
            return value;
        }
        p += len + (end != NULL);
    }
    return NULL;
}

static void facts(char *p)
{
    oc_kb_facts f;
    int used = 0, fd = 0;
    memset(&f, 0, sizeof f);
    if (sscanf(p, "%ld %d %ld %ld %ld %d %d %ld %d %d%n", &f.torch, &f.cuda_build, &f.cuda,
               &f.cudnn, &f.nccl, &f.aarch64, &f.other_cudnn, &f.local_rank, &fd, &f.n_cc,
               &used) != 10)
        return;
    f.foreign_dev = fd;
    p += used;
    for (int i = 0, cc; i < f.n_cc; i++) {
        if (sscanf(p, "%d%n", &cc, &used) != 1)
            break;
        if (i < OC_KB_MAX_DEVICES) /* the rest are read past, as a table would */
            f.cc[i] = cc;
        p += used;
    }
    if (sscanf(p, "%2047s", env_text) != 1 || strcmp(env_text, "-") == 0)
        env_text[0] = '\0';
    f.getenv_fn = one_env;
    for (size_t i = 0; i < oc_known_bug_count(); i++) {
        char why[400];
        oc_kb_code c = oc_known_bug_decide(oc_known_bug_at(i), &f, why, sizeof why);
        printf("%s %d %d %s\n", oc_known_bug_at(i)->id, oc_kb_verdict(c), (int)c, why);
    }
}

int main(void)
{
    char line[8192];
    while (fgets(line, sizeof line, stdin) != NULL) {
        line[strcspn(line, "\n")] = '\0';
        if (strncmp(line, "facts ", 6) == 0) {
            facts(line + 6);
        } else if (strncmp(line, "off ", 4) == 0) {
            unsigned long bits = 7;
            char unknown[64];
            int rc = oc_known_bugs_parse_off(line + 4, &bits, unknown, sizeof unknown);
            printf("%d %lu %s\n", rc, bits, unknown);
        } else if (strncmp(line, "foreign ", 8) == 0) {
            long rank;
            int nvis, n, ctx[64], used;
            char *p = line + 8;
            if (sscanf(p, "%ld %d %d%n", &rank, &nvis, &n, &used) != 3 || n < 0 || n > 64)
                continue;
            p += used;
            for (int i = 0; i < n; i++) {
                if (sscanf(p, "%d%n", &ctx[i], &used) != 1)
                    break;
                p += used;
            }
            printf("%d\n", oc_kb_foreign_device(rank, nvis, ctx, n));
        } else if (strcmp(line, "rows") == 0) {
            for (size_t i = 0; i < oc_known_bug_count(); i++)
                printf("%s %u %d\n", oc_known_bug_at(i)->id, oc_known_bug_at(i)->needs,
                       (int)oc_known_bug_at(i)->action);
        }
        fflush(stdout);
    }
    return oc_known_bug_at(oc_known_bug_count()) == NULL ? 0 : 1;
}
