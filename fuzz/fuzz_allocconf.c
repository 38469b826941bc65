/* fuzz_allocconf.c - libFuzzer target for the allocator-string parser and
 * merge (src/allocconf.c).
 *
 * Input: "<defaults>\n<user>\n<torch version>"; missing parts are empty.
 * Each part goes through oc_alloc_parse alone, then both through
 * oc_alloc_merge with and without a version filter and with output buffers
 * of several sizes (a tiny one forces the "too long" path). Built with
 * -DOC_PURE_C: no Python is linked. */
#ifndef OC_PURE_C
#define OC_PURE_C
#endif
#include "../src/oc.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static int allowed_for_version(const char *key, void *ctx)
{
    return oc_alloc_key_known(key, *(const long *)ctx);
}

/* Aborts unless s is NUL-terminated inside its buffer of size sz. */
static void check_terminated(const char *s, size_t sz)
{
    if (sz > 0 && memchr(s, '\0', sz) == NULL)
        abort();
}

/* A successful merge must parse again and hold every user key. The merge
 * may emit more than OC_ALLOC_ENTRIES_MAX items (user plus defaults), which
 * the parser refuses by design; only that refusal is allowed. */
static void check_merge(const char *out, const oc_alloc_list *user)
{
    static oc_alloc_list again;
    char err[160] = "";
    if (oc_alloc_parse(out, &again, err, sizeof err) != 0) {
        if (strcmp(err, "too many items") == 0)
            return;
        abort();
    }
    for (int i = 0; i < user->n; i++) {
        int found = 0;
        for (int j = 0; j < again.n; j++)
            found |= strcmp(again.e[j].key, user->e[i].key) == 0;
        if (!found)
            abort();
    }
}

static void run_merge(const char *defaults, const char *user, const char *version)
{
    static oc_alloc_list u;
    static char out[OC_ALLOC_CONF_MAX * 2];
    /* 16 bytes forces the "too long" path; the full size is what callers use. */
    static const struct {
        size_t size;
        int filtered;
    } runs[] = {{16, 0}, {sizeof out, 0}, {sizeof out, 1}};
    char dropped[512] = "", err[160] = "";
    long ver = oc_torch_version_number(version);
    int user_ok = oc_alloc_parse(user, &u, err, sizeof err) == 0;
    check_terminated(err, sizeof err);
    for (size_t i = 0; i < sizeof runs / sizeof runs[0]; i++) {
        int rc = oc_alloc_merge(defaults, user, runs[i].filtered ? allowed_for_version : NULL, &ver,
                                out, runs[i].size, dropped, sizeof dropped, err, sizeof err);
        check_terminated(out, runs[i].size);
        check_terminated(dropped, sizeof dropped);
        if (rc == 0 && user_ok)
            check_merge(out, &u);
    }
    (void)oc_alloc_env_name(ver);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    static oc_alloc_list list;
    char *buf = malloc(size + 1);
    char *parts[3] = {"", "", ""};
    char *p;
    if (buf == NULL)
        return 0;
    memcpy(buf, data, size);
    buf[size] = '\0';
    p = buf;
    for (int i = 0; i < 3 && p != NULL; i++) {
        char *nl = strchr(p, '\n');
        parts[i] = p;
        if (nl != NULL)
            *nl++ = '\0';
        p = nl;
    }
    for (int i = 0; i < 2; i++) {
        char err[160] = "";
        if (oc_alloc_parse(parts[i], &list, err, sizeof err) == 0) {
            if (list.n < 0 || list.n > OC_ALLOC_ENTRIES_MAX)
                abort();
            for (int j = 0; j < list.n; j++)
                (void)oc_alloc_key_known(list.e[j].key, oc_torch_version_number(parts[2]));
        }
    }
    run_merge(parts[0], parts[1], parts[2]);
    free(buf);
    return 0;
}
