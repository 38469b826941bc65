/* fuzz_config.c - libFuzzer target for the OUTOFCUDA_* parser (src/config.c).
 *
 * The input is a list of NAME=VALUE lines; a custom getenv serves them to
 * oc_config_load, so arbitrary bytes reach every load_* routine without
 * touching the process environment. A NAME without '=' is looked up as an
 * unset variable. Built with -DOC_PURE_C: no Python is linked. */
#ifndef OC_PURE_C
#define OC_PURE_C
#endif
#include "../src/oc.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MAX_VARS 64

typedef struct {
    int n;
    const char *name[MAX_VARS];
    const char *value[MAX_VARS];
} fake_env;

/* Returns the value fake_env holds for name (the last one wins, as for a
 * real environment built by repeated setenv), or NULL. */
static const char *fake_getenv(const char *name, void *ctx)
{
    const fake_env *env = ctx;
    for (int i = env->n - 1; i >= 0; i--) {
        if (strcmp(env->name[i], name) == 0)
            return env->value[i];
    }
    return NULL;
}

/* Checks the invariants oc_config_load promises whatever the input; abort()
 * makes a broken promise a crash libFuzzer reports. */
static void check_config(const oc_config *c)
{
    if (c->n_warnings < 0 || c->n_warnings > OC_WARN_MAX)
        abort();
    for (int i = 0; i < c->n_warnings; i++) {
        const unsigned char *w = (const unsigned char *)c->warnings[i];
        if (memchr(w, '\0', OC_WARN_LEN) == NULL)
            abort();
        /* Escaped for a terminal: no control character (C0, DEL, C1), no
         * bidi override or isolate (U+202A-U+202E, U+2066-U+2069). */
        for (; *w != '\0'; w++) {
            if (*w < 0x20 || *w == 0x7f || (w[0] == 0xc2 && w[1] >= 0x80 && w[1] <= 0x9f) ||
                (w[0] == 0xe2 && w[1] == 0x80 && w[2] >= 0xaa && w[2] <= 0xae) ||
                (w[0] == 0xe2 && w[1] == 0x81 && w[2] >= 0xa6 && w[2] <= 0xa9))
                abort();
        }
    }
    if (memchr(c->alloc_conf, '\0', sizeof c->alloc_conf) == NULL ||
        memchr(c->compile_mode, '\0', sizeof c->compile_mode) == NULL)
        abort();
    /* A setting given an off word holds what leaves torch's default: a
     * fraction of 0, OC_AMP_OFF, a prefetch factor of 0; only then. A
     * fraction is otherwise auto or in (0, 1]. */
    if (oc_config_off(c, "OUTOFCUDA_MEMORY_FRACTION")
            ? c->memory_fraction != 0.0
            : !(c->memory_fraction == OC_FRACTION_AUTO ||
                (c->memory_fraction > 0.0 && c->memory_fraction <= 1.0)))
        abort();
    /* Only rows of the known-bugs table can be turned off. */
    if (c->known_bugs_off >> oc_known_bug_count() != 0 ||
        (c->known_bugs != 0 && c->known_bugs != 1))
        abort();
    if (oc_config_off(c, "OUTOFCUDA_AMP_DTYPE")
            ? c->amp_dtype != OC_AMP_OFF
            : c->amp_dtype < OC_AMP_AUTO || c->amp_dtype > OC_AMP_BFLOAT16)
        abort();
    if (c->num_workers < 0 || c->num_workers > 1024 ||
        (oc_config_off(c, "OUTOFCUDA_PREFETCH_FACTOR")
             ? c->prefetch_factor != 0
             : c->prefetch_factor < 1 || c->prefetch_factor > 1024))
        abort();
    if (oc_config_off(c, "OUTOFCUDA_ALLOC_CONF") &&
        (c->alloc_conf[0] != '\0' || c->alloc_conf_no_expandable[0] != '\0'))
        abort();
    if ((c->disable | c->verbose | c->tf32 | c->cudnn_benchmark | c->channels_last) & ~1)
        abort();
    /* The summary is off, on stderr, or a path that ends in ".json". */
    if (c->summary < OC_SUMMARY_OFF || c->summary > OC_SUMMARY_JSON ||
        memchr(c->summary_path, '\0', sizeof c->summary_path) == NULL)
        abort();
    if (c->summary == OC_SUMMARY_JSON &&
        (strlen(c->summary_path) <= 5 ||
         strcmp(c->summary_path + strlen(c->summary_path) - 5, ".json") != 0))
        abort();
}

/* Normalised prefix: short names in the input map to the variables of the
 * settings table (src/settings.c), so the fuzzer reaches every variable the
 * loader reads without guessing 30 bytes, and a new one without an edit. */
static const char *variable(unsigned char k)
{
    return oc_setting_at(k % oc_setting_count())->name;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    static oc_config cfg;
    fake_env env = {0};
    /* A private NUL-terminated copy: lines are cut in place. */
    char *buf = malloc(size + 1);
    char *p, *end;
    if (buf == NULL)
        return 0;
    memcpy(buf, data, size);
    buf[size] = '\0';
    end = buf + size;
    p = buf;
    while (p < end && env.n < MAX_VARS) {
        char *nl = memchr(p, '\n', (size_t)(end - p));
        char *eq;
        if (nl != NULL)
            *nl = '\0';
        eq = strchr(p, '=');
        if (eq != NULL) {
            *eq = '\0';
            /* "#k=value" selects the k-th known name (mod N_NAMES). */
            if (p[0] == '#' && p[1] != '\0')
                env.name[env.n] = variable((unsigned char)p[1]);
            else
                env.name[env.n] = p;
            env.value[env.n] = eq + 1;
            env.n++;
        }
        if (nl == NULL)
            break;
        p = nl + 1;
    }
    oc_config_load(&cfg, fake_getenv, &env);
    check_config(&cfg);
    free(buf);
    return 0;
}
