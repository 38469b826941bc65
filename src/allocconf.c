/* allocconf.c - PyTorch allocator strings: parse, merge key by key, and know
 * which keys and which variable each torch release accepts. Pure C. */
#define OC_PURE_C
#include "oc.h"

#include <ctype.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static void set_err(char *err, size_t errsz, const char *msg)
{
    if (err != NULL && errsz > 0)
        snprintf(err, errsz, "%s", msg);
}

/* A merge whose result does not fit: no half string, and -1. */
static int merged_too_long(char *out, char *err, size_t errsz)
{
    set_err(err, errsz, "the merged string is too long");
    out[0] = '\0';
    return -1;
}

/* Copies [b, e) without surrounding blanks into out. Returns 0, or -1 when it
 * does not fit. */
static int copy_trimmed(const char *b, const char *e, char *out, size_t outsz)
{
    size_t n;
    while (b < e && isspace((unsigned char)*b))
        b++;
    while (e > b && isspace((unsigned char)e[-1]))
        e--;
    n = (size_t)(e - b);
    if (n >= outsz)
        return -1;
    memcpy(out, b, n);
    out[n] = '\0';
    return 0;
}

/* 1 when s is not empty and holds only a-z, 0-9 and _ (a key's characters),
 * or, given extra (a value's), also any letter and the characters of extra. */
static int valid_word(const char *s, const char *extra)
{
    if (!*s)
        return 0;
    for (; *s; s++) {
        unsigned char c = (unsigned char)*s;
        if (!(islower(c) || isdigit(c) || c == '_' ||
              (extra != NULL && (isalnum(c) || strchr(extra, c) != NULL))))
            return 0;
    }
    return 1;
}

/* Splits one "key:value" item (value may contain ':' inside brackets). */
static int parse_item(const char *b, const char *e, oc_alloc_list *out, char *err, size_t errsz)
{
    const char *colon = b;
    int i;
    while (colon < e && *colon != ':')
        colon++;
    if (colon == e) {
        set_err(err, errsz, "an item has no ':' between key and value");
        return -1;
    }
    if (out->n >= OC_ALLOC_ENTRIES_MAX) {
        set_err(err, errsz, "too many items");
        return -1;
    }
    i = out->n;
    if (copy_trimmed(b, colon, out->e[i].key, sizeof out->e[i].key) != 0 ||
        copy_trimmed(colon + 1, e, out->e[i].value, sizeof out->e[i].value) != 0) {
        set_err(err, errsz, "a key or value is too long");
        return -1;
    }
    if (!valid_word(out->e[i].key, NULL)) {
        set_err(err, errsz, "a key is empty or holds characters other than a-z, 0-9 and _");
        return -1;
    }
    if (!valid_word(out->e[i].value, ".:[],>-+")) {
        set_err(err, errsz, "a value is empty or holds characters torch does not accept");
        return -1;
    }
    for (int j = 0; j < i; j++) {
        if (strcmp(out->e[j].key, out->e[i].key) == 0) {
            /* torch applies the last occurrence; keep one entry with that value. */
            memcpy(out->e[j].value, out->e[i].value, sizeof out->e[j].value);
            return 0;
        }
    }
    out->n++;
    return 0;
}

int oc_alloc_parse(const char *s, oc_alloc_list *out, char *err, size_t errsz)
{
    const char *item = s;
    int depth = 0;
    out->n = 0;
    if (s == NULL)
        return 0;
    for (const char *p = s;; p++) {
        if (*p == '[') {
            depth++;
        } else if (*p == ']') {
            if (--depth < 0) {
                set_err(err, errsz, "a ']' has no matching '['");
                return -1;
            }
        } else if ((*p == ',' && depth == 0) || *p == '\0') {
            const char *b = item, *e = p;
            while (b < e && isspace((unsigned char)*b))
                b++;
            if (b < e && parse_item(b, e, out, err, errsz) != 0)
                return -1;
            if (b == e && *p == ',') {
                set_err(err, errsz, "an empty item between commas");
                return -1;
            }
            item = p + 1;
        }
        if (*p == '\0')
            break;
    }
    if (depth != 0) {
        set_err(err, errsz, "a '[' is not closed");
        return -1;
    }
    return 0;
}

static int find_key(const oc_alloc_list *l, const char *key)
{
    for (int i = 0; i < l->n; i++) {
        if (strcmp(l->e[i].key, key) == 0)
            return i;
    }
    return -1;
}

/* Appends "key:value" (with a leading comma when needed). Returns 0 or -1. */
static int append_item(char *out, size_t outsz, size_t *len, const char *key, const char *value)
{
    int n = snprintf(out + *len, outsz - *len, "%s%s:%s", *len ? "," : "", key, value);
    if (n < 0 || (size_t)n >= outsz - *len)
        return -1;
    *len += (size_t)n;
    return 0;
}

