/* config.c - OUTOFCUDA_* environment -> oc_config. Pure C: no Python here, so
 * the parser can be unit-tested and fuzzed on its own. */
#define OC_PURE_C
#include "oc.h"

#include <ctype.h>
#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* No max_split_size_mb beside expandable segments: inside them the
 * allocator still applies its oversize rules, so freed blocks above the
 * limit are never reused and reserved memory grows (pytorch issue 123548,
 * PR 193400). max_split_size_mb:128 joins only where expandable segments
 * end up off (OC_DEFAULT_ALLOC_CONF_NO_EXPANDABLE, bridge.c). */
#define OC_DEFAULT_ALLOC_CONF "garbage_collection_threshold:0.8,expandable_segments:True"
#define OC_DEFAULT_ALLOC_CONF_NO_EXPANDABLE "max_split_size_mb:128"

/* Length of the well-formed UTF-8 sequence at s (1 to 4), or 0 when the
 * bytes there are not one (a stray continuation byte, an overlong form, a
 * surrogate, a sequence cut short). */
static size_t utf8_len(const unsigned char *s)
{
    size_t n, i;
    if (s[0] < 0x80)
        return 1;
    if (s[0] >= 0xc2 && s[0] <= 0xdf)
        n = 2;
    else if (s[0] >= 0xe0 && s[0] <= 0xef)
        n = 3;
    else if (s[0] >= 0xf0 && s[0] <= 0xf4)
        n = 4;
    else
        return 0;
    for (i = 1; i < n; i++) {
        if ((s[i] & 0xc0) != 0x80)
            return 0;
    }
    if ((s[0] == 0xe0 && s[1] < 0xa0) || (s[0] == 0xed && s[1] >= 0xa0) ||
        (s[0] == 0xf0 && s[1] < 0x90) || (s[0] == 0xf4 && s[1] >= 0x90))
        return 0;
    return n;
}

/* Copies the start of a value for a message: printable text as it is,
 * control characters and bytes that are not UTF-8 as \xNN, so that the
 * message is valid UTF-8 whatever the environment held and a 10 kB value
 * still yields a short warning. */
static void shorten(const char *value, char *out, size_t outsz)
{
    const unsigned char *v = (const unsigned char *)value;
    size_t i = 0, j = 0, shown = 0;
    while (v[i] != '\0' && shown < 40) {
        size_t n = utf8_len(v + i);
        if (n == 1 && v[i] >= 0x20 && v[i] != 0x7f) {
            if (j + 1 >= outsz)
                break;
            out[j++] = (char)v[i];
        } else if (n > 1) {
            if (j + n >= outsz)
                break;
            memcpy(out + j, v + i, n);
            j += n;
        } else {
            if (j + 4 >= outsz)
                break;
            snprintf(out + j, outsz - j, "\\x%02x", v[i]);
            j += 4;
            n = 1;
        }
        i += n;
        shown++;
    }
    out[j] = '\0';
    if (v[i] != '\0' && j + 3 < outsz)
        memcpy(out + j, "...", 4);
}

static void add_warning(oc_config *cfg, const char *name, const char *value, const char *accepts)
{
    char shown[200];
    if (cfg->n_warnings >= OC_WARN_MAX)
        return;
    shorten(value, shown, sizeof shown);
    snprintf(cfg->warnings[cfg->n_warnings++], OC_WARN_LEN,
             "outofcuda: ignoring %s='%s': expected %s; using the default", name, shown, accepts);
}

/* Copies s without leading and trailing blanks into buf (lower-cased when
 * lower). Returns buf, or NULL when the trimmed text does not fit. */
static const char *trim_copy(const char *s, char *buf, size_t sz, int lower)
{
    const char *end;
    size_t n;
    while (*s && isspace((unsigned char)*s))
        s++;
    end = s + strlen(s);
    while (end > s && isspace((unsigned char)end[-1]))
        end--;
    n = (size_t)(end - s);
    if (n >= sz)
        return NULL;
    for (size_t i = 0; i < n; i++)
        buf[i] = lower ? (char)tolower((unsigned char)s[i]) : s[i];
    buf[n] = '\0';
    return buf;
}

/* The value of a variable, or NULL when it is unset or set to nothing:
 * `OUTOFCUDA_X=` (an env file's blank entry, `docker run -e X=`) means
 * "not set", not a bad value. */
static const char *lookup(oc_getenv_fn get, void *ctx, const char *name)
{
    const char *v = get(name, ctx);
    return (v == NULL || v[0] == '\0') ? NULL : v;
}

int oc_parse_bool(const char *s)
{
    static const char *const yes[] = {"1", "true", "yes", "on"};
    static const char *const no[] = {"0", "false", "no", "off"};
    char buf[8];
    if (s == NULL || trim_copy(s, buf, sizeof buf, 1) == NULL)
        return -1;
    for (size_t i = 0; i < 4; i++) {
        if (strcmp(buf, yes[i]) == 0)
            return 1;
        if (strcmp(buf, no[i]) == 0)
            return 0;
    }
    return -1;
}