static int append_word(char *out, size_t outsz, const char *word)
{
    size_t len;
    int n;
    if (out == NULL || outsz == 0)
        return 0;
    len = strlen(out);
    n = snprintf(out + len, outsz - len, "%s%s", len ? "," : "", word);
    return (n < 0 || (size_t)n >= outsz - len) ? -1 : 0;
}

int oc_alloc_merge(const char *defaults, const char *user, oc_key_allowed_fn allowed, void *ctx,
                   char *out, size_t outsz, char *dropped, size_t droppedsz, char *err,
                   size_t errsz)
{
    /* static keeps two 10 kB lists off small native stacks; the merge runs
     * under the GIL or in single-threaded tests, never concurrently. */
    static oc_alloc_list d, u;
    size_t len = 0;
    if (outsz == 0)
        return -1;
    out[0] = '\0';
    if (dropped != NULL && droppedsz > 0)
        dropped[0] = '\0';
    if (oc_alloc_parse(user, &u, err, errsz) != 0)
        return -1;
    if (oc_alloc_parse(defaults, &d, err, errsz) != 0)
        return -1;
    for (int i = 0; i < u.n; i++) {
        if (append_item(out, outsz, &len, u.e[i].key, u.e[i].value) != 0)
            goto too_long;
    }
    for (int i = 0; i < d.n; i++) {
        if (find_key(&u, d.e[i].key) >= 0)
            continue;
        if (allowed != NULL && !allowed(d.e[i].key, ctx)) {
            append_word(dropped, droppedsz, d.e[i].key);
            continue;
        }
        if (append_item(out, outsz, &len, d.e[i].key, d.e[i].value) != 0)
            goto too_long;
    }
    return 0;
too_long:
    return merged_too_long(out, err, errsz);
}

int oc_alloc_value(const char *conf, const char *key, char *value, size_t valuesz)
{
    static oc_alloc_list l;
    int i;
    if (value != NULL && valuesz > 0)
        value[0] = '\0';
    if (oc_alloc_parse(conf, &l, NULL, 0) != 0)
        return -1;
    i = find_key(&l, key);
    if (i < 0)
        return 0;
    if (value != NULL && valuesz > 0)
        snprintf(value, valuesz, "%s", l.e[i].value);
    return 1;
}

int oc_alloc_has(const char *conf, const char *key, const char *value)
{
    char v[sizeof((oc_alloc_list *)0)->e[0].value];
    return oc_alloc_value(conf, key, v, sizeof v) == 1 && strcmp(v, value) == 0;
}

int oc_alloc_expandable(const char *conf)
{
    return oc_alloc_has(conf, "expandable_segments", "True");
}

oc_split_rule oc_alloc_split_rule(const char *conf)
{
    char v[sizeof((oc_alloc_list *)0)->e[0].value];
    if (oc_alloc_value(conf, "max_split_size_mb", NULL, 0) != 1)
        return OC_SPLIT_NONE;
    switch (oc_alloc_value(conf, "expandable_segments", v, sizeof v)) {
    case 0:
        return OC_SPLIT_NO_EXPANDABLE;
    case 1:
        return strcmp(v, "True") == 0 ? OC_SPLIT_INSIDE_EXPANDABLE : OC_SPLIT_NONE;
    default:
        return OC_SPLIT_NONE;
    }
}

/* Writes the entries of l except `skip` as one string. Returns 0 or -1. */
static int join_except(const oc_alloc_list *l, const char *skip, char *out, size_t outsz)
{
    size_t len = 0;
    out[0] = '\0';
    for (int i = 0; i < l->n; i++) {
        if (strcmp(l->e[i].key, skip) != 0 &&
            append_item(out, outsz, &len, l->e[i].key, l->e[i].value) != 0)
            return -1;
    }
    return 0;
}

int oc_alloc_merge_defaults(const char *defaults, const char *no_expandable, const char *user,
                            oc_key_allowed_fn allowed, void *ctx, char *out, size_t outsz,
                            char *dropped, size_t droppedsz, char *err, size_t errsz,
                            int *held_back)
{
    /* static: see oc_alloc_merge; these strings are the size of one setting. */
    static oc_alloc_list d, u;
    static char own[OC_ALLOC_CONF_MAX * 2], first[OC_ALLOC_CONF_MAX * 2], more[256];
    *held_back = 0;
    if (outsz == 0)
        return -1;
    out[0] = '\0';
    if (oc_alloc_parse(user, &u, err, errsz) != 0 || oc_alloc_parse(defaults, &d, err, errsz) != 0)
        return -1;
    /* Inside expandable segments get_free_block() still applies
     * max_split_size's oversize rules, so freed blocks above it are not
     * reused and reserved memory grows (pytorch issue 123548): the user's
     * max_split_size_mb gets no expandable segments from the defaults. */
    if (join_except(&d, "", own, sizeof own) != 0)
        goto too_long;
    if (oc_alloc_split_rule(user) == OC_SPLIT_NO_EXPANDABLE &&
        find_key(&d, "expandable_segments") >= 0) {
        if (join_except(&d, "expandable_segments", own, sizeof own) != 0)
            goto too_long;
        *held_back = 1;
    }
    if (oc_alloc_merge(own, user, allowed, ctx, first, sizeof first, dropped, droppedsz, err,
                       errsz) != 0)
        return -1;
    if (no_expandable == NULL || !no_expandable[0] || oc_alloc_expandable(first)) {
        if (strlen(first) >= outsz)
            goto too_long;
        snprintf(out, outsz, "%s", first);
        return 0;
    }
    /* Expandable segments are off (the user's False, or a release without
     * them): the settings meant for that case join as defaults. */
    if (oc_alloc_merge(no_expandable, first, allowed, ctx, out, outsz, more, sizeof more, err,
                       errsz) != 0)
        return -1;
    if (more[0] && append_word(dropped, droppedsz, more) != 0)
        goto too_long;
    return 0;
too_long:
    return merged_too_long(out, err, errsz);
}