static void load_bool(oc_config *cfg, oc_getenv_fn get, void *ctx, const char *name, int *slot)
{
    const char *v = lookup(get, ctx, name);
    int b;
    if (v == NULL)
        return;
    b = oc_parse_bool(v);
    if (b < 0)
        add_warning(cfg, name, v, "1/0, true/false, yes/no or on/off");
    else
        *slot = b;
}

static void load_long(oc_config *cfg, oc_getenv_fn get, void *ctx, const char *name, long lo,
                      long hi, long *slot)
{
    char buf[32], accepts[80];
    const char *v = lookup(get, ctx, name);
    char *end;
    long x;
    if (v == NULL)
        return;
    snprintf(accepts, sizeof accepts, "a whole number from %ld to %ld", lo, hi);
    if (trim_copy(v, buf, sizeof buf, 0) == NULL || buf[0] == '\0') {
        add_warning(cfg, name, v, accepts);
        return;
    }
    errno = 0;
    x = strtol(buf, &end, 10);
    if (errno != 0 || *end != '\0' || x < lo || x > hi) {
        add_warning(cfg, name, v, accepts);
        return;
    }
    *slot = x;
}

static void load_fraction(oc_config *cfg, oc_getenv_fn get, void *ctx)
{
    static const char name[] = "OUTOFCUDA_MEMORY_FRACTION";
    char buf[32];
    const char *v = lookup(get, ctx, name);
    char *end;
    double x;
    if (v == NULL)
        return;
    if (trim_copy(v, buf, sizeof buf, 0) == NULL || buf[0] == '\0') {
        add_warning(cfg, name, v, "a number f with 0 < f <= 1");
        return;
    }
    errno = 0;
    x = strtod(buf, &end);
    /* isfinite() also refuses "nan" and "inf", which strtod accepts. */
    if (errno != 0 || *end != '\0' || !isfinite(x) || !(x > 0.0) || x > 1.0) {
        add_warning(cfg, name, v, "a number f with 0 < f <= 1");
        return;
    }
    cfg->memory_fraction = x;
}

static void load_choice(oc_config *cfg, oc_getenv_fn get, void *ctx, const char *name,
                        const char *const *choices, const int *values, size_t n, int *slot,
                        const char *accepts)
{
    char buf[40];
    const char *v = lookup(get, ctx, name);
    if (v == NULL)
        return;
    if (trim_copy(v, buf, sizeof buf, 1) != NULL) {
        for (size_t i = 0; i < n; i++) {
            if (strcmp(buf, choices[i]) == 0) {
                *slot = values[i];
                return;
            }
        }
    }
    add_warning(cfg, name, v, accepts);
}

static void load_amp_dtype(oc_config *cfg, oc_getenv_fn get, void *ctx)
{
    static const char *const words[] = {"auto", "float16", "fp16", "half", "bfloat16", "bf16"};
    static const int values[] = {OC_AMP_AUTO,    OC_AMP_FLOAT16,  OC_AMP_FLOAT16,
                                 OC_AMP_FLOAT16, OC_AMP_BFLOAT16, OC_AMP_BFLOAT16};
    int slot = (int)cfg->amp_dtype;
    load_choice(cfg, get, ctx, "OUTOFCUDA_AMP_DTYPE", words, values, 6, &slot,
                "auto, float16 or bfloat16");
    cfg->amp_dtype = (oc_amp_dtype)slot;
}

static void load_compile_mode(oc_config *cfg, oc_getenv_fn get, void *ctx)
{
    static const char *const modes[] = {"default", "reduce-overhead", "max-autotune",
                                        "max-autotune-no-cudagraphs"};
    static const int values[] = {0, 1, 2, 3};
    int slot = -1;
    load_choice(cfg, get, ctx, "OUTOFCUDA_COMPILE_MODE", modes, values, 4, &slot,
                "default, reduce-overhead, max-autotune or max-autotune-no-cudagraphs");
    if (slot >= 0)
        snprintf(cfg->compile_mode, sizeof cfg->compile_mode, "%s", modes[slot]);
}

static void load_alloc_conf(oc_config *cfg, oc_getenv_fn get, void *ctx)
{
    static const char name[] = "OUTOFCUDA_ALLOC_CONF";
    const char *v = lookup(get, ctx, name);
    oc_alloc_list list;
    if (v == NULL)
        return;
    if (strlen(v) >= sizeof cfg->alloc_conf || oc_alloc_parse(v, &list, NULL, 0) != 0) {
        add_warning(cfg, name, v,
                    "a PyTorch allocator string such as 'expandable_segments:True' "
                    "(key:value pairs separated by commas)");
        return;
    }
    snprintf(cfg->alloc_conf, sizeof cfg->alloc_conf, "%s", v);
    /* The user's own string replaces every default, conditional ones too. */
    cfg->alloc_conf_no_expandable[0] = '\0';
}

/* OUTOFCUDA_SUMMARY: a boolean word (1: the block on stderr), or the path of
 * a JSON file to write instead, told apart by its ".json" ending so that a
 * typo such as "ture" is a warning, not a file called "ture". Whether the
 * directory exists is checked when the feature starts (summary.c). */