long oc_torch_version_number(const char *v)
{
    long part[3] = {0, 0, 0};
    int i = 0;
    if (v == NULL || !isdigit((unsigned char)*v))
        return 0;
    while (i < 3 && isdigit((unsigned char)*v)) {
        long x = 0;
        while (isdigit((unsigned char)*v)) {
            if (x < 1000)
                x = x * 10 + (*v - '0');
            v++;
        }
        part[i++] = x > 99 ? 99 : x;
        if (*v != '.')
            break;
        v++;
    }
    return part[0] * 10000 + part[1] * 100 + part[2];
}

/* First release (oc_torch_version_number) whose CUDA allocator parser accepts
 * each key, as recorded from the wheels (tests/releases.json). */
static const struct {
    const char *key;
    long since;
} alloc_keys[] = {
    {"max_split_size_mb", 20000},
    {"roundup_power2_divisions", 20000},
    {"garbage_collection_threshold", 20000},
    {"backend", 20000},
    {"expandable_segments", 20100},
    {"release_lock_on_cudamalloc", 20200},
    {"pinned_use_cuda_host_register", 20200},
    {"pinned_num_register_threads", 20200},
    {"max_non_split_rounding_mb", 20600},
    {"pinned_use_background_threads", 20600},
    {"graph_capture_record_stream_reuse", 20900},
    {"large_segment_size_mb", 21100},
    {"pinned_reserve_segment_size_mb", 21000},
    {"per_process_memory_fraction", 21000},
};

int oc_alloc_key_known(const char *key, long ver)
{
    for (size_t i = 0; i < sizeof alloc_keys / sizeof alloc_keys[0]; i++) {
        if (strcmp(alloc_keys[i].key, key) == 0)
            return ver >= alloc_keys[i].since;
    }
    return 0;
}

const char *oc_alloc_env_name(long ver)
{
    /* Up to 2.10 the CUDA allocator reads only PYTORCH_CUDA_ALLOC_CONF (2.9's
     * generic PYTORCH_ALLOC_CONF never reached it, pytorch issue 183387); from
     * 2.11 PYTORCH_ALLOC_CONF is the documented name. */
    return ver >= 21100 ? OC_VAR("PYTORCH_ALLOC_CONF") : OC_VAR("PYTORCH_CUDA_ALLOC_CONF");
}

int oc_alloc_generic_ignored(long ver, const char **value)
{
    /* 2.9 introduced PYTORCH_ALLOC_CONF and warns that PYTORCH_CUDA_ALLOC_CONF
     * is deprecated, but its CUDA allocator (and 2.10's) reads only the old
     * name; 2.11.0 reads both (reported fixed there). */
    *value = NULL;
    if (ver < 20900 || ver >= 21100 || oc_env("PYTORCH_CUDA_ALLOC_CONF") != NULL)
        return 0;
    *value = oc_env("PYTORCH_ALLOC_CONF");
    return *value != NULL;
}

/* The allocator variables in the order torch 2.11+ reads them. */
static const char *const alloc_vars[] = {OC_VAR("PYTORCH_CUDA_ALLOC_CONF"),
                                         OC_VAR("PYTORCH_HIP_ALLOC_CONF"),
                                         OC_VAR("PYTORCH_ALLOC_CONF")};

const char *oc_alloc_var_at(size_t i)
{
    return i < sizeof alloc_vars / sizeof alloc_vars[0] ? alloc_vars[i] : NULL;
}

const char *oc_alloc_user_var(long ver, const char **value)
{
    *value = NULL;
    if (ver < 21100) {
        *value = oc_env("PYTORCH_CUDA_ALLOC_CONF");
        return OC_VAR("PYTORCH_CUDA_ALLOC_CONF");
    }
    for (size_t i = 0; oc_alloc_var_at(i) != NULL; i++) {
        *value = oc_env(alloc_vars[i]);
        if (*value != NULL)
            return alloc_vars[i];
    }
    return oc_alloc_env_name(ver);
}