static void load_summary(oc_config *cfg, oc_getenv_fn get, void *ctx)
{
    static const char name[] = "OUTOFCUDA_SUMMARY";
    char buf[OC_SUMMARY_PATH_MAX];
    const char *v = lookup(get, ctx, name), *p;
    size_t n;
    int b;
    if (v == NULL)
        return;
    b = oc_parse_bool(v);
    if (b >= 0) {
        cfg->summary = b ? OC_SUMMARY_STDERR : OC_SUMMARY_OFF;
        return;
    }
    p = trim_copy(v, buf, sizeof buf, 0);
    n = p ? strlen(p) : 0;
    for (size_t i = 0; p && i < n; i++)
        if ((unsigned char)p[i] < 0x20 || p[i] == 0x7f)
            p = NULL;
    if (p == NULL || n <= 5 || strcmp(p + n - 5, ".json") != 0 || p[n - 6] == '/') {
        add_warning(cfg, name, v,
                    "1/0 (the summary on stderr at exit, or none) or the path of a .json "
                    "file to write it to (under 1024 characters)");
        return;
    }
    cfg->summary = OC_SUMMARY_JSON;
    snprintf(cfg->summary_path, sizeof cfg->summary_path, "%s", p);
}

void oc_config_load(oc_config *cfg, oc_getenv_fn get, void *ctx)
{
    memset(cfg, 0, sizeof *cfg);
    cfg->tf32 = 1;
    cfg->cudnn_benchmark = 1;
    cfg->channels_last = 1;
    snprintf(cfg->compile_mode, sizeof cfg->compile_mode, "%s", "reduce-overhead");
    cfg->amp_dtype = OC_AMP_AUTO;
    cfg->memory_fraction = 0.95;
    snprintf(cfg->alloc_conf, sizeof cfg->alloc_conf, "%s", OC_DEFAULT_ALLOC_CONF);
    snprintf(cfg->alloc_conf_no_expandable, sizeof cfg->alloc_conf_no_expandable, "%s",
             OC_DEFAULT_ALLOC_CONF_NO_EXPANDABLE);
    cfg->gc_collect = 1;
    cfg->flash_attn = 1;
    cfg->mem_eff_attn = 1;
    cfg->math_attn = 1;
    cfg->pin_memory = 1;
    cfg->num_workers = 4;
    cfg->prefetch_factor = 2;
    cfg->known_bugs = 1;

    load_bool(cfg, get, ctx, "OUTOFCUDA_DISABLE", &cfg->disable);
    load_bool(cfg, get, ctx, "OUTOFCUDA_VERBOSE", &cfg->verbose);
    load_bool(cfg, get, ctx, "OUTOFCUDA_TF32", &cfg->tf32);
    load_bool(cfg, get, ctx, "OUTOFCUDA_CUDNN_BENCHMARK", &cfg->cudnn_benchmark);
    load_bool(cfg, get, ctx, "OUTOFCUDA_CUDNN_DETERMINISTIC", &cfg->cudnn_deterministic);
    load_bool(cfg, get, ctx, "OUTOFCUDA_CHANNELS_LAST", &cfg->channels_last);
    load_bool(cfg, get, ctx, "OUTOFCUDA_COMPILE", &cfg->compile);
    load_compile_mode(cfg, get, ctx);
    load_bool(cfg, get, ctx, "OUTOFCUDA_COMPILE_FULLGRAPH", &cfg->compile_fullgraph);
    load_amp_dtype(cfg, get, ctx);
    load_fraction(cfg, get, ctx);
    load_alloc_conf(cfg, get, ctx);
    load_bool(cfg, get, ctx, "OUTOFCUDA_GC_COLLECT", &cfg->gc_collect);
    load_bool(cfg, get, ctx, "OUTOFCUDA_FLASH_ATTN", &cfg->flash_attn);
    load_bool(cfg, get, ctx, "OUTOFCUDA_MEM_EFF_ATTN", &cfg->mem_eff_attn);
    load_bool(cfg, get, ctx, "OUTOFCUDA_MATH_ATTN", &cfg->math_attn);
    load_bool(cfg, get, ctx, "OUTOFCUDA_PIN_MEMORY", &cfg->pin_memory);
    load_long(cfg, get, ctx, "OUTOFCUDA_NUM_WORKERS", 0, 1024, &cfg->num_workers);
    load_long(cfg, get, ctx, "OUTOFCUDA_PREFETCH_FACTOR", 1, 1024, &cfg->prefetch_factor);
    load_summary(cfg, get, ctx);
    load_bool(cfg, get, ctx, "OUTOFCUDA_FRAMEWORK_OVERRIDE", &cfg->framework_override);
    load_bool(cfg, get, ctx, "OUTOFCUDA_KNOWN_BUGS", &cfg->known_bugs);
}

int oc_tf32_forced_off(const char *v)
{
    char buf[4];
    /* NVIDIA documents NVIDIA_TF32_OVERRIDE=0 as the switch; " 0" (an env
     * file's stray blank) is read the same way: the off switch errs on the
     * side of the precision the user asked for. */
    return v != NULL && trim_copy(v, buf, sizeof buf, 0) != NULL && strcmp(buf, "0") == 0;
}
